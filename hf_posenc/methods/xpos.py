"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): RoPE whose rotated pair k is also scaled,
queries by zeta_k ** (i / scale_base) and keys by zeta_k ** (-j / scale_base), zeta_k = (2k/d + gamma) / (1 + gamma),
so q_i . k_j decays as zeta ** ((i - j) / scale_base). Keys are cached un-rotated and scaled in the shared
attention path, per query block: the factors are taken relative to a centre c, the block's highest query position,
as zeta ** ((i - c) / scale_base) and zeta ** ((c - j) / scale_base). Their product is unchanged, the key factors
are at most 1, and the query factors at most e ** LOG_SCALE_LIMITS[dtype] because the attention path keeps a block's
query positions within `max_query_spread(dtype)` of each other; so every dtype stays finite at any length (one
centre for a whole long prefill overflowed fp16 from about 4,600 tokens and fp32 from about 37,000). Where a call's
queries fit in one spread (float32 and bfloat16 up to about 12,000 tokens at scale_base 512; padded batches and
cached prefills alike), the attention path rotates them once, and a causal forward takes SDPA's causal kernel.

Extrapolation: "bca" is the paper's blockwise causal attention: positions are cut into blocks of `window`
tokens and a query sees the keys of its own and the previous block only."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import BASE_WHY, FLOAT32_TINY, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import RotaryMethod, rotate

DEFAULT_THETA = 10000.0
DEFAULT_WINDOW = 2048
# The largest query factor, e^limit, by dtype. fp16 ends at 65504: e^4 (about 55) leaves the query itself room.
# float32 and bfloat16 end at 3e38: with e^30 (1e13), a masked score (a key after the query, factor up to e^30) stays
# far from overflow and a query's gradient (its key factors as small as e^-30) far from underflow.
LOG_SCALE_LIMITS = {torch.float16: 4.0}
DEFAULT_LOG_SCALE_LIMIT = 30.0


@dataclass
class XposConfig(PosEncConfig):
    theta: float | None = None  # None: the model's own RoPE theta, else 10000
    scale_base: float = 512.0
    gamma: float = 0.4
    extrapolation: str = "none"  # "none" or "bca" (blockwise causal attention)
    window: int | None = None  # BCA block length; None: the model's window, else 2048

    def validate(self) -> None:
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_number("gamma", FLOAT32_TINY)
        # The fastest-decaying pair k = 0 has zeta_0 = gamma / (1 + gamma); over one position it decays by
        # zeta_0 ** (1 / scale_base), which must stay a normal float32 number: below that, the query and key factors
        # of neighbouring positions are already out of float32's range (0.01 gave all-NaN logits).
        smallest = math.log1p(1 / self.gamma) / -math.log(FLOAT32_TINY)
        self.require_number("scale_base", smallest, why=(
            f"with gamma={self.gamma!r}; below {smallest:.4g} the decay over one position, "
            "(gamma / (1 + gamma)) ** (1 / scale_base), underflows float32 to 0"))
        self.require_choice("extrapolation", ("none", "bca"))
        self.require_size("window", 1, "positions", none_means="the model's window, else 2048")


@register_method("xpos", XposConfig)
class Xpos(RotaryMethod):
    rotates_in_attention = True
    rotates_per_query_block = True

    def __init__(self, config: XposConfig, info: ModelInfo):
        super().__init__(config, info)
        dim = info.rotary_dim
        if dim % 2:
            raise PosEncError(f"xPos needs an even rotary dimension; this model's is {dim}.")
        self.theta = float(config.theta or info.rope_theta or DEFAULT_THETA)
        self._inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        zeta = (torch.arange(0, dim, 2, dtype=torch.float64) / dim + config.gamma) / (1 + config.gamma)
        self._log_zeta = torch.cat((zeta, zeta)).log() / config.scale_base  # float64, half-split layout, < 0
        # the largest |log zeta_k| / scale_base is at k = 0, zeta_0 = gamma / (1 + gamma) (plain floats: the method
        # may be built on the meta device, for shape checks)
        self._tokens_per_log_unit = config.scale_base / abs(math.log(config.gamma / (1 + config.gamma)))
        self.window = config.window or info.max_positions or DEFAULT_WINDOW

    def max_query_spread(self, dtype: torch.dtype) -> float:
        return LOG_SCALE_LIMITS.get(dtype, DEFAULT_LOG_SCALE_LIMIT) * self._tokens_per_log_unit

    def frequencies(self, seq_len):
        return self._inv_freq, 1.0

    def rotate_query_key(self, query, key, query_positions, key_positions, seq_len):
        """Rotate and scale one query block and the keys it sees, around the block's highest query position."""
        cos_q, sin_q = self.cos_sin(query_positions, seq_len)
        cos_k, sin_k = self.cos_sin(key_positions, seq_len)
        # Exponents in float64: a float32 product offset * log zeta near 30 is off by up to 1e-6, which the two
        # factors would not cancel (Apple GPUs have no float64: there they stay float32, that far off at the edge).
        exact = torch.float32 if query.device.type == "mps" else torch.float64
        log_zeta = self._log_zeta.to(query.device, exact)
        centre = query_positions.amax(-1, keepdim=True)
        # Both clamps only touch tokens whose scores are masked or undefined: padding queries far below the block's
        # real ones, and keys positioned after every query of the block (position ids that restart).
        query_offset = (query_positions - centre).clamp_min(-self.max_query_spread(query.dtype))
        key_offset = (key_positions - centre).clamp_max(0)
        scale_q = torch.exp(query_offset[..., None].to(exact) * log_zeta).float()[:, None]
        scale_k = torch.exp(-key_offset[..., None].to(exact) * log_zeta).float()[:, None]
        query = rotate(query, (cos_q[:, None] * scale_q).to(query.dtype), (sin_q[:, None] * scale_q).to(query.dtype))
        key = rotate(key, (cos_k[:, None] * scale_k).to(key.dtype), (sin_k[:, None] * scale_k).to(key.dtype))
        return query, key

    @property
    def masks_keys(self) -> bool:
        return self.config.extrapolation == "bca"

    def allowed_keys(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """Blockwise causal attention: a query sees the keys of its own block and the previous one."""
        if not self.masks_keys:
            return None
        query_block = torch.div(query_positions, self.window, rounding_mode="floor")
        key_block = torch.div(key_positions, self.window, rounding_mode="floor")
        return (key_block[:, None, None, :] >= query_block[:, None, :, None] - 1)
