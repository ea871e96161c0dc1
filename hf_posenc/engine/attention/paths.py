"""Which path computes a call ("auto", "blocked", "flex", "flash", "compiled", "triton"), and the counts of which path
served.

The choice is per model or per thread: `set_attention_path(path, model)` keeps a model's own (on its PositionState);
`attention_path(path)` (a context manager) and `set_attention_path(path)` set the current thread's or asyncio task's
(a ContextVar), over every model it runs; with neither, "auto". Counts: each model's own (`path_counts(model)`), and
`last_paths`, the current thread's or task's over every model (clear() it, read last_paths["flex"])."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import MutableMapping
from contextvars import ContextVar
from typing import Iterator

from torch import nn

from ...errors import PosEncError
from ..state import STATE_ATTR, PositionState

ATTENTION_PATHS = ("auto", "blocked", "flex", "flash", "compiled", "triton")

_context_path: ContextVar[str | None] = ContextVar("hf_posenc_attention_path", default=None)
_context_counts: ContextVar[Counter] = ContextVar("hf_posenc_path_counts")


def _checked(path: str) -> str:
    if path not in ATTENTION_PATHS:
        raise PosEncError(f"Attention path {path!r} is unknown; use one of {', '.join(ATTENTION_PATHS)}.")
    return path


def _states_of(model: nn.Module) -> list[PositionState]:
    """The position states of a patched model (one, or one per method of a hybrid patch)."""
    states = {id(state): state for module in model.modules()
              if isinstance(state := getattr(module, STATE_ATTR, None), PositionState)}
    if not states:
        raise PosEncError(f"{type(model).__name__} is not patched by hf_posenc, so it has no attention path to set; "
                          "call hf_posenc.patch_model(model, ...) first, or leave out `model` to set the path of "
                          "every model this thread runs.")
    return list(states.values())


def set_attention_path(path: str, model: nn.Module | None = None) -> None:
    """Choose how attention is computed: "auto" (default), "blocked", "flex", "flash", "compiled" (content methods'
    blocks under torch.compile; docs/attention-paths.md) or "triton" (Triton kernels, hf_posenc[gpu]: the distance
    table kernel and fla-core's FoX and stick-breaking, on a GPU or under TRITON_INTERPRET=1). With `model`, for that
    patched model's calls; without, for every model's calls in the current thread or asyncio task, over any model's
    own choice."""
    _checked(path)
    if model is None:
        _context_path.set(path)
        return
    for state in _states_of(model):
        state.attention_path = path


def get_attention_path(model: nn.Module | None = None) -> str:
    """The path the calls of `model` (or of a model with no choice of its own) take in the current thread or task."""
    if model is None:
        return _context_path.get() or "auto"
    return chosen_path(_states_of(model)[0])


@contextlib.contextmanager
def attention_path(path: str):
    """`set_attention_path(path)` for the calls inside the block (this thread's or task's), then as before."""
    token = _context_path.set(_checked(path))
    try:
        yield
    finally:
        _context_path.reset(token)


def chosen_path(state: PositionState) -> str:
    """The path for a call of the model whose position state is `state`: the thread's or task's choice, else the
    model's own, else "auto"."""
    return _context_path.get() or state.attention_path or "auto"


def _current_counts() -> Counter:
    try:
        return _context_counts.get()
    except LookupError:
        counts = Counter()
        _context_counts.set(counts)
        return counts


def count_path(state: PositionState, name: str, count: int = 1) -> None:
    """Count a call of the model whose position state is `state` served by path `name`."""
    state.path_counts[name] += count
    _current_counts()[name] += count


def path_counts(model: nn.Module) -> Counter:
    """How many attention calls of `model` each path served since it was patched (a copy)."""
    total = Counter()
    for state in _states_of(model):
        total.update(state.path_counts)
    return total


def tuned_choices(model: nn.Module) -> dict[str, str]:
    """The choices measured on this machine for `model` at their first call (the table backward's plan per kind of
    call: table_attention.backward_plan), kind -> what was picked, for a benchmark's record; {} for a model not
    patched (native)."""
    states = {id(state): state for module in model.modules()
              if isinstance(state := getattr(module, STATE_ATTR, None), PositionState)}
    return {", ".join(map(str, kind)): plan.describe() for state in states.values()
            for kind, plan in state.tuned.items()}


class PathCounts(MutableMapping):
    """`last_paths`: the counts of the current thread or asyncio task over every model, as a Counter (0 for a path
    that served nothing); clear() starts them again, copy() gives a Counter."""

    def __getitem__(self, name: str) -> int:
        return _current_counts()[name]

    def __setitem__(self, name: str, count: int) -> None:
        _current_counts()[name] = count

    def __delitem__(self, name: str) -> None:
        del _current_counts()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_current_counts())

    def __len__(self) -> int:
        return len(_current_counts())

    def __eq__(self, other) -> bool:
        return _current_counts() == (dict(other) if isinstance(other, PathCounts) else other)

    def clear(self) -> None:
        _current_counts().clear()

    def copy(self) -> Counter:
        return Counter(_current_counts())

    def update(self, other=(), /, **counts) -> None:
        """Add the counts, as Counter.update does."""
        _current_counts().update(other, **counts)

    def __repr__(self) -> str:
        return f"last_paths({dict(_current_counts())})"


last_paths = PathCounts()
