"""Per-model run-time state: the positions of the current forward, read once by a pre-hook on the base
model and used by every layer. It lives on the model's modules (never in transformers' globals), so two
models patched differently in one process do not interfere."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from .methods.base import PositionalMethod

STATE_ATTR = "hf_posenc_state"


class PositionState:
    """Positions of the tokens in the current forward.

    `slot_offset` is the number of tokens already in the KV cache (so a StaticCache, whose key length is
    its capacity, still gives the right query offset). `shift` [B or 1, 1] is each row's true position
    minus its cache slot; it is non-zero for left-padded rows, whose first real token sits in a later slot.
    """

    def __init__(self, method: PositionalMethod, backend: str):
        self.method = method
        self.backend = backend  # the attention implementation the model had before patching
        self.query_positions: torch.Tensor | None = None  # [B or 1, q], as the model uses them
        self.slot_offset = 0
        self.shift: torch.Tensor | None = None
        self.seq_len = 0  # highest position + 1: what length-dependent rotary scalings depend on
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # rotary cos/sin of the queries

    def update(self, query_positions: torch.Tensor, slot_offset: int) -> None:
        self.query_positions = query_positions
        self.slot_offset = slot_offset
        q = query_positions.shape[-1]
        # The last query is a real token in every row (padding is on the left), so its position is reliable.
        self.shift = query_positions[:, -1:] - (slot_offset + q - 1)
        self.cos_sin = None
        if self.method.kind == "rotary":
            self.seq_len = int(query_positions.max()) + 1 if self.method.length_dependent else 0
            self.cos_sin = self.method.cos_sin(query_positions, self.seq_len)

    def slots(self, q: int, kv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots of the q queries and the kv keys seen by attention."""
        query_slots = torch.arange(self.slot_offset, self.slot_offset + q, device=device)
        # A dynamic cache holds exactly offset + q keys, a static one more (the extra slots are masked), a
        # sliding-window cache fewer (only the last kv).
        first_key = max(0, self.slot_offset + q - kv)
        key_slots = torch.arange(first_key, first_key + kv, device=device)
        return query_slots, key_slots

    def relative_positions(self, q: int, kv: int, device: torch.device):
        """(query_slots [q], key_slots [kv], query_positions [B or 1, q], key_positions [B or 1, kv])."""
        query_slots, key_slots = self.slots(q, kv, device)
        if self.shift is None:
            raise RuntimeError("hf_posenc: attention ran before the base model's pre-hook set the positions.")
        shift = self.shift.to(device)
        return query_slots, key_slots, query_slots[None] + shift, key_slots[None] + shift


class PositionCapture:
    """Forward pre-hook (with kwargs) on the base model: records the positions of this forward and, for
    absolute methods, adds the position embedding to the input embeddings (covering both `input_ids` and
    `inputs_embeds` callers)."""

    def __init__(self, state: PositionState, signature: inspect.Signature,
                 default_positions: Callable[[dict[str, Any], int, int, torch.device], torch.Tensor],
                 embed_tokens: Callable[[torch.Tensor], torch.Tensor], replay=None):
        self.state = state
        self.signature = signature
        self.default_positions = default_positions
        self.embed_tokens = embed_tokens
        self.replay = replay  # a PrefixReplay for length-dependent RoPE scalings with exact caching

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        arguments = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        arguments.update(arguments.pop("kwargs", {}) or {})
        input_ids, inputs_embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
        source = inputs_embeds if inputs_embeds is not None else input_ids
        if source is None:
            return None
        q = source.shape[1]
        cache = arguments.get("past_key_values")
        offset = int(cache.get_seq_length()) if cache is not None else 0
        positions = arguments.get("position_ids")
        if positions is None:
            positions = self.default_positions(arguments, q, offset, source.device)
        positions = positions.reshape(-1, q).long()
        if self.replay is not None:
            arguments, positions, offset = self.replay.prepare(arguments, positions, offset, cache, self.embed_tokens)
        self.state.update(positions, offset)

        if self.state.method.kind != "absolute":
            return ((), arguments) if self.replay is not None else None
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds = inputs_embeds + self.state.method.embed(positions).to(inputs_embeds.dtype)
        # Everything as keywords: transformers' forward decorators look arguments up by name.
        arguments.update(input_ids=None, inputs_embeds=inputs_embeds)
        return (), arguments


def forward_signature(module: nn.Module) -> inspect.Signature:
    return inspect.signature(module.forward)


def positions_after_offset(arguments: dict[str, Any], q: int, offset: int, device: torch.device) -> torch.Tensor:
    """What LLaMA and GPT-2 use when no position_ids are given: consecutive positions after the cache."""
    return torch.arange(offset, offset + q, device=device)[None]
