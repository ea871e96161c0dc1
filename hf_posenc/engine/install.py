"""The transactional core of a patch: build the method for the model, install it through the model's family, and
keep an undo log of every change. If anything fails half way, the log is undone and the model is left exactly as
it was (with the previous patch, if there was one, put back).

The public entry points (hf_posenc/patching.py) wrap this with what a patched model offers beyond computing:
its `save_pretrained` (checkpoints/saving.py), attached through `before_install`.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable

from torch import nn

from ..config import PosEncConfig
from ..methods.base import PositionalMethod, RotaryMethod
from ..model_info import ModelInfo
from ..registry import config_for, get_family
from .state import PositionState
from .undo import UndoLog

PATCH_ATTR = "hf_posenc_patch"

# Called inside the transaction, on the unpatched model, just before the family installs the method:
# (model, method module, undo log). What it changes is recorded in the log, so a failure or unpatch undoes it.
BeforeInstall = Callable[[nn.Module, PositionalMethod, UndoLog], None]


@dataclass
class AppliedPatch:
    config: PosEncConfig
    installed: PositionalMethod  # the module the patch installed
    state: PositionState
    log: UndoLog

    @property
    def method(self) -> PositionalMethod:
        """The method module the model computes with: the installed one, or PEFT's trained copy of it (see
        engine/state.py: active_method)."""
        return self.state.method if self.state.installed is self.installed else self.installed


def install_patch(model: nn.Module, config: PosEncConfig, before_install: BeforeInstall | None = None) -> nn.Module:
    """Patch `model` in place with the method of `config` (a validated config of a registered method), replacing
    any previous patch; on failure the model is left exactly as it was."""
    family = get_family(getattr(model, "config", None))
    previous = applied_patch(model)
    if previous is not None:  # the new method is built for, and installed on, the original model
        previous.log.undo()
        delattr(model, PATCH_ATTR)
    log = UndoLog()
    try:
        give_own_config(model, log)
        info = method_info(family, model, previous.method if previous is not None else None)
        method_module = config_for(config).module_class(config, info)  # model-dependent checks happen here
        _move_like(method_module, model)
        if before_install is not None:
            before_install(model, method_module, log)
        state = family.install(model, method_module, info, log)
    except BaseException:
        log.undo()
        if previous is not None:
            _reinstall(model, family, previous, before_install)
        raise
    setattr(model, PATCH_ATTR, AppliedPatch(config, method_module, state, log))
    return model


def remove_patch(model: nn.Module) -> nn.Module:
    """Undo the patch: the model computes exactly what it did before. A no-op on unpatched models."""
    patched = unwrap_peft(model)
    applied = applied_patch(patched)
    if applied is not None:
        applied.log.undo()
        delattr(patched, PATCH_ATTR)
    return model


def applied_patch(model: nn.Module) -> AppliedPatch | None:
    return getattr(unwrap_peft(model), PATCH_ATTR, None)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT's wrappers (PeftModel.base_model, a tuner's `.model`); `model` itself when
    it is not wrapped. A patch goes there, where the model's own modules are: on the wrapper it would change nothing
    (issue 51). Without peft imported, no model can be wrapped by it."""
    if "peft" not in sys.modules:
        return model
    from peft import PeftMixedModel, PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    while True:
        if isinstance(model, (PeftModel, PeftMixedModel)):
            model = model.base_model
        elif isinstance(model, BaseTuner):
            model = model.model
        else:
            return model


def give_own_config(model: nn.Module, log: UndoLog) -> None:
    """Give the model (and every module holding the same config object) a private copy of its config, so a patch
    (which sets the attention implementation, or rope_parameters) never changes another model built from the same
    config object, as transformers 5 does for `Model(config)` twice. Undo puts the shared object back."""
    shared = model.config
    private = copy.deepcopy(shared)
    for module in model.modules():
        if module.__dict__.get("config") is shared:
            log.set_attr(module, "config", private)


def method_info(family, model: nn.Module, previous_method: PositionalMethod | None) -> ModelInfo:
    """What a method is built from on the (unpatched) model, given the method of the patch it replaces."""
    info = family.model_info(model)
    if info.rope_theta is None and isinstance(previous_method, RotaryMethod) and previous_method.theta is not None:
        # A RoPE scaling on a model that was patched to `rope` scales that RoPE (never the previous scaling).
        info = dataclasses.replace(info, patched_rope_theta=previous_method.theta)
    return info


def _reinstall(model: nn.Module, family, previous: AppliedPatch, before_install: BeforeInstall | None) -> None:
    """Put the previous patch back (same module, so trained parameters survive) after a failed replacement."""
    log = UndoLog()
    try:
        give_own_config(model, log)
        if before_install is not None:
            before_install(model, previous.installed, log)
        state = family.install(model, previous.installed, family.model_info(model), log)
    except BaseException:
        log.undo()  # leave the original model rather than a half-installed one
        raise
    setattr(model, PATCH_ATTR, AppliedPatch(previous.config, previous.installed, state, log))


def _move_like(method_module: nn.Module, model: nn.Module) -> None:
    reference = next(model.parameters(), None)
    if reference is not None:
        method_module.to(device=reference.device)
        for param in method_module.parameters():
            param.data = param.data.to(reference.dtype) if param.is_floating_point() else param.data
