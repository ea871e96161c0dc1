"""RoPE context extension: linear (Positional Interpolation), NTK-aware, dynamic NTK, YaRN, dynamic YaRN,
Llama 3 and LongRoPE, applied to a model that already has RoPE (LLaMA family) or was patched to `rope`.

Every type is one config dataclass here plus a small `ScaledRope` subclass; the frequencies come from
transformers' own `ROPE_INIT_FUNCTIONS` wherever transformers has the type, so the logits equal those of
the same weights loaded with a native `rope_parameters` of that type. Options and defaults are the ones
transformers' `rope_parameters` and the YaRN paper use.

Length-dependent types (`dynamic`, `dynamic-yarn`, `longrope`) rotate queries and the un-rotated key cache
inside the shared attention path, so that at every decoding step the logits equal a fresh full forward of
the text so far (transformers' own dynamic NTK caches keys rotated with an older base and drifts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..config import PosEncConfig, require
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import RotaryMethod
from .rope import default_inv_freq


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass
class RopeScalingConfig(PosEncConfig):
    """Options every scaling type shares. `None` means: read it from the model."""

    factor: float | None = None
    original_max_position_embeddings: int | None = None  # the model's trained window
    rope_theta: float | None = None  # the base of the RoPE being scaled
    partial_rotary_factor: float | None = None

    min_factor: ClassVar[float] = 1.0  # factors below this are meaningless for the type
    factor_required: ClassVar[bool] = True

    def validate(self) -> None:
        name = type(self).__name__
        if self.factor is None:
            require(not self.factor_required, f"{name}.factor is required, e.g. patch_model(model, "
                                              f"{self.method!r}, factor=4.0) to extend the window 4x.")
        else:
            require(_positive(self.factor), f"{name}.factor={self.factor!r} must be a number > 0.")
            require(self.factor >= self.min_factor,
                    f"{name}.factor={self.factor!r} is below {self.min_factor}: {self.method!r} extends the "
                    f"context, so the factor is the ratio new window / original window (>= {self.min_factor}).")
        require(self.original_max_position_embeddings is None
                or (isinstance(self.original_max_position_embeddings, int)
                    and self.original_max_position_embeddings > 0),
                f"{name}.original_max_position_embeddings={self.original_max_position_embeddings!r} must be a "
                "positive integer (or None to read it from the model's config).")
        require(self.rope_theta is None or (_positive(self.rope_theta) and self.rope_theta > 1),
                f"{name}.rope_theta={self.rope_theta!r} must be a number > 1 (or None for the model's own).")
        require(self.partial_rotary_factor is None
                or (_positive(self.partial_rotary_factor) and self.partial_rotary_factor <= 1),
                f"{name}.partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1].")
        if hasattr(self, "exact_cache"):  # the length-dependent types
            require(isinstance(self.exact_cache, bool), f"{name}.exact_cache={self.exact_cache!r} must be True or False.")

    def type_parameters(self) -> dict[str, Any]:
        """The type-specific keys of transformers' rope_parameters (None values left out)."""
        return {"factor": self.factor}


@dataclass
class LinearConfig(RopeScalingConfig):
    min_factor: ClassVar[float] = 0.0  # factor < 1 compresses positions: unusual but well defined


@dataclass
class NtkConfig(RopeScalingConfig):
    pass


@dataclass
class DynamicConfig(RopeScalingConfig):
    # True: when the scale changes, run the text so far again, so each decoding step equals a fresh full forward
    # (see hf_posenc/replay.py for the cost). False: only rotate the un-rotated key cache inside attention.
    exact_cache: bool = True


