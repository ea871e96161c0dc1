"""T5 relative position bias (Raffel et al. 2020): distances fall into log-spaced buckets and each bucket has a
learned bias per head. Causal (one-sided): all `num_buckets` cover distances i - j >= 0."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import BIAS_MAX, NORMAL_REACH, PosEncConfig
from ..model_info import ModelInfo
from ..registry import register_method
from .distance import DistanceBiasMethod


@dataclass
class T5Config(PosEncConfig):
    num_buckets: int = 32
    max_distance: int = 128  # distances from here on share the last bucket
    per_layer: bool = False  # False: one table shared by all layers, as T5 does
    init: str = "normal"  # "normal" (N(0, init_std)) or "zeros" (starts as NoPE)
    # None: hidden_size ** -0.5, T5's own initialisation of relative_attention_bias (initializer_factor *
    # d_model ** -0.5 in transformers' T5PreTrainedModel._init_weights, with factor 1).
    init_std: float | None = None

    def validate(self) -> None:
        self.require_size("num_buckets", 2, "table")
        self.require_size("max_distance", self.num_buckets // 2 + 1, "positions",
                         why="the first num_buckets // 2 buckets hold one distance each; the rest are log-spaced up "
                             "to max_distance")
        self.require_bool("per_layer")
        self.require_choice("init", ("normal", "zeros"))
        self.require_number("init_std", 0.0, BIAS_MAX / NORMAL_REACH, none_means="hidden_size ** -0.5, as T5",
                            why=f"draws up to {NORMAL_REACH:g} standard deviations must stay within the float32 "
                                f"bias range {BIAS_MAX:.4g}")


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
            weight.normal_(0.0, info.hidden_size ** -0.5 if config.init_std is None else config.init_std)
        self.weight = nn.Parameter(weight)

    def distance_bias(self, layer_idx, distance):
        buckets = causal_buckets(distance, self.config.num_buckets, self.config.max_distance)
        weight = self.weight[layer_idx if self.config.per_layer else 0].float()
        return weight[buckets].transpose(0, 1)
