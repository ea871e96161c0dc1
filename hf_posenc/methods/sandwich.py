"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of Receptive Field
Analysis"): the dot product of two sinusoidal position embeddings, p_i . p_j = sum_k cos((i - j) w_k), used as a
parameter-free bias. Shifted by -dim/2 so that it is 0 at distance 0, and divided per head by 8h/H (h = 1..H),
the paper's ALiBi-like head scaling, so heads see different effective windows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PosEncConfig, require
from ..model_info import ModelInfo
from ..registry import register_method
from .distance import DistanceBiasMethod


@dataclass
class SandwichConfig(PosEncConfig):
    dim: int = 128  # d' of the sinusoids (the paper's hyper-parameter), even
    base: float = 10000.0
    head_scaling: bool = True

    def validate(self) -> None:
        require(isinstance(self.dim, int) and not isinstance(self.dim, bool) and self.dim >= 2 and self.dim % 2 == 0,
                f"SandwichConfig.dim={self.dim!r} must be an even integer >= 2.")
        require(isinstance(self.base, (int, float)) and self.base > 1, f"SandwichConfig.base={self.base!r} must be > 1.")
        require(isinstance(self.head_scaling, bool),
                f"SandwichConfig.head_scaling={self.head_scaling!r} must be True or False.")


@register_method("sandwich", SandwichConfig)
class Sandwich(DistanceBiasMethod):
    def __init__(self, config: SandwichConfig, info: ModelInfo):
        super().__init__(config, info)
        half = config.dim // 2
        self._inv_freq = config.base ** (-2.0 * torch.arange(1, half + 1, dtype=torch.float64) / config.dim)
        heads = info.num_heads
        scale = 8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads if config.head_scaling \
            else torch.ones(heads, dtype=torch.float64)
        self._head_scale = scale

    def distance_bias(self, layer_idx, distance):
        # Sum in float64: d' cosines of up to d' / 2 in magnitude would lose digits near the diagonal in float32.
        inv_freq = self._inv_freq.to(distance.device)
        dot = torch.cos(distance.double()[:, None] * inv_freq).sum(-1) - inv_freq.numel()
        return (dot[None] / self._head_scale.to(distance.device)[:, None]).float()
