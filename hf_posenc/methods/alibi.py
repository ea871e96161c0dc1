"""ALiBi (Press et al. 2022): a per-head linear penalty -slope_h * (i - j) on attention scores."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import BIAS_MAX, MAX_DISTANCE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import AttentionBiasMethod, relative_distance

MAX_SLOPE = BIAS_MAX / MAX_DISTANCE  # the bias -slope * (i - j) stays finite up to the longest distance


@dataclass
class AlibiConfig(PosEncConfig):
    slopes: str | list[float] = "bloom"  # "bloom", "geometric", or one slope per query head
    trainable: bool = False

    def validate(self) -> None:
        if isinstance(self.slopes, str):
            if self.slopes not in ("bloom", "geometric"):
                self.refuse("slopes", "is not a known recipe", "'bloom', 'geometric' or a list of one slope per head")
        else:
            self.require_numbers("slopes", 0.0, MAX_SLOPE, why=(
                "one slope per head, >= 0 since ALiBi penalises distance; slope * distance must stay within "
                f"{BIAS_MAX:.4g} in float32 for distances up to 2^24"))
        self.require_bool("trainable")


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """BLOOM's recipe: the geometric sequence for the nearest lower power of two, and for the remaining heads
    every other slope of the sequence for twice that many heads. Computed in float32 as BLOOM does, so the
    values match its own bit for bit."""
    power = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(power) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + power, dtype=torch.int32))
    if power != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * power) - 3))), dtype=torch.float32)
        extra = min(power, num_heads - power)
        slopes = torch.cat([slopes, torch.pow(extra_base, torch.arange(1, 1 + 2 * extra, 2, dtype=torch.int32))])
    return slopes


def geometric_slopes(num_heads: int) -> torch.Tensor:
    """2^(-8h/H) for h = 1..H (the paper's formula applied to any head count)."""
    return torch.pow(2.0, -8.0 * torch.arange(1, num_heads + 1, dtype=torch.float64) / num_heads).float()


@register_method("alibi", AlibiConfig)
class Alibi(AttentionBiasMethod):
    def __init__(self, config: AlibiConfig, info: ModelInfo):
        super().__init__(config, info)
        if isinstance(config.slopes, str):
            slopes = bloom_slopes(info.num_heads) if config.slopes == "bloom" else geometric_slopes(info.num_heads)
        else:
            if len(config.slopes) != info.num_heads:
                raise PosEncError(
                    f"AlibiConfig.slopes has {len(config.slopes)} values but the model has {info.num_heads} "
                    "attention heads: give one slope per head."
                )
            slopes = torch.tensor(config.slopes, dtype=torch.float32)
        if config.trainable:
            self.slopes = nn.Parameter(slopes)
        else:
            # Kept out of the state dict and recomputed per device, so model.to(bfloat16) cannot round it.
            self._fixed_slopes = slopes
            self._per_device: dict[torch.device, torch.Tensor] = {}

    def head_slopes(self, device: torch.device) -> torch.Tensor:
        """float32 [H]: the slopes (the trainable parameter itself when trainable)."""
        if self.config.trainable:
            return self.slopes.float()
        if device not in self._per_device:
            self._per_device[device] = self._fixed_slopes.to(device)
        return self._per_device[device]

    def alibi_slopes(self, device):
        return None if self.config.trainable else self.head_slopes(device)

    def bias_table(self, layer_idx, num_distances, max_position=None, device=None):
        slopes = self.head_slopes(device if device is not None else torch.device("cpu"))
        return -slopes[:, None] * torch.arange(num_distances, device=slopes.device, dtype=torch.float32)

    def bias(self, layer_idx, query_positions, key_positions):
        slopes = self.head_slopes(query_positions.device)
        return -slopes[None, :, None, None] * relative_distance(query_positions, key_positions)
