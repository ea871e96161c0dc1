"""Shared machinery of biases that depend on the distance i - j only (T5 buckets, KERPLE, Sandwich, and FIRE
while its normaliser is constant): the method computes a table of the bias at distances 0..n-1, and both the
materialised `bias()` and the attention path's fast paths (a Toeplitz view per query block, a flex_attention
score_mod) index it, so every path gives the same numbers."""

from __future__ import annotations

import torch

from .base import AttentionBiasMethod, PositionSpan


def table_lookup(table: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """table [H, n] (bias at distance 0..n-1) -> [B or 1, H, q, kv] at distance i - j. Entries with j > i (masked
    by the caller) read distance 0."""
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).clamp(0, table.shape[-1] - 1)
    return table[:, distance].transpose(0, 1)


class DistanceBiasMethod(AttentionBiasMethod):
    """A bias that is a function of the distance i - j >= 0 alone. Subclasses implement `distance_bias`."""

    def distance_bias(self, layer_idx: int, distance: torch.Tensor) -> torch.Tensor:
        """distance float32 [n] (0, 1, 2, ...) -> float32 [H, n]."""
        raise NotImplementedError

    def bias_table(self, layer_idx: int, num_distances: int, max_position: int | None = None,
                   device: torch.device | None = None) -> torch.Tensor | None:
        """float32 [H, num_distances]: the bias at distances 0..num_distances-1, for queries at positions up to
        `max_position`; None where the bias is not a function of distance alone for such queries."""
        distance = torch.arange(num_distances, device=device or self._device(), dtype=torch.float32)
        return self.distance_bias(layer_idx, distance)

    def bias(self, layer_idx, query_positions, key_positions):
        return self.block_bias(layer_idx, query_positions, key_positions, None)

    def block_bias(self, layer_idx, query_positions, key_positions, span):
        span = span or PositionSpan.of(query_positions, key_positions)
        table = self.bias_table(layer_idx, span.distances, span.max_query_position, query_positions.device)
        return table_lookup(table, query_positions, key_positions)

    def _device(self) -> torch.device:
        reference = next(iter(self.parameters()), None)
        return reference.device if reference is not None else torch.device("cpu")
