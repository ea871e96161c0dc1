"""patch_model / unpatch_model / get_posenc_config / get_positional_module: the public entry points.

The engine does the patching (engine/install.py: built for the model, installed through its family, recorded in an
undo log, failure-atomic). What the library adds here: turning a method name and options into a validated config,
and the patched model's `save_pretrained`, which also saves the patch (checkpoints/saving.py) and, with
standalone=True or push_to_hub=True, writes standalone code or uploads (checkpoints/hub.py: publish_saved).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch import nn

from .checkpoints.hub import publish_saved
from .checkpoints.saving import attach_save_hook, changed_positional_state
from .config import PosEncConfig
from .engine.hybrid import REST, HybridConfig, parse_layers, part_config, refuse_per_layer, rest_layers
from .engine.install import applied_patch, install_patch, remove_patch, unwrap_peft
from .engine.sink_cache import SinkCache, bounded_cache, num_layers
from .errors import PosEncError
from .methods.base import PositionalMethod
from .registry import config_for, get_family, get_method


def resolve_config(method: str | PosEncConfig, options: dict[str, Any]) -> PosEncConfig:
    if isinstance(method, PosEncConfig):
        if options:
            raise PosEncError(
                f"Options {sorted(options)} were given together with a {type(method).__name__}; put them in the "
                "config instead."
            )
        config_for(method)  # must be a registered method's config
        method.validate()
        return method
    return get_method(method).config_class.from_options(**options)


def patch_model(model: nn.Module, method: str | PosEncConfig, layers: Any = None, **options: Any) -> nn.Module:
    """Swap the positional mechanism of a causal LM in place and return it.

    `method` is a registered name (see `available_methods()`) with its options as keywords, or a method's
    config object. Patching a patched model replaces the previous patch, with a warning when its positional
    weights were trained or loaded from a checkpoint (they are discarded). If anything fails, the model is left
    exactly as it was.

    `layers` makes a hybrid (engine/hybrid.py): the method runs on those layers only ([1, 3], 'every:4',
    'first:N', 'last:N'), the others keep the model's own mechanism. On a model that is already a hybrid, a patch
    on other layers is added to it (its parts and their trained weights are kept); 'rest' names every layer that no
    part runs yet.

    A PEFT model (peft.get_peft_model) is patched inside: its transformers model is patched exactly as without the
    wrapper, and the patch's weights are frozen as get_peft_model freezes every weight but the adapter's.
    """
    target = unwrap_peft(model)
    if layers is not None:
        _patch_layers(target, method, layers, options)
    else:
        config = resolve_config(method, options)
        warn_if_discarding_trained_state(target, config)
        install_patch(target, config, functools.partial(attach_save_hook, publish=publish_saved))
    if target is not model:
        # What patching before get_peft_model gives: PEFT trains its adapter alone (to train the positional weights
        # too, patch first and list them in modules_to_save: hf_posenc.peft_modules_to_save).
        applied_patch(target).installed.requires_grad_(False)
    return model


def _patch_layers(model: nn.Module, method: str | PosEncConfig, layers: Any, options: dict[str, Any]) -> None:
    part = part_config(method, options)
    refuse_per_layer(part)
    applied = applied_patch(model)
    total = get_family(getattr(model, "config", None)).model_info(model).num_layers
    if layers == REST:
        hybrid = applied is not None and isinstance(applied.config, HybridConfig)
        indices = rest_layers(applied.config.parts if hybrid else None, total)
    else:
        indices = parse_layers(layers, total)
    new_part = {"method": part.method, "options": {k: v for k, v in part.to_dict().items() if k != "method"},
                "layers": indices}
    if applied is not None and isinstance(applied.config, HybridConfig):
        taken = {index: p["method"] for p in applied.config.parts for index in p["layers"]}
        overlap = sorted(set(indices) & set(taken))
        if overlap:
            raise PosEncError(f"Layers {overlap} of this hybrid already run {sorted({taken[i] for i in overlap})}; a "
                              "patch with layers= adds a part on other layers. Choose layers without a part, or call "
                              "hf_posenc.unpatch_model(model) first to start again.")
        kept = [module.state_dict() for module in applied.method.parts]
        config = HybridConfig(parts=[*applied.config.parts, new_part])
        install_patch(model, config, functools.partial(attach_save_hook, publish=publish_saved))
        hybrid = applied_patch(model).method
        for module, state in zip(hybrid.parts, kept):  # the parts already there keep their (trained) weights
            module.load_state_dict(state)
        return
    config = HybridConfig(parts=[new_part])
    warn_if_discarding_trained_state(model, config)
    install_patch(model, config, functools.partial(attach_save_hook, publish=publish_saved))


def warn_if_discarding_trained_state(model: nn.Module, config: PosEncConfig) -> None:
    applied = applied_patch(model)
    changed = changed_positional_state(applied.method) if applied is not None else []
    if changed:
        warnings.warn(
            f"patch_model replaces this model's {applied.config.method!r} patch with {config.method!r}: its trained "
            f"positional weights ({', '.join(changed)}) are discarded, and the model computes the base model's "
            "weights with the new method. Call hf_posenc.unpatch_model(model) first to say that is intended.",
            UserWarning, stacklevel=3)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo hf_posenc's patch: the model computes exactly what it did before. A no-op on unpatched models."""
    return remove_patch(model)


def get_posenc_config(model: nn.Module) -> PosEncConfig | None:
    applied = applied_patch(model)
    return applied.config if applied is not None else None


def get_positional_module(model: nn.Module) -> PositionalMethod | None:
    """The active method's module (holding its parameters, if any)."""
    applied = applied_patch(model)
    return applied.method if applied is not None else None


def sink_cache(model: nn.Module) -> SinkCache:
    """The bounded KV cache for a model patched with `sinks` (what `model.generate` creates by itself): pass it as
    `past_key_values` to your own decoding loop; memory stays at num_sinks + window - 1 keys per layer."""
    applied = applied_patch(model)
    cache = bounded_cache(applied.method, num_layers(unwrap_peft(model))) if applied is not None else None
    if cache is None:
        method = applied.config.method if applied is not None else None
        raise PosEncError(f"sink_cache(model) needs a model patched with 'sinks'; this one is "
                          f"{'patched with ' + repr(method) if method else 'not patched'}. Call "
                          "hf_posenc.patch_model(model, 'sinks', num_sinks=4, window=...) first.")
    return cache
