"""ReRoPE (Su 2023, "Rectified Rotary Position Embeddings", as in jquesnelle/yarn): relative distances clipped at
`window`. Keys within the window keep their ordinary positions; beyond it every key is seen at distance exactly
`window` (the query rotated to position `window`, the key left at 0). With `log_scaling`, queries at position i are
multiplied by max(1, log(i + 1) / log(trained window)) before both, Su's log-n scaling (1 within the trained window,
so the model is unchanged there)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import PosEncError
from ..registry import register_method
from .neighbour_window import NeighbourWindowConfig, NeighbourWindowRope


@dataclass
class ReropeConfig(NeighbourWindowConfig):
    log_scaling: bool = False

    def validate(self) -> None:
        super().validate()
        self.require_bool("log_scaling")


@register_method("rerope", ReropeConfig)
class Rerope(NeighbourWindowRope):
    def __init__(self, config: ReropeConfig, info):
        super().__init__(config, info)
        if config.log_scaling and (self.original_window or 0) < 2:
            raise PosEncError("ReropeConfig.log_scaling=True divides by log(trained window), and this model's config "
                              "states none (or 1); pass original_max_position_embeddings=... (e.g. 2048).")

    def far_query_positions(self, query_positions):
        return torch.full_like(query_positions, self.window)

    def far_key_positions(self, key_positions):
        return torch.zeros_like(key_positions)

    def scaled_queries(self, query, query_positions):
        if not self.config.log_scaling:
            return query
        scale = ((query_positions + 1).float().log() / math.log(self.original_window)).clamp_min(1.0)
        return query * scale[:, None, :, None].to(query.dtype)
