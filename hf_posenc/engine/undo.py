"""A record of every change a patch makes to a model, undone in reverse order: by unpatch_model, or when
a patch fails half way (so the model is left exactly as it was).

Entries are plain data (objects, names, old values, hook ids), not closures, so `copy.deepcopy(model)`
gives a copy whose patch undoes itself on the copy."""

from __future__ import annotations

from typing import Any

from torch import nn

class _Missing:
    """Marks an attribute that did not exist; stays the one object through deepcopy and pickling."""

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        return "_MISSING"  # pickle stores a reference to this module's singleton


_MISSING = _Missing()
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class UndoLog:
    def __init__(self) -> None:
        self._entries: list[tuple] = []

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """setattr that remembers the old value (or its absence). Works for submodules and plain attributes."""
        old = obj.__dict__.get(name, _MISSING)
        if old is _MISSING:
            old = getattr(obj, "_modules", {}).get(name, _MISSING)
        setattr(obj, name, value)
        self._entries.append(("attr", obj, name, old))

    def add_forward_pre_hook(self, module: nn.Module, hook, with_kwargs: bool = False) -> None:
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        self._entries.append(("hook", module, handle.id))

    def add_forward_hook(self, module: nn.Module, hook, with_kwargs: bool = False) -> None:
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs)
        self._entries.append(("hook", module, handle.id))

    def undo(self) -> None:
        while self._entries:
            entry = self._entries.pop()
            if entry[0] == "attr":
                _, obj, name, old = entry
                if old is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)
            else:
                _, module, hook_id = entry
                for dict_name in _HOOK_DICTS:
                    getattr(module, dict_name).pop(hook_id, None)
