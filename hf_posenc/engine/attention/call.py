"""One attention call as the paths see it (`AttentionCall`): the module, the model's position state, the layer's
queries, keys and values, the mask, and the slots and positions of its queries and keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ...methods.base import PositionalMethod
from ..state import PositionState


@dataclass(frozen=True)
class AttentionCall:
    """query [B, H, q, D], key/value [B, H_kv, kv, D] (the whole cache); `attention_mask` the one transformers
    built (bool or additive float, [B or 1, 1, q, kv]) or None; `dropout` already 0 outside training; `eager`:
    the attention weights are returned (the model's config asks for eager attention, or BLOOM's caller for
    its weights). `query_slots` [q] and `key_slots` [kv] are
    cache slots, `query_positions` [B or 1, q] and `key_positions` [B or 1, kv] each token's own position
    (PositionState.relative_positions). A path that cuts a call (rows of queries, a probe) makes a copy with
    `replace`."""

    module: nn.Module
    state: PositionState
    layer_idx: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    dropout: float
    eager: bool
    query_slots: torch.Tensor
    key_slots: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    options: dict = dataclasses.field(default_factory=dict)  # transformers' other keywords (sliding_window, ...)

    @classmethod
    def build(cls, module: nn.Module, state: PositionState, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
              dropout: float = 0.0, eager: bool | None = None, **options) -> AttentionCall:
        """The call as transformers' AttentionInterface hands it over (scaling None: 1 / sqrt(D); eager None: as
        the model's config says)."""
        q, kv = query.shape[2], key.shape[2]
        query_slots, key_slots, query_positions, key_positions = state.relative_positions(q, kv, query.device)
        return cls(module, state, getattr(module, "layer_idx", 0) or 0, query, key, value, attention_mask,
                   query.shape[-1]**-0.5 if scaling is None else scaling, dropout if module.training else 0.0,
                   state.eager if eager is None else eager, query_slots, key_slots, query_positions, key_positions,
                   options)

    @property
    def method(self) -> PositionalMethod:
        return self.state.method

    def replace(self, **changes) -> AttentionCall:
        return dataclasses.replace(self, **changes)

    def causal_allowed(self, rows: slice, columns: slice) -> torch.Tensor:
        """bool [r, k]: the keys `columns` at or before each query slot of `rows`."""
        return self.key_slots[None, columns] <= self.query_slots[rows, None]

    def given_mask(self, rows: slice, columns: slice) -> torch.Tensor | None:
        """The given mask's rows and columns of a block, or None."""
        return self.attention_mask[..., rows, columns] if self.attention_mask is not None else None
