"""Which path computes a call ("auto", "blocked", "flex", "flash", "compiled"), and the count of which path served
each call (`last_paths`)."""

from __future__ import annotations

import contextlib
from collections import Counter

from ...errors import PosEncError

ATTENTION_PATHS = ("auto", "blocked", "flex", "flash", "compiled")

_path = "auto"
last_paths: Counter = Counter()


def set_attention_path(path: str) -> None:
    """Choose how biased attention is computed, process-wide: "auto" (default), "blocked", "flex", "flash" or
    "compiled" (content methods' blocks under torch.compile; see docs/attention-paths.md)."""
    if path not in ATTENTION_PATHS:
        raise PosEncError(f"Attention path {path!r} is unknown; use one of {', '.join(ATTENTION_PATHS)}.")
    global _path
    _path = path


def get_attention_path() -> str:
    return _path


@contextlib.contextmanager
def attention_path(path: str):
    previous = _path
    set_attention_path(path)
    try:
        yield
    finally:
        set_attention_path(previous)


def chosen_path(state) -> str:
    """The path chosen for a call of the model whose position state is `state`."""
    return _path


def count_path(state, name: str, count: int = 1) -> None:
    """Count a call served by path `name`."""
    last_paths[name] += count
