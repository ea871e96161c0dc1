"""RoPE context extension: linear (Positional Interpolation), NTK-aware, dynamic NTK, YaRN, dynamic YaRN,
Llama 3 and LongRoPE, applied to a model that already has RoPE (LLaMA family) or was patched to `rope`.

Every type is one config dataclass here plus a small `ScaledRope` subclass; the frequencies come from
transformers' own `ROPE_INIT_FUNCTIONS` wherever transformers has the type, so the logits equal those of
the same weights loaded with a native `rope_parameters` of that type. Options and defaults are the ones
transformers' `rope_parameters` and the YaRN paper use.

Length-dependent types (`dynamic`, `dynamic-yarn`, `longrope`) rotate queries and the un-rotated key cache
inside the shared attention path, so that at every decoding step the logits equal a fresh full forward of
the text so far (transformers' own dynamic NTK caches keys rotated with an older base and drifts). In a batch each
row rotates at its own length's scale (`LengthDependentRope.cos_sin`), as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..config import (BASE_WHY, FLOAT32_MAX, FLOAT32_TINY, HIDDEN_MAX, MAX_DISTANCE, MIN_BASE, PosEncConfig,
                      require)
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import RotaryMethod
from .rope import RopeConfig, default_inv_freq, theta_to_build_on


RESCALE_EVERY_WHY = "the scale follows the length rounded up to a multiple of it; 1 follows the length exactly"
ATTENTION_FACTOR_WHY = ("cos and sin are multiplied by it, so the scores by its square, which must stay finite in "
                        "float32")


@dataclass
class RopeScalingConfig(PosEncConfig):
    """Options every scaling type shares. `None` means: read it from the model."""

    factor: float | None = None  # new window / original window
    original_max_position_embeddings: int | None = None  # the model's trained window
    rope_theta: float | None = None  # the base of the RoPE being scaled
    partial_rotary_factor: float | None = None  # the share of each head's dimensions that RoPE rotates

    min_factor: ClassVar[float] = 1.0  # factors below this are meaningless for the type
    factor_why: ClassVar[str] = "factor = new window / original window, and this type only extends the context"
    factor_required: ClassVar[bool] = True
    factor_none_means: ClassVar[str | None] = None  # what factor=None stands for, where it may be None

    def validate(self) -> None:
        if self.factor is None and self.factor_required:
            self.refuse("factor", "is required", f"a number >= {self.min_factor:.9g}, e.g. patch_model(model, "
                                                 f"{self.method!r}, factor=4.0) to extend the window 4x")
        self.require_number("factor", self.min_factor, none_means=self.factor_none_means, why=self.factor_why)
        self.require_size("original_max_position_embeddings", 1, "positions", none_means="read from the model's config")
        self.require_number("rope_theta", MIN_BASE, none_means="the model's own", why=BASE_WHY)
        self.require_number("partial_rotary_factor", FLOAT32_TINY, 1.0, none_means="the model's own",
                            why="the fraction of each head's dimensions that rotate")

    def type_parameters(self) -> dict[str, Any]:
        """The type-specific keys of transformers' rope_parameters (None values left out)."""
        return {"factor": self.factor}


@dataclass
class LinearConfig(RopeScalingConfig):
    # factor < 1 stretches positions: unusual but well defined, as long as position / factor stays finite.
    min_factor: ClassVar[float] = MAX_DISTANCE / FLOAT32_MAX
    factor_why: ClassVar[str] = ("positions are divided by it; position / factor must stay finite in float32 for "
                                 "positions up to 2^24")


@dataclass
class NtkConfig(RopeScalingConfig):
    pass


