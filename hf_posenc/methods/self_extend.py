"""Self-Extend (Jin et al. 2024, "LLM Maybe LongLM: Self-Extend LLM Context Window Without Tuning"): keys within
`window` of a query keep their ordinary positions; beyond it, queries and keys take grouped positions floor(p / group),
the queries shifted by window - window // group so that the grouped distances continue where the window ends. With a
model trained on L tokens, distances stay within it up to about (L - window) * group + window tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import register_method
from .neighbour_window import NeighbourWindowConfig, NeighbourWindowRope


@dataclass
class SelfExtendConfig(NeighbourWindowConfig):
    group: int = 8  # beyond the window, positions are divided (floor) by this

    def validate(self) -> None:
        super().validate()
        self.require_int("group", 1, why="positions beyond the window are floor(position / group)")


@register_method("self-extend", SelfExtendConfig)
class SelfExtend(NeighbourWindowRope):
    def far_query_positions(self, query_positions):
        group = self.config.group
        return query_positions // group + self.window - self.window // group

    def far_key_positions(self, key_positions):
        return key_positions // self.config.group
