"""The transactional core of a patch: build the method for the model, install it through the model's family, and
keep an undo log of every change. If anything fails half way, the log is undone and the model is left exactly as
it was (with the previous patch, if there was one, put back).

Which parts of the family a method takes is decided here, by the method's kind (`install_method`): every method
gets the per-forward position capture; an absolute method is added to the input embeddings, a bias, a content
method or a rotation inside attention routes attention through the shared path, another rotation goes where the
family applies its own. The family says where position enters and how the native mechanism is removed.

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
from ..errors import PosEncError
from ..methods.base import AttentionBiasMethod, ContentMethod, PositionalMethod, RotaryMethod
from ..model_info import ModelInfo
from ..registry import config_for, get_family
from .content import install_content
from .hybrid import HybridMethod
from .replay import PrefixReplay
from .sink_cache import GenerateWithBoundedCache
from .state import PositionCapture, PositionState, RecordKeyPositions, forward_parameter_names
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
        state = install_method(family, model, method_module, info, log)
    except BaseException:
        log.undo()
        if previous is not None:
            _reinstall(model, family, previous, before_install)
        raise
    setattr(model, PATCH_ATTR, AppliedPatch(config, method_module, state, log))
    return model


def install_method(family, model: nn.Module, method: PositionalMethod, info: ModelInfo, log: UndoLog
                   ) -> PositionState:
    """Install `method` on `model` through its family (a families/base.py ModelFamily), every change in `log`."""
    if isinstance(method, HybridMethod):
        state = install_hybrid(family, model, method, info, log)
    else:
        state = _install_whole(family, model, method, info, log)
    family.after_install(model, method, info, log)
    return state


def _install_whole(family, model: nn.Module, method: PositionalMethod, info: ModelInfo, log: UndoLog
                   ) -> PositionState:
    base = family.base_model(model)
    attribute = family.method_attribute(method)
    state = PositionState(method, model.config, holder=base, attribute=attribute)
    log.set_attr(base, attribute, method)  # registers the method's parameters under the base model
    parameter_names = forward_parameter_names(base)
    replay = None
    if isinstance(method, RotaryMethod) and method.length_dependent and method.exact_cache:
        replay = PrefixReplay(method, "position_ids" in parameter_names, model.config)
        log.add_forward_hook(base, replay.cut_outputs, with_kwargs=True)
    capture = PositionCapture(state, parameter_names, family.default_positions, replay,
                              adds_embeddings=attribute == "posenc")
    log.add_forward_pre_hook(base, capture, with_kwargs=True)
    log.add_forward_hook(base, RecordKeyPositions(state), with_kwargs=True)
    if method.kept_keys() is not None:  # generate creates the bounded cache of the keys the method keeps
        log.set_attr(model, "_prepare_cache_for_generation", GenerateWithBoundedCache(model, method))
    if family.patch_is_identity(method, info):
        return state
    if isinstance(method, ContentMethod):  # base="native" keeps the model's own mechanism underneath
        if not method.keeps_native:
            family.remove_native(model, state, log)
        family.route_attention(model, state, log)
        install_content(family, model, state, log)
        return state
    family.remove_native(model, state, log)
    _add_in_layers(family, model, method, state, log)
    return state


def _add_in_layers(family, model: nn.Module, method: PositionalMethod, state: PositionState, log: UndoLog,
                   layers: list[int] | None = None) -> None:
    """A bias or a rotation inside attention: the shared attention path; another rotation: where the family applies
    its own. (An absolute method is added to the input by the position capture; NoPE adds nothing.)"""
    rotates_in_attention = isinstance(method, RotaryMethod) and method.rotates_in_attention
    if isinstance(method, AttentionBiasMethod) or rotates_in_attention:
        family.route_attention(model, state, log, layers)
    elif isinstance(method, RotaryMethod):
        family.add_rotary(model, method, state, log, layers)


def install_hybrid(family, model: nn.Module, hybrid: HybridMethod, info: ModelInfo, log: UndoLog) -> PositionState:
    """Install each part of a hybrid on its layers only, with a position state of its own; the other layers keep
    the model's own mechanism. Returns the first part's state."""
    base = family.base_model(model)
    log.set_attr(base, "posenc", hybrid)
    parameter_names = forward_parameter_names(base)
    # Parts that replace the position of every layer: no layer reads the native mechanism any more, so a family
    # whose own positions are not a layer's (GPT-2's wpe, added to the input) loses them as with the full patch.
    every_layer = {index for layers in hybrid.part_layers for index in layers} == set(range(info.num_layers))
    replaces_all = every_layer and not any(family.patch_is_identity(method, info) for method in hybrid.parts)
    states = []
    for method, layers in zip(hybrid.parts, hybrid.part_layers):
        state = PositionState(method, model.config)
        states.append(state)
        log.add_forward_pre_hook(base, PositionCapture(state, parameter_names, family.default_positions,
                                                       adds_embeddings=False), with_kwargs=True)
        log.add_forward_hook(base, RecordKeyPositions(state), with_kwargs=True)
        if family.patch_is_identity(method, info):
            continue
        if not family.native_per_layer and not replaces_all and \
                not isinstance(method, (AttentionBiasMethod, RotaryMethod)):
            raise PosEncError(
                f"On {family.name} models position enters as an embedding added to the input, not inside the "
                f"layers, and a hybrid that leaves some layers native keeps it: {method.config.method!r} on "
                f"layers {layers} would change nothing. Patch the whole model with {method.config.method!r} (no "
                "layers=), or put a method that acts inside attention on those layers.")
        family.remove_native(model, state, log, layers)
        _add_in_layers(family, model, method, state, log, layers)
    if replaces_all and not family.native_per_layer:
        family.remove_native(model, states[0], log)
    return states[0]


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
        state = install_method(family, model, previous.installed, family.model_info(model), log)
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