@dataclass
class YarnConfig(RopeScalingConfig):
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1 (or the mscale ratio)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        require(self.attention_factor is None or _positive(self.attention_factor),
                f"{name}.attention_factor={self.attention_factor!r} must be a number > 0 (or None).")
        require(_positive(self.beta_fast) and _positive(self.beta_slow),
                f"{name}.beta_fast={self.beta_fast!r} and beta_slow={self.beta_slow!r} must be numbers > 0.")
        require(self.beta_fast > self.beta_slow,
                f"{name}.beta_fast={self.beta_fast!r} must be larger than beta_slow={self.beta_slow!r}.")
        for key in ("mscale", "mscale_all_dim"):
            value = getattr(self, key)
            require(value is None or _positive(value), f"{name}.{key}={value!r} must be a number > 0 (or None).")
        require(isinstance(self.truncate, bool), f"{name}.truncate={self.truncate!r} must be True or False.")

    def type_parameters(self):
        keys = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class DynamicYarnConfig(YarnConfig):
    exact_cache: bool = True  # as DynamicConfig.exact_cache

    factor_required: ClassVar[bool] = False  # None: no upper bound on the dynamic factor


@dataclass
class Llama3Config(RopeScalingConfig):
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def validate(self) -> None:
        super().validate()
        require(_positive(self.low_freq_factor) and _positive(self.high_freq_factor)
                and self.low_freq_factor < self.high_freq_factor,
                f"Llama3Config.low_freq_factor={self.low_freq_factor!r} and high_freq_factor="
                f"{self.high_freq_factor!r} must be numbers > 0 with low < high.")

    def type_parameters(self):
        return {"factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor}


@dataclass
class LongRopeConfig(RopeScalingConfig):
    short_factor: list[float] | None = None  # one rescale per frequency (rotary_dim / 2 values), within the window
    long_factor: list[float] | None = None  # the same, used once the text is longer than the window
    attention_factor: float | None = None  # None: sqrt(1 + ln(factor) / ln(original window))
    exact_cache: bool = True  # as DynamicConfig.exact_cache (the scale changes once, on crossing the window)

    factor_required: ClassVar[bool] = False  # None: max_position_embeddings / original window, as transformers

    def validate(self) -> None:
        super().validate()
        for key in ("short_factor", "long_factor"):
            value = getattr(self, key)
            require(isinstance(value, (list, tuple)) and len(value) > 0,
                    f"LongRopeConfig.{key} is required: a list of rotary_dim / 2 positive floats "
                    f"(e.g. from the model's own rope_parameters).")
            require(all(_positive(v) for v in value), f"LongRopeConfig.{key} must hold only numbers > 0.")
            setattr(self, key, [float(v) for v in value])
        require(self.attention_factor is None or _positive(self.attention_factor),
                f"LongRopeConfig.attention_factor={self.attention_factor!r} must be a number > 0 (or None).")

    def type_parameters(self):
        keys = ("factor", "short_factor", "long_factor", "attention_factor")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class ScaledRope(RotaryMethod):
    """A RoPE scaling type. Subclasses say which transformers type computes their frequencies."""

    transformers_type: ClassVar[str] = ""  # key of ROPE_INIT_FUNCTIONS
    native_type: ClassVar[str | None] = None  # the type to write into a saved config.json, if transformers has one

    def __init__(self, config: RopeScalingConfig, info: ModelInfo):
        super().__init__(config, info)
        base_theta = info.rope_theta or info.patched_rope_theta
        if base_theta is None:
            raise PosEncError(
                f"{config.method!r} scales a rotary embedding, and this {info.model_type} model has none. Patch "
                f"it to 'rope' first: patch_model(model, 'rope'), then patch_model(model, {config.method!r}, ...)."
            )
        own = info.rope_parameters or {}
        self.theta = float(config.rope_theta or own.get("rope_theta") or base_theta)
        self.partial_rotary_factor = float(config.partial_rotary_factor or info.partial_rotary_factor)
        self.original_window = config.original_max_position_embeddings or info.original_window
        if not self.original_window:
            raise PosEncError(f"{type(config).__name__}.original_max_position_embeddings is required: this model's "
                              "config states no trained window.")
        self.head_dim = info.head_dim
        self.rotary_dim = int(info.head_dim * self.partial_rotary_factor)
        self.check(info)
        self._frequency_cache: dict[int, tuple[torch.Tensor, float]] = {}

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

    def rope_config(self) -> LlamaConfig:
        """A config that transformers' RoPE functions read (any family: only the attention shape matters)."""
        return LlamaConfig(hidden_size=self.head_dim, num_attention_heads=1, head_dim=self.head_dim,
                           max_position_embeddings=self.config_max_position_embeddings(),
                           rope_parameters=self.rope_parameters())

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

    def rope_parameters(self):
        d = self.rotary_dim
        params = {"rope_type": "default", "rope_theta": self.theta * self.config.factor ** (d / (d - 2))}
        if self.partial_rotary_factor != 1.0:
            params["partial_rotary_factor"] = self.partial_rotary_factor
        return params

    def compute_frequencies(self, seq_len):
        return default_inv_freq(self.rope_parameters()["rope_theta"], self.rotary_dim), 1.0


@register_method("dynamic", DynamicConfig)
class DynamicNtkRope(ScaledRope):
    """Dynamic NTK: the NTK base grows with the current length once it passes the original window."""

    transformers_type = native_type = "dynamic"
    rotates_in_attention = True
    length_dependent = True

    def rope_parameters(self):
        params = super().rope_parameters()
        del params["original_max_position_embeddings"]  # transformers reads it from max_position_embeddings
        return params

    def config_max_position_embeddings(self):
        return self.original_window

    def scale_key(self, seq_len):
        return seq_len if seq_len > self.original_window else 0

    def compute_frequencies(self, seq_len):
        # A tensor length, as transformers passes it, so the base is computed in the same float32 arithmetic.
        return ROPE_INIT_FUNCTIONS["dynamic"](self.rope_config(), None, seq_len=torch.tensor(max(seq_len, 1)))


@register_method("yarn", YarnConfig)
class YarnRope(ScaledRope):
    """YaRN (Peng et al. 2023): NTK-by-parts interpolation plus an attention temperature."""

    transformers_type = native_type = "yarn"


@register_method("dynamic-yarn", DynamicYarnConfig)
class DynamicYarnRope(ScaledRope):
    """YaRN whose factor is max(1, current length / original window), up to `factor` if given (the YaRN paper's
    dynamic scaling); no scaling at all within the original window. Not a transformers type."""

    transformers_type = "yarn"
    rotates_in_attention = True
    length_dependent = True

    def scale_key(self, seq_len):
        if seq_len <= self.original_window:
            return 0
        return min(seq_len, self.extended_window) if self.config.factor is not None else seq_len

    def compute_frequencies(self, seq_len):
        factor = seq_len / self.original_window
        if self.config.factor is not None:
            factor = min(factor, self.config.factor)
        if factor <= 1.0:
            return default_inv_freq(self.theta, self.rotary_dim), 1.0
        config = self.rope_config()
        config.rope_parameters["factor"] = factor
        return ROPE_INIT_FUNCTIONS["yarn"](config, None)


@register_method("llama3", Llama3Config)
class Llama3Rope(ScaledRope):
    """Llama 3.1's frequency-dependent interpolation: low frequencies divided by `factor`, high ones kept."""

    transformers_type = native_type = "llama3"


@register_method("longrope", LongRopeConfig)
class LongRope(ScaledRope):
    """LongRoPE (Ding et al. 2024): per-frequency rescale factors, the short set within the original window and
    the long set beyond it (chosen by the current length, so it rotates inside attention to stay exact)."""

    transformers_type = native_type = "longrope"
    rotates_in_attention = True
    length_dependent = True

    def check(self, info):
        expected = self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            got = len(getattr(self.config, key))
            if got != expected:
                raise PosEncError(f"LongRopeConfig.{key} has {got} values; this model needs rotary_dim / 2 = "
                                  f"{expected} (one per frequency).")

    @property
    def extended_window(self):
        return int(self.original_window * self.config.factor) if self.config.factor else self.original_window

    def scale_key(self, seq_len):
        return seq_len > self.original_window

    def compute_frequencies(self, seq_len):
        return ROPE_INIT_FUNCTIONS["longrope"](self.rope_config(), None, seq_len=seq_len)