@dataclass
class DynamicConfig(RopeScalingConfig):
    # True: when the scale changes, run the text so far again, so each decoding step equals a fresh full forward
    # (see hf_posenc/engine/replay.py for the cost). False: only rotate the un-rotated key cache inside attention.
    exact_cache: bool = True
    # The scale follows the length rounded up to a multiple of this: it changes (and exact mode replays the text)
    # once per `rescale_every` tokens past the window instead of at every step. 1: the exact current length.
    rescale_every: int = 1

    def validate(self) -> None:
        super().validate()
        self.require_bool("exact_cache")
        self.require_size("rescale_every", 1, "positions", why=RESCALE_EVERY_WHY)


@dataclass
class YarnConfig(RopeScalingConfig):
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1 (or the mscale ratio)
    beta_fast: float = 32.0  # frequencies that turn more than beta_fast times in the window are not interpolated
    beta_slow: float = 1.0  # frequencies that turn fewer than beta_slow times are interpolated fully
    mscale: float | None = None  # DeepSeek-style temperature (with mscale_all_dim); None: not used
    mscale_all_dim: float | None = None  # see mscale; None: not used
    truncate: bool = True  # round the correction range to whole dimensions (transformers' truncate)

    def validate(self) -> None:
        super().validate()
        self.require_number("attention_factor", FLOAT32_TINY, HIDDEN_MAX, none_means="0.1 ln(factor) + 1",
                            why=ATTENTION_FACTOR_WHY)
        self.require_number("beta_fast", FLOAT32_TINY)
        self.require_number("beta_slow", FLOAT32_TINY)
        require(self.beta_fast > self.beta_slow,
                f"{type(self).__name__}.beta_fast={self.beta_fast!r} must be larger than beta_slow="
                f"{self.beta_slow!r}: pass beta_fast > beta_slow (YaRN's defaults are 32 and 1).")
        self.require_number("mscale", FLOAT32_TINY, none_means="not used")
        self.require_number("mscale_all_dim", FLOAT32_TINY, none_means="not used")
        self.require_bool("truncate")

    def type_parameters(self):
        keys = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class DynamicYarnConfig(YarnConfig):
    exact_cache: bool = True  # as DynamicConfig.exact_cache
    rescale_every: int = 1  # as DynamicConfig.rescale_every

    factor_required: ClassVar[bool] = False
    factor_none_means: ClassVar[str | None] = "no upper bound on the dynamic factor"

    def validate(self) -> None:
        super().validate()
        self.require_bool("exact_cache")
        self.require_size("rescale_every", 1, "positions", why=RESCALE_EVERY_WHY)


