"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of Receptive Field
Analysis"): the dot product of two sinusoidal position embeddings, p_i . p_j = sum_k cos((i - j) w_k), used as a
parameter-free bias. Shifted by -d'/2 so that it is 0 at distance 0, and divided per head by 8h/H (h = 1..H),
the paper's ALiBi-like head scaling, so heads see different effective windows.

d' (`dim`) defaults to the model's head dimension, the size of the query-key products the bias is added to, as the
reference implementation does (NeMo's SandwichRelativePositionEmbedding takes the "hidden size per attention
head"); a fixed d' = 128 matched only models with 128-dimensional heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .distance import DistanceBiasMethod


@dataclass
class SandwichConfig(PosEncConfig):
    dim: int | None = None  # d' of the sinusoids, even; None: the model's head dimension (see the module doc)
    base: float = 10000.0
    head_scaling: bool = True

    def validate(self) -> None:
        self.require_size("dim", 2, "dim", none_means="the model's head dimension", even=True)
        self.require_number("base", MIN_BASE, why=BASE_WHY)
        self.require_bool("head_scaling")


@register_method("sandwich", SandwichConfig)
class Sandwich(DistanceBiasMethod):
    def __init__(self, config: SandwichConfig, info: ModelInfo):
        super().__init__(config, info)
        self.dim = config.dim or info.head_dim
        if self.dim % 2:
            raise PosEncError(f"Sandwich needs an even d'; this model's head dimension is {info.head_dim}. Pass an "
                              "even dim, e.g. patch_model(model, 'sandwich', dim=128).")
        half = self.dim // 2
        self._inv_freq = config.base ** (-2.0 * torch.arange(1, half + 1, dtype=torch.float64) / self.dim)
        heads = info.num_heads
        scale = 8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads if config.head_scaling \
            else torch.ones(heads, dtype=torch.float64)
        self._head_scale = scale

    def distance_bias(self, layer_idx, distance):
        # Sum in float64: d' cosines of up to d' / 2 in magnitude would lose digits near the diagonal in float32.
        inv_freq = self._inv_freq.to(distance.device)
        dot = torch.cos(distance.double()[:, None] * inv_freq).sum(-1) - inv_freq.numel()
        return (dot[None] / self._head_scale.to(distance.device)[:, None]).float()
