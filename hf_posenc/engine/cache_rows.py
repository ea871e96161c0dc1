"""Per-row state that hf_posenc keeps on a KV cache beside the keys follows the cache's own batch edits.

The engine keeps, on the cache object, state with one row per batch row: the tokens' positions (state.py), the
replay record of the length-dependent RoPE scalings (replay.py), content methods' per-token state (content.py).
`generate` edits a cache's rows behind the model's back: beam search calls `reorder_cache(beam_idx)` at every step,
and `batch_select_indices` / `batch_repeat_interleave` select or expand rows. On a cache that carries such state
those three are wrapped on that cache instance (bound methods, so a deep copy of the cache rebinds them to the copy;
transformers' classes are left alone), and the same edit is applied to every attribute registered here.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class BatchEdit:
    """One of the cache's batch edits: `name` (the Cache method) and its argument."""

    name: str
    argument: Any

    def rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor [B, ...] with the edit applied to its rows."""
        if self.name == "batch_repeat_interleave":
            return tensor.repeat_interleave(self.argument, dim=0)
        index = torch.as_tensor(self.argument, device=tensor.device)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        return tensor.index_select(0, index.long())

    def rows_or_shared(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """For a tensor of shape [B or 1, ...], where one row stands for every row: that stays as it is."""
        return tensor if tensor is None or tensor.shape[0] == 1 else self.rows(tensor)


# attribute on a cache -> how a batch edit applies to its value (registered by the modules that keep it)
ROW_STATE: dict[str, Callable[[Any, BatchEdit], Any]] = {}
BATCH_EDITS = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave")


def carries_rows(attribute: str, edit: Callable[[Any, BatchEdit], Any]) -> None:
    """Register `attribute` as per-row state: `edit(value, batch_edit)` gives its value after the cache's edit."""
    ROW_STATE[attribute] = edit


def _edited(name: str):
    def method(cache, argument):
        result = getattr(type(cache), name)(cache, argument)
        edit = BatchEdit(name, argument)
        for attribute, apply in ROW_STATE.items():
            value = cache.__dict__.get(attribute)  # a property of the cache's class (SinkCache) keeps its own
            if value is not None:
                setattr(cache, attribute, apply(value, edit))
        return result
    method.__name__ = name
    return method


_EDITED = {name: _edited(name) for name in BATCH_EDITS}


def follow_batch_edits(cache) -> None:
    """Make the cache's batch edits apply to the per-row state hf_posenc keeps on it (idempotent)."""
    for name, method in _EDITED.items():
        current = cache.__dict__.get(name)
        if hasattr(type(cache), name) and not (isinstance(current, types.MethodType) and current.__func__ is method):
            setattr(cache, name, types.MethodType(method, cache))
