"""Training-free context extension by remapping positions beyond a neighbour window (the shared part of Self-Extend
and ReRoPE).

A query sees the keys within `window` of it at their ordinary RoPE positions, so attention over nearby text is
exactly the pretrained model's; keys further away get a second position assignment (grouped for Self-Extend, clipped
for ReRoPE) that keeps every relative distance within the range the model was trained on. A query's scores are the
near scores for near keys and the far scores for the others, merged before one softmax, as both papers do. Keys are
cached un-rotated and both assignments are computed per query block inside the shared attention path
(`scores_per_query_block`), so caching is exact and no [L, L] tensor is made for the whole sequence.

On a model without RoPE of its own (GPT-2, BLOOM) these build on a `rope` patch, as the RoPE scalings do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from .base import NearFarForm
from .rope import RopeConfig, default_inv_freq, theta_to_build_on

WINDOW_NONE_MEANS = "a quarter of the model's trained window"


@dataclass
class NeighbourWindowConfig(PosEncConfig):
    window: int | None = None  # keys nearer than this keep their ordinary positions
    rope_theta: float | None = None  # None: the model's own (or that of the `rope` patch it builds on)
    original_max_position_embeddings: int | None = None  # the trained window; None: read from the model's config

    def validate(self) -> None:
        self.require_size("window", 1, "positions", none_means=WINDOW_NONE_MEANS,
                         why="keys nearer than this to a query keep their ordinary RoPE positions")
        self.require_number("rope_theta", MIN_BASE, none_means="the model's own", why=BASE_WHY)
        self.require_size("original_max_position_embeddings", 1, "positions", none_means="read from the model's config")


class NeighbourWindowRope(NearFarForm):
    """RoPE with two position assignments per query: ordinary within `window`, beyond it `far_query_positions` and
    `far_key_positions`."""

    rotates_in_attention = True
    scores_per_query_block = True
    block_cost = 5.0  # near scores, far scores, the merged scores, the mask, the probabilities

    def __init__(self, config: NeighbourWindowConfig, info: ModelInfo):
        super().__init__(config, info)
        base_theta = theta_to_build_on(info, config.method, "remaps RoPE positions")
        self.theta = float(config.rope_theta or base_theta)
        self.rotary_dim = info.rotary_dim
        self.original_window = config.original_max_position_embeddings or info.original_window
        if config.window is None and not self.original_window:
            raise PosEncError(f"{type(config).__name__}.window is required: this model's config states no trained "
                              "window to take a quarter of. Pass window=..., e.g. 512.")
        self.window = config.window or max(1, self.original_window // 4)
        self._inv_freq = default_inv_freq(self.theta, self.rotary_dim)
        # As for the RoPE scalings: on a model without RoPE, a checkpoint replays `rope` with this theta first.
        self._base_patch = RopeConfig(theta=base_theta) if info.rope_theta is None else None

    def builds_on(self):
        return [self._base_patch] if self._base_patch is not None else []

    def frequencies(self, seq_len):
        return self._inv_freq, 1.0

    def far_query_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        """The positions queries take for the keys at `window` or more from them (subclasses)."""
        raise NotImplementedError

    def far_key_positions(self, key_positions: torch.Tensor) -> torch.Tensor:
        """The positions keys take for the queries at `window` or more from them (subclasses)."""
        raise NotImplementedError

    def scaled_queries(self, query: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """The queries as both assignments see them (ReRoPE's optional log-n scaling); unchanged by default."""
        return query

    def rotated(self, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.rotate_heads(heads, self.rotation(positions, 0))

    def scores(self, query, query_positions, rotated_key) -> torch.Tensor:
        return torch.matmul(self.rotated(query, query_positions), rotated_key.transpose(-1, -2)).float()

    def block_keys(self, key, key_positions):
        # Once per layer call: rotating every key again for each query block cost far more than the scores.
        return self.rotated(key, key_positions), self.rotated(key, self.far_key_positions(key_positions))

    def near_keys(self, query_positions, key_positions) -> torch.Tensor:
        """bool [B or 1, 1, r, k]: the keys within the window of each query (their ordinary positions)."""
        return (query_positions[:, None, :, None] - key_positions[:, None, None, :]) < self.window

    def block_near(self, query_positions, key_positions):
        return self.near_keys(query_positions, key_positions)

    def window_holds(self, query_positions, key_positions) -> bool:
        """Every key j <= i within the window of query i (the near assignment alone): max_i (p_i - min_{j<=i} p_j)."""
        return bool((query_positions - key_positions.cummin(dim=-1).values).max() < self.window)

    def window_heads(self, query, key, positions):
        """The near assignment's rotations."""
        return self.rotated(self.scaled_queries(query, positions), positions), self.rotated(key, positions)

    def block_parts(self, query, keys, query_positions, key_positions, far):
        near_key, far_key = keys
        query = self.scaled_queries(query, query_positions)
        far_pair = (self.rotated(query, self.far_query_positions(query_positions)), far_key) if far else None
        return (self.rotated(query, query_positions), near_key), far_pair

    def block_scores(self, query, keys, query_positions, key_positions):
        near_key, far_key = keys
        query = self.scaled_queries(query, query_positions)
        scores = self.scores(query, query_positions, near_key)
        near = (query_positions[:, None, :, None] - key_positions[:, None, None, :]) < self.window
        if bool(near.all()):  # within the window (all prefixes shorter than it, most of decoding's blocks)
            return scores
        return torch.where(near, scores, self.scores(query, self.far_query_positions(query_positions), far_key))
