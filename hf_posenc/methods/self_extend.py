"""Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning"): keys within
`window` of a query keep their ordinary positions; beyond it, queries and keys take grouped positions floor(p / group),
the queries shifted by window - window // group so that the grouped distances continue where the window ends. With a
model trained on L tokens, distances stay within it up to about (L - window) * group + window tokens.

The shift is W - W // G, as LongLM's decoding paths and its fix of 2024-05-23 ("We accidentally use '/'") have it;
its prefill paths in self_extend_patch/Llama.py still compute W - W / G (datamllab/LongLM). The two agree exactly when
G divides W, so a window that is not a multiple of the group is refused, and the default window (a quarter of the
trained window) is rounded down to a multiple of the group."""

from __future__ import annotations

from dataclasses import dataclass

from ..model_info import ModelInfo
from ..registry import register_method
from .neighbour_window import NeighbourWindowConfig, NeighbourWindowRope


@dataclass
class SelfExtendConfig(NeighbourWindowConfig):
    group: int = 8  # beyond the window, positions are divided (floor) by this

    def validate(self) -> None:
        super().validate()
        self.require_size("group", 1, "positions", why="positions beyond the window are floor(position / group)")
        if self.window is not None and self.window % self.group:
            self.refuse("window", f"is not a multiple of group={self.group}",
                        f"a multiple of it, e.g. {max(self.group, self.window // self.group * self.group)}",
                        why="LongLM's code shifts grouped queries by window - window // group in some paths and "
                            "window - window / group in others, which agree only then")


@register_method("self-extend", SelfExtendConfig)
class SelfExtend(NeighbourWindowRope):
    def __init__(self, config: SelfExtendConfig, info: ModelInfo):
        super().__init__(config, info)
        if config.window is None:  # a quarter of the trained window, down to a multiple of the group
            self.window = max(config.group, self.window // config.group * config.group)

    def far_query_positions(self, query_positions):
        group = self.config.group
        return query_positions // group + self.window - self.window // group

    def far_key_positions(self, key_positions):
        return key_positions // self.config.group