@dataclass
class Llama3Config(RopeScalingConfig):
    low_freq_factor: float = 1.0  # wavelengths above window / low_freq_factor are interpolated fully
    high_freq_factor: float = 4.0  # wavelengths below window / high_freq_factor are kept

    def validate(self) -> None:
        super().validate()
        self.require_number("low_freq_factor", FLOAT32_TINY)
        self.require_number("high_freq_factor", FLOAT32_TINY)
        require(self.low_freq_factor < self.high_freq_factor,
                f"Llama3Config.low_freq_factor={self.low_freq_factor!r} and high_freq_factor="
                f"{self.high_freq_factor!r}: pass low_freq_factor < high_freq_factor (Llama 3.1 uses 1 and 4).")

    def type_parameters(self):
        return {"factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor}


@dataclass
class LongRopeConfig(RopeScalingConfig):
    short_factor: list[float] | None = None  # one rescale per frequency (rotary_dim / 2 values), within the window
    long_factor: list[float] | None = None  # the same, used once the text is longer than the window
    attention_factor: float | None = None  # None: sqrt(1 + ln(factor) / ln(original window))
    exact_cache: bool = True  # as DynamicConfig.exact_cache (the scale changes once, on crossing the window)

    factor_required: ClassVar[bool] = False
    factor_none_means: ClassVar[str | None] = "the model's max_position_embeddings / original window, as transformers"

    def validate(self) -> None:
        super().validate()
        for key in ("short_factor", "long_factor"):
            if getattr(self, key) is None:
                self.refuse(key, "is required", "a list of rotary_dim / 2 positive numbers, e.g. from the model's "
                                                "own rope_parameters")
            self.require_numbers(key, FLOAT32_TINY, why="one rescale per rotary frequency")
        self.require_number("attention_factor", FLOAT32_TINY, HIDDEN_MAX,
                            none_means="sqrt(1 + ln(factor) / ln(original window))", why=ATTENTION_FACTOR_WHY)
        self.require_bool("exact_cache")

    def type_parameters(self):
        keys = ("factor", "short_factor", "long_factor", "attention_factor")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class ScaledRope(RotaryMethod):
    """A RoPE scaling type. Subclasses say which transformers type computes their frequencies."""

    transformers_type: ClassVar[str] = ""  # key of ROPE_INIT_FUNCTIONS
    native_type: ClassVar[str | None] = None  # the type to write into a saved config.json, if transformers has one

    def __init__(self, config: RopeScalingConfig, info: ModelInfo):
        super().__init__(config, info)
        base_theta = theta_to_build_on(info, config.method, "scales a rotary embedding")
        own = info.rope_parameters or {}
        self.theta = float(config.rope_theta or own.get("rope_theta") or base_theta)
        self.partial_rotary_factor = float(config.partial_rotary_factor or info.partial_rotary_factor)
        self.original_window = config.original_max_position_embeddings or info.original_window
        if not self.original_window:
            raise PosEncError(f"{type(config).__name__}.original_max_position_embeddings is required: this model's "
                              "config states no trained window.")
        self.head_dim = info.head_dim
        self.rotary_dim = int(info.head_dim * self.partial_rotary_factor)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise PosEncError(
                f"{type(config).__name__}.partial_rotary_factor={self.partial_rotary_factor!r} rotates "
                f"{self.rotary_dim} of this model's {info.head_dim} head dimensions; pass a factor for which "
                f"head_dim * factor is an even number >= 2.")
        # On a model without RoPE of its own, the scaling scales the rotary patch it replaced (`rope`): only that
        # patch's theta matters, so a checkpoint replays `rope` with this theta before the scaling.
        self._base_patch = RopeConfig(theta=base_theta) if info.rope_theta is None else None
        self.check(info)
        self._frequency_cache: dict[int, tuple[torch.Tensor, float]] = {}
        if not self.length_dependent:
            # Now, not at the first forward: under torch.compile that forward would trace transformers' config
            # and rope functions, which dynamo cannot (a compiled training step may be the first forward).
            self.frequencies(0)

    def builds_on(self):
        return [self._base_patch] if self._base_patch is not None else []

    def check(self, info: ModelInfo) -> None:
        """Model-dependent validation (subclasses)."""

    @property
    def extended_window(self) -> int:
        return int(self.original_window * (self.config.factor or 1.0))

    def rope_parameters(self) -> dict[str, Any]:
        params = {"rope_type": self.transformers_type, "rope_theta": self.theta,
                  "original_max_position_embeddings": self.original_window, **self.config.type_parameters()}
        if self.partial_rotary_factor != 1.0:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        return params

    def config_max_position_embeddings(self) -> int:
        """What transformers expects in config.max_position_embeddings for this type."""
        return self.extended_window

    def rope_config(self, **rope_parameters: Any) -> LlamaConfig:
        """A config that transformers' RoPE functions read (any family: only the attention shape matters), with
        `rope_parameters` replacing this type's own."""
        return LlamaConfig(hidden_size=self.head_dim, num_attention_heads=1, head_dim=self.head_dim,
                           max_position_embeddings=self.config_max_position_embeddings(),
                           rope_parameters={**self.rope_parameters(), **rope_parameters})

    def native_config_update(self) -> dict[str, Any] | None:
        """{attribute: value} making a LLaMA-family config.json reproduce this method in plain transformers."""
        if self.native_type is None:
            return None
        params = self.rope_parameters()
        params["rope_type"] = self.native_type
        return {"rope_parameters": params, "max_position_embeddings": self.config_max_position_embeddings()}

    def compute_frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        return ROPE_INIT_FUNCTIONS[self.transformers_type](self.rope_config(), None)

    def frequencies(self, seq_len):
        key = self.scale_key(seq_len)
        if key not in self._frequency_cache:
            if len(self._frequency_cache) > 64:
                self._frequency_cache.clear()
            inv_freq, scaling = self.compute_frequencies(seq_len)
            self._frequency_cache[key] = (inv_freq.float(), float(scaling))
        return self._frequency_cache[key]


class LengthDependentRope(ScaledRope):
    """A type whose frequencies depend on the current length: queries and the un-rotated key cache are rotated inside
    the shared attention path and, with `exact_cache`, the text is replayed when the scale changes."""

    rotates_in_attention = True
    length_dependent = True

    @property
    def exact_cache(self) -> bool:
        return self.config.exact_cache

    def cos_sin(self, positions, seq_len=0):
        """As RotaryMethod.cos_sin; `seq_len` may be a tuple with one length per row (the engine passes one where a
        batch's rows have different scales): each row then rotates at its own length's frequencies and attention
        factor, as it would alone, not at the longest row's (a left-padded batch; issue 51)."""
        if not isinstance(seq_len, tuple):
            return super().cos_sin(positions, seq_len)
        per_row = [self.frequencies(length) for length in seq_len]
        inv_freq = torch.stack([frequencies for frequencies, _ in per_row]).to(positions.device)  # [B, rotary_dim / 2]
        scaling = torch.tensor([factor for _, factor in per_row], device=positions.device)[:, None, None]
        freqs = positions[..., None].float() * inv_freq[:, None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * scaling, angles.sin() * scaling


class DynamicRope(LengthDependentRope):
    """A type whose scale grows with the length past the original window (`dynamic`, `dynamic-yarn`), following the
    length rounded up to a multiple of `rescale_every`: within one such bucket every step has the same frequencies,
    so exact mode replays the text once per bucket, and each step equals a fresh forward at that bucket's scale."""

    def scaled_length(self, seq_len: int) -> int:
        """The length the scale is computed for: the length itself within the window, else rounded up to a multiple
        of rescale_every."""
        if seq_len <= self.original_window:
            return seq_len
        step = self.config.rescale_every
        return -(-seq_len // step) * step

    def native_config_update(self):
        # transformers' own dynamic types follow the exact length: only rescale_every=1 is theirs.
        return super().native_config_update() if self.config.rescale_every == 1 else None


@register_method("linear", LinearConfig)
class LinearRope(ScaledRope):
    """Positional Interpolation (Chen et al. 2023): positions divided by `factor`."""

    transformers_type = native_type = "linear"

    def rope_parameters(self):
        params = super().rope_parameters()
        del params["original_max_position_embeddings"]  # not a key of transformers' linear type
        return params


@register_method("ntk", NtkConfig)
class NtkRope(ScaledRope):
    """NTK-aware scaling: the base becomes theta * factor^(d / (d - 2)); everything else is plain RoPE."""

    native_type = "default"

    def check(self, info):
        d = self.rotary_dim
        if d <= 2:
            raise PosEncError(f"NTK scaling raises theta to factor ** (d / (d - 2)) and needs a rotary dimension "
                              f"d > 2; this model rotates {d}. Use 'linear' or 'yarn' instead.")
        base = self.theta * self.config.factor ** (d / (d - 2))
        if base > FLOAT32_MAX:
            largest = (FLOAT32_MAX / self.theta) ** ((d - 2) / d)
            raise PosEncError(f"NtkConfig.factor={self.config.factor!r} makes the RoPE base theta * factor ** (d / "
                              f"(d - 2)) = {base:.4g}, beyond float32; pass a factor up to {largest:.4g} for this "
                              f"model (theta {self.theta:g}, d {d}).")

    def rope_parameters(self):
        d = self.rotary_dim
        params = {"rope_type": "default", "rope_theta": self.theta * self.config.factor ** (d / (d - 2))}
        if self.partial_rotary_factor != 1.0:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        return params

    def compute_frequencies(self, seq_len):
        return default_inv_freq(self.rope_parameters()["rope_theta"], self.rotary_dim), 1.0


@register_method("dynamic", DynamicConfig)
class DynamicNtkRope(DynamicRope):
    """Dynamic NTK: the NTK base grows with the current length once it passes the original window."""

    transformers_type = native_type = "dynamic"

    def rope_parameters(self):
        params = super().rope_parameters()
        del params["original_max_position_embeddings"]  # transformers reads it from max_position_embeddings
        return params

    def config_max_position_embeddings(self):
        return self.original_window

    def scale_key(self, seq_len):
        return self.scaled_length(seq_len) if seq_len > self.original_window else 0

    def compute_frequencies(self, seq_len):
        # A tensor length, as transformers passes it, so the base is computed in the same float32 arithmetic.
        length = self.scaled_length(seq_len)
        return ROPE_INIT_FUNCTIONS["dynamic"](self.rope_config(), None, seq_len=torch.tensor(max(length, 1)))


@register_method("yarn", YarnConfig)
class YarnRope(ScaledRope):
    """YaRN (Peng et al. 2023): NTK-by-parts interpolation plus an attention temperature."""

    transformers_type = native_type = "yarn"


@register_method("dynamic-yarn", DynamicYarnConfig)
class DynamicYarnRope(DynamicRope):
    """YaRN whose factor is max(1, current length / original window), up to `factor` if given (the YaRN paper's
    dynamic scaling); no scaling at all within the original window. Not a transformers type."""

    transformers_type = "yarn"

    def scale_key(self, seq_len):
        if seq_len <= self.original_window:
            return 0
        length = self.scaled_length(seq_len)
        return min(length, self.extended_window) if self.config.factor is not None else length

    def compute_frequencies(self, seq_len):
        factor = self.scaled_length(seq_len) / self.original_window
        if self.config.factor is not None:
            factor = min(factor, self.config.factor)
        if factor <= 1.0:
            return default_inv_freq(self.theta, self.rotary_dim), 1.0
        return ROPE_INIT_FUNCTIONS["yarn"](self.rope_config(factor=factor), None)


@register_method("llama3", Llama3Config)
class Llama3Rope(ScaledRope):
    """Llama 3.1's frequency-dependent interpolation: low frequencies divided by `factor`, high ones kept."""

    transformers_type = native_type = "llama3"


@register_method("longrope", LongRopeConfig)
class LongRope(LengthDependentRope):
    """LongRoPE (Ding et al. 2024): per-frequency rescale factors, the short set within the original window and
    the long set beyond it (chosen by the current length, so it rotates inside attention to stay exact)."""

    transformers_type = native_type = "longrope"

    def __init__(self, config: LongRopeConfig, info: ModelInfo):
        super().__init__(config, info)
        # With factor=None the extended window is the model's max_position_embeddings, as transformers reads it
        # (Phi-3's configs state it that way): the attention factor is then sqrt(1 + ln(window / original) /
        # ln(original)), 1.19 for 131072 / 4096.
        self.model_window = max(info.max_positions or 0, self.original_window)

    def check(self, info):
        expected = self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            got = len(getattr(self.config, key))
            if got != expected:
                raise PosEncError(f"LongRopeConfig.{key} has {got} values; this model needs rotary_dim / 2 = "
                                  f"{expected} (one per frequency).")

    @property
    def extended_window(self):
        return int(self.original_window * self.config.factor) if self.config.factor else self.model_window

    def scale_key(self, seq_len):
        return seq_len > self.original_window

    def compute_frequencies(self, seq_len):
        return ROPE_INIT_FUNCTIONS["longrope"](self.rope_config(), None, seq_len=seq_len)
