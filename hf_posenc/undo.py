"""A record of every change a patch makes to a model, undone in reverse order: by unpatch_model, or when
a patch fails half way (so the model is left exactly as it was)."""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.hooks import RemovableHandle

_MISSING = object()


class UndoLog:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """setattr that remembers the old value (or its absence). Works for submodules and plain attributes."""
        old = obj.__dict__.get(name, _MISSING)
        if old is _MISSING:
            old = getattr(obj, "_modules", {}).get(name, _MISSING)
        setattr(obj, name, value)

        def restore() -> None:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        self._undo.append(restore)

    def add_hook(self, handle: RemovableHandle) -> None:
        self._undo.append(handle.remove)

    def on_undo(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
