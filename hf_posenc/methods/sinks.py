"""Attention sinks (StreamingLLM: Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"): each
query attends to the first `num_sinks` tokens of the text (the sinks, where pretrained models park attention) and to
the `window` most recent tokens (itself included), and RoPE positions are assigned within the cache, not in the text.

With S = num_sinks and W = window, query t sees key j <= t when j < S or t - j < W. In the paper's cache, which holds
the S sinks and the W - 1 keys before the query, every token takes its cache slot as its position: the query sits at
slot min(t, S + W - 1) and a window key j at the same distance t - j as in the text, while a sink j, at slot j, is
seen at distance min(t, S + W - 1) - j. So distances never exceed S + W - 1, and a text of any length is read at
positions the model was trained on (the default W is the trained window minus S). That is the definition this
module computes for every forward, with or without a cache: a full forward of a text longer than S + W equals
token-by-token decoding with the bounded cache (a float64 materialised reference checks it in
tests/test_context_extension.py), and a text of at most S + W tokens is the unpatched model's.

Keys are cached un-rotated and rotated inside the shared attention path per query block (`scores_per_query_block`):
the window keys at their ordinary positions, the sinks with the query moved to min(t, S + W - 1). The method declares
the keys it keeps (`kept_keys`); the engine's bounded cache of them (engine/sink_cache.py: SinkCache) is created by
`model.generate(...)` or `hf_posenc.sink_cache(model)`; with a DynamicCache or StaticCache the results are the same
and memory grows with the text. On a model without RoPE of its
own (GPT-2, BLOOM) this builds on a `rope` patch, as the RoPE scalings do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import KeptKeys
from .neighbour_window import NeighbourWindowRope


@dataclass
class SinksConfig(PosEncConfig):
    num_sinks: int = 4  # the paper's default: the first 4 tokens
    window: int | None = None  # recent tokens each query sees (itself included); None: trained window - num_sinks
    rope_theta: float | None = None  # None: the model's own (or that of the `rope` patch it builds on)
    original_max_position_embeddings: int | None = None  # the trained window; None: read from the model's config

    def validate(self) -> None:
        self.require_size("num_sinks", 1, "positions", why="the first tokens every query attends to (without them window attention "
                                             "breaks down, the paper's point)")
        self.require_size("window", 1, "positions", none_means="the model's trained window minus num_sinks",
                         why="each query attends to this many recent tokens, itself included")
        self.require_number("rope_theta", MIN_BASE, none_means="the model's own", why=BASE_WHY)
        self.require_size("original_max_position_embeddings", 1, "positions", none_means="read from the model's config")


@register_method("sinks", SinksConfig)
class AttentionSinks(NeighbourWindowRope):
    def __init__(self, config: SinksConfig, info: ModelInfo):
        trained = config.original_max_position_embeddings or info.original_window
        if config.window is None and not trained:
            raise PosEncError("SinksConfig.window is required: this model's config states no trained window to fill. "
                              "Pass window=..., e.g. 1020 with num_sinks=4.")
        if config.window is None and trained <= config.num_sinks:
            raise PosEncError(f"SinksConfig.num_sinks={config.num_sinks} leaves no room for a window in this model's "
                              f"trained window of {trained}; pass fewer sinks or window=...")
        super().__init__(config, info)
        self.num_sinks = config.num_sinks
        self.window = config.window or trained - config.num_sinks
        self.last_slot = self.num_sinks + self.window - 1  # the query's slot in a full cache

    @property
    def masks_keys(self) -> bool:
        return True

    def allowed_keys(self, query_positions, key_positions):
        sink = key_positions[:, None, None, :] < self.num_sinks
        near = (query_positions[:, None, :, None] - key_positions[:, None, None, :]) < self.window
        return sink | near

    def far_query_positions(self, query_positions):
        return query_positions.clamp_max(self.last_slot)

    def block_keys(self, key, key_positions):
        return (self.rotated(key, key_positions),)  # the sinks keep their positions: only the query moves

    def block_scores(self, query, keys, query_positions, key_positions):
        (key,) = keys
        scores = self.scores(query, query_positions, key)
        far = (query_positions[:, None, :, None] - key_positions[:, None, None, :]) >= self.window
        sinks = key_positions < self.num_sinks
        if not bool((far & sinks[:, None, None, :]).any()):
            return scores  # every visible key at its ordinary distance (texts within S + W, most decoding blocks)
        # Only the sink columns take the moved query (the others beyond the window are masked).
        columns = sinks.any(0).nonzero().squeeze(-1)
        moved = self.scores(query, self.far_query_positions(query_positions), key[:, :, columns])
        use = far[..., columns] & sinks[:, None, None, columns]
        return scores.index_copy(-1, columns, torch.where(use, moved, scores[..., columns]))

    def block_near(self, query_positions, key_positions):
        """The window keys and the sinks near the query at their ordinary distance; the sinks beyond the window with the
        query moved (the other keys beyond the window are masked by allowed_keys, so they count as near here)."""
        return self.near_keys(query_positions, key_positions) | (key_positions >= self.num_sinks)[:, None, None, :]

    def block_parts(self, query, keys, query_positions, key_positions, far):
        (key,) = keys
        far_pair = (self.rotated(query, self.far_query_positions(query_positions)), key) if far else None
        return (self.rotated(query, query_positions), key), far_pair

    def kept_keys(self) -> KeptKeys:
        return KeptKeys(self.num_sinks, self.window)
