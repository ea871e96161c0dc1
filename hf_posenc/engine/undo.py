"""A record of every change a patch makes to a model, undone in reverse order: by unpatch_model, or when
a patch fails half way (so the model is left exactly as it was).

Entries are plain data (objects, names, old values, hook ids), not closures, so `copy.deepcopy(model)`
gives a copy whose patch undoes itself on the copy.

A module the patch takes out of the model (GPT-2's `wpe`, LLaMA's `rotary_emb`) still follows what is done to the
model's tensors while it is out (`model.to(torch.bfloat16)`, `.cuda()`): its parent passes the conversion on to it
(FollowConversions), so unpatching puts back what a never-patched model converted the same way holds (issue 51).
"""

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
        if isinstance(old, nn.Module) and isinstance(obj, nn.Module) and old is not value:
            self._keep_converting(obj, old)

    def _keep_converting(self, parent: nn.Module, module: nn.Module) -> None:
        follow = parent.__dict__.get("_apply")
        if not isinstance(follow, FollowConversions):
            follow = FollowConversions(parent)
            self.set_attr(parent, "_apply", follow)  # undone first: the module is back in the tree by then
        follow.modules.append(module)

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


class FollowConversions:
    """Stands in a module's `_apply` (what `Module.to`, `.half()`, `.cuda()` ... call on every module of the tree):
    converts the module itself, then the modules a patch took out of it, with the same function."""

    def __init__(self, parent: nn.Module):
        self.parent = parent
        self.modules: list[nn.Module] = []

    def __call__(self, fn, recurse: bool = True):
        result = type(self.parent)._apply(self.parent, fn, recurse)
        for module in self.modules:
            module._apply(fn, recurse)
        return result
