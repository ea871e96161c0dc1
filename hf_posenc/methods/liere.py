"""LieRE (Ostmeier et al. 2024, "LieRE: Generalizing Rotary Position Encodings"): R(p) = exp(sum_i p_i A_i) with a
learned skew-symmetric basis A_i, generic (dense) generators rather than RoPE's fixed 2 x 2 planes; queries become
R(p_q) q and keys R(p_k) k.

For several position axes with generic (non-commuting) A_i, R(x)^T R(y) = R(y - x) holds only approximately.
A causal LM's positions have one axis: R(p) = exp(p A) with one generator, which is exactly relative in exact
arithmetic; in float32 the deviation of matrix_exp grows with |p| ||A|| (tests/test_rotations.py measures both).
`block_size` None makes A dense over the whole rotary dimension (the paper's generic generator); a smaller even
divisor makes it block-diagonal (cheaper). init="rope" starts A at the model's own RoPE generator (its logits
exactly); the off-plane entries then learn. per_head=True learns one generator per key-value head (the paper's are
per head; GQA query heads share their key head's).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..model_info import ModelInfo
from ..registry import register_method
from .block_rotation import INIT_CHOICES, INIT_STD_MAX, BlockRotationMethod, skew_from_upper


@dataclass
class LiereConfig(PosEncConfig):
    block_size: int | None = None  # None: one dense generator over the whole rotary dimension
    init: str = "rope"  # "rope": the model's own RoPE (its logits exactly); "random": entries ~ N(0, init_std^2)
    init_std: float = 0.02
    theta: float | None = None  # RoPE base for init="rope"; None: the model's own, else 10000
    per_head: bool = False  # one generator per key-value head (as the paper), not one shared by all heads

    def validate(self) -> None:
        self.require_size("block_size", 2, "dim", even=True, none_means="the whole rotary dimension")
        self.require_choice("init", INIT_CHOICES)
        self.require_number("init_std", 0.0, INIT_STD_MAX)
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_bool("per_head")


@register_method("liere", LiereConfig)
class Liere(BlockRotationMethod):
    def __init__(self, config: LiereConfig, info: ModelInfo):
        super().__init__(config, info, config.block_size or info.rotary_dim)
        self.generator = nn.Parameter(self.initial_upper(config.init, config.init_std))

    def generators(self):
        return skew_from_upper(self.generator.float(), self.block_size)
