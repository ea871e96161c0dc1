"""ComRoPE (Yu et al. 2025, "ComRoPE: Scalable and Robust Rotary Position Embedding Parameterized by Trainable
Commuting Angle Matrices"): R(x) = exp(sum_i x_i A_i) with trainable skew-symmetric angle matrices A_i, block-diagonal
with block size b, chosen to commute so that R(x)^T R(y) = R(y - x) and attention scores depend on relative position
only. Two ways to make them commute:

- `comrope-ap` (axial-partition): each block belongs to one axis, so the A_i act on disjoint blocks; every block
  B_j of A is a free skew-symmetric b x b matrix;
- `comrope-ld` (linearly dependent): A_i = theta_i B, multiples of one block-diagonal skew-symmetric B.

A causal LM's positions have one axis (x = the token's position), so here R(p) = exp(p A) with A = blockdiag(B_j)
(AP) or A = theta B (LD: the scalar theta trains the overall rate apart from the planes). Queries become R(i) q and
keys R(j) k, so q_i . k_j = q^T R(j - i) k. b = 2 is RoPE with trainable frequencies; init="rope" starts every block
at the model's own RoPE frequencies (see block_rotation.py for the layout), reproducing its logits. per_head=True
gives every key-value head its own angle matrices (and LD its own theta), as the paper's per-head matrices; the
query heads of a GQA group share their key head's, since they attend to the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..model_info import ModelInfo
from ..registry import register_method
from .block_rotation import INIT_CHOICES, INIT_STD_MAX, BlockRotationMethod, skew_from_upper


@dataclass
class ComRopeConfig(PosEncConfig):
    block_size: int = 4  # b: an even divisor of the rotary dimension
    init: str = "rope"  # "rope": the model's own RoPE (its logits exactly); "random": entries ~ N(0, init_std^2)
    init_std: float = 0.02
    theta: float | None = None  # RoPE base for init="rope"; None: the model's own, else 10000
    per_head: bool = False  # one generator per key-value head (as the paper), not one shared by all heads

    def validate(self) -> None:
        self.require_size("block_size", 2, "dim", even=True)
        self.require_choice("init", INIT_CHOICES)
        self.require_number("init_std", 0.0, INIT_STD_MAX)
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_bool("per_head")


@dataclass
class ComRopeApConfig(ComRopeConfig):
    pass


@dataclass
class ComRopeLdConfig(ComRopeConfig):
    pass


@register_method("comrope-ap", ComRopeApConfig)
class ComRopeAp(BlockRotationMethod):
    def __init__(self, config: ComRopeApConfig, info: ModelInfo):
        super().__init__(config, info, config.block_size)
        self.angle_matrices = nn.Parameter(self.initial_upper(config.init, config.init_std))

    def generators(self):
        return skew_from_upper(self.angle_matrices.float(), self.block_size)


@register_method("comrope-ld", ComRopeLdConfig)
class ComRopeLd(BlockRotationMethod):
    def __init__(self, config: ComRopeLdConfig, info: ModelInfo):
        super().__init__(config, info, config.block_size)
        self.base_matrix = nn.Parameter(self.initial_upper(config.init, config.init_std))
        heads = () if self.rotation_heads is None else (self.rotation_heads, 1, 1)
        self.axis_scale = nn.Parameter(torch.ones(*heads, 1))

    def generators(self):
        return self.axis_scale.float() * skew_from_upper(self.base_matrix.float(), self.block_size)
