"""T5 relative position bias (Raffel et al. 2020): distances fall into log-spaced buckets and each bucket has a
learned bias per head. Causal (one-sided): all `num_buckets` cover distances i - j >= 0."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import PosEncConfig, require
from ..model_info import ModelInfo
from ..registry import register_method
from .distance import DistanceBiasMethod


@dataclass
class T5Config(PosEncConfig):
    num_buckets: int = 32
    max_distance: int = 128  # distances from here on share the last bucket
    per_layer: bool = False  # False: one table shared by all layers, as T5 does
    init: str = "normal"  # "normal" (N(0, init_std), T5's own) or "zeros" (starts as NoPE)
    init_std: float = 0.02

    def validate(self) -> None:
        require(isinstance(self.num_buckets, int) and not isinstance(self.num_buckets, bool) and self.num_buckets >= 2,
                f"T5Config.num_buckets={self.num_buckets!r} must be an integer >= 2.")
        require(isinstance(self.max_distance, int) and not isinstance(self.max_distance, bool)
                and self.max_distance > self.num_buckets // 2,
                f"T5Config.max_distance={self.max_distance!r} must be an integer > num_buckets // 2 "
                f"(= {self.num_buckets // 2 if isinstance(self.num_buckets, int) else '?'}).")
        require(isinstance(self.per_layer, bool), f"T5Config.per_layer={self.per_layer!r} must be True or False.")
        require(self.init in ("normal", "zeros"), f"T5Config.init={self.init!r}: use 'normal' or 'zeros'.")
        require(isinstance(self.init_std, (int, float)) and math.isfinite(self.init_std) and self.init_std >= 0,
                f"T5Config.init_std={self.init_std!r} must be a non-negative number.")


def causal_buckets(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's `_relative_position_bucket` with bidirectional=False, for distances i - j >= 0 -> long buckets."""
    exact = num_buckets // 2
    distance = distance.long()
    scaled = torch.log(distance.float().clamp_min(1) / exact) / math.log(max_distance / exact)
    large = exact + (scaled * (num_buckets - exact)).long()
    return torch.where(distance < exact, distance, large.clamp_max(num_buckets - 1))


@register_method("t5", T5Config)
class T5Bias(DistanceBiasMethod):
    def __init__(self, config: T5Config, info: ModelInfo):
        super().__init__(config, info)
        tables = info.num_layers if config.per_layer else 1
        weight = torch.zeros(tables, config.num_buckets, info.num_heads)
        if config.init == "normal":
            weight.normal_(0.0, config.init_std)
        self.weight = nn.Parameter(weight)

    def distance_bias(self, layer_idx, distance):
        buckets = causal_buckets(distance, self.config.num_buckets, self.config.max_distance)
        weight = self.weight[layer_idx if self.config.per_layer else 0].float()
        return weight[buckets].transpose(0, 1)
