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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import PosEncError


class PrefixReplay:
    def __init__(self, method, accepts_position_ids: bool, model_config):
        self.method = method
        self.accepts_position_ids = accepts_position_ids
        self.model_config = model_config  # its use_cache is the default when a forward does not say
        self.embeds: torch.Tensor | None = None  # [B, n, hidden] seen since the cache was empty
        self.positions: torch.Tensor | None = None  # [B, n]
        self.scale_key: Any = None  # the scale the cache was built at
        self.replayed_length: int | None = None  # set while a replay's outputs must be cut to the new tokens

    def prepare(self, arguments: dict, positions: torch.Tensor, offset: int, cache, embed_tokens):
        """Called by the base model's pre-hook. Returns (arguments, positions, offset) to run with."""
        self.replayed_length = None
        use_cache = arguments.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model_config, "use_cache", False)
        if cache is None and not use_cache:
            self.embeds = self.positions = None  # nothing is cached, nothing to keep
            return arguments, positions, offset
        embeds = arguments.get("inputs_embeds")
        if embeds is None:
            embeds = embed_tokens(arguments["input_ids"])
        arguments.update(input_ids=None, inputs_embeds=embeds)
        positions = positions.expand(embeds.shape[0], -1)
        if offset == 0:
            self.embeds, self.positions = embeds.detach(), positions
            self.scale_key = self.method.scale_key(int(positions.max()) + 1)
            return arguments, positions, offset
        if self.embeds is None or self.embeds.shape[1] < offset or self.embeds.shape[0] != embeds.shape[0]:
            raise PosEncError(
                f"{self.method.config.method!r} with exact_cache=True replays the text when its scale changes, but "
                "this KV cache was filled outside the patched model's view (or its batch was reordered, as beam "
                "search does). Start from an empty cache, or patch with exact_cache=False."
            )
        self.embeds = torch.cat((self.embeds[:, :offset], embeds.detach()), dim=1)
        self.positions = torch.cat((self.positions[:, :offset], positions), dim=1)
        scale_key = self.method.scale_key(int(self.positions.max()) + 1)
        if scale_key == self.scale_key:
            return arguments, positions, offset
        self.scale_key = scale_key
        cache.reset()
        self.replayed_length = embeds.shape[1]
        arguments["inputs_embeds"] = self.embeds
        if self.accepts_position_ids:
            arguments["position_ids"] = self.positions
        return arguments, self.positions, 0

    def cut_outputs(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """Forward hook on the base model: after a replay, keep the outputs of the new positions only."""
        if self.replayed_length is None:
            return output
        new = self.replayed_length
        self.replayed_length = None
        output.last_hidden_state = output.last_hidden_state[:, -new:]
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(h[:, -new:] for h in output.hidden_states)
        return output
