"""Exact KV caching for length-dependent RoPE scalings (dynamic NTK, dynamic YaRN, LongRoPE).

Their frequencies depend on the current length, so when the length changes the scale, every cached key and
value is stale: not only the rotation of layer-1 keys (which rotating the un-rotated key cache inside
attention fixes) but the hidden states of the earlier tokens in every deeper layer, which were computed at
the older scale. The only exact answer is to run the text again. `PrefixReplay` keeps the input embeddings
and positions seen since the cache was empty; when a forward arrives whose scale differs from the one the
cache was built at, it empties the cache, feeds the whole text, and returns the outputs of the new
positions only. Cost: one full forward of the text so far at each step that changes the scale (every step
past the window for `dynamic` and `dynamic-yarn`; once, on crossing it, for `longrope`). With
`exact_cache=False` the method keeps only the in-attention rotation (cheap, approximate in deeper layers).

Each row's scale follows its own length (engine/state.py `row_lengths`), so a left-padded batch replays when any
row's scale changes, and every row then equals that row decoded alone.

What was seen since the cache was empty is kept on the cache object itself (`REPLAY_ATTR`), so any number of
caches (and threads) can use one model; what one forward must remember until its outputs are cut is per thread.
The record has one row per batch row and follows the cache's batch edits (beam search's `reorder_cache`, ...:
engine/cache_rows.py), so beam search decodes exactly too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import PosEncError
from .cache_names import cache_output
from .cache_rows import BatchEdit, carries_rows
from .state import attended_tokens, row_lengths

REPLAY_ATTR = "hf_posenc_replay"  # on a KV cache: the ReplayRecord of the text it holds


@dataclass
class ReplayRecord:
    embeds: torch.Tensor  # [B, n, hidden]: the input embeddings seen since the cache was empty
    positions: torch.Tensor  # [B, n]
    lengths: torch.Tensor  # [B]: each row's length (`row_lengths`) when its cached state was computed: its scale
    replays: int = 0  # how often the text was run again since the cache was empty

    def edited(self, edit: BatchEdit) -> "ReplayRecord":
        return ReplayRecord(edit.rows(self.embeds), edit.rows(self.positions), edit.rows(self.lengths), self.replays)


carries_rows(REPLAY_ATTR, ReplayRecord.edited)


def replay_count(cache) -> int:
    """How often exact mode emptied ``cache`` and ran the text again (0 for a cache it never replayed)."""
    record: ReplayRecord | None = getattr(cache, REPLAY_ATTR, None)
    return 0 if record is None else record.replays


class PrefixReplay:
    def __init__(self, method, accepts_position_ids: bool, model_config):
        self.method = method
        self.accepts_position_ids = accepts_position_ids
        self.model_config = model_config  # its use_cache is the default when a forward does not say
        self._calls = threading.local()  # per forward: the record to keep, and how many outputs are new

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_calls"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._calls = threading.local()

    def prepare(self, arguments: dict, positions: torch.Tensor, offset: int, cache, embed_tokens):
        """Called by the base model's pre-hook. Returns (arguments, positions, offset) to run with."""
        self._calls.record, self._calls.replayed_length = None, None
        use_cache = arguments.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model_config, "use_cache", False)
        if cache is None and not use_cache:
            return arguments, positions, offset  # nothing is cached, nothing to keep
        embeds = arguments.get("inputs_embeds")
        if embeds is None:
            embeds = embed_tokens(arguments["input_ids"])
        arguments.update(input_ids=None, inputs_embeds=embeds)
        positions = positions.expand(embeds.shape[0], -1)
        attended = attended_tokens(arguments.get("attention_mask"), offset + embeds.shape[1])
        if offset == 0:
            self._calls.record = ReplayRecord(embeds.detach(), positions, row_lengths(positions, attended))
            return arguments, positions, offset
        seen: ReplayRecord | None = getattr(cache, REPLAY_ATTR, None)
        if seen is None or seen.embeds.shape[1] < offset or seen.embeds.shape[0] != embeds.shape[0]:
            raise PosEncError(
                f"{self.method.config.method!r} with exact_cache=True replays the text when its scale changes, but "
                "this KV cache was filled outside the patched model's view (or its rows were changed other than by "
                "its reorder_cache, batch_select_indices or batch_repeat_interleave). Start from an empty cache, or "
                "patch with exact_cache=False."
            )
        all_embeds = torch.cat((seen.embeds[:, :offset], embeds.detach()), dim=1)
        all_positions = torch.cat((seen.positions[:, :offset], positions), dim=1)
        lengths = row_lengths(all_positions, attended)
        scale_key = self.method.scale_key
        replaying = any(scale_key(now) != scale_key(built)
                        for now, built in zip(lengths.tolist(), seen.lengths.tolist()))
        self._calls.record = ReplayRecord(all_embeds, all_positions, lengths, seen.replays + replaying)
        if not replaying:
            return arguments, positions, offset
        cache.reset()
        self._calls.replayed_length = embeds.shape[1]
        arguments["inputs_embeds"] = all_embeds
        if self.accepts_position_ids:
            arguments["position_ids"] = all_positions
        return arguments, all_positions, 0

    def cut_outputs(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """Forward hook on the base model: keeps the record on the returned cache and, after a replay, keeps the
        outputs of the new positions only."""
        record = getattr(self._calls, "record", None)
        cache = cache_output(output)
        if record is not None and cache is not None:
            setattr(cache, REPLAY_ATTR, record)
        new = getattr(self._calls, "replayed_length", None)
        self._calls.record, self._calls.replayed_length = None, None
        if new is None:
            return output
        output.last_hidden_state = output.last_hidden_state[:, -new:]
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(h[:, -new:] for h in output.hidden_states)
        return output
