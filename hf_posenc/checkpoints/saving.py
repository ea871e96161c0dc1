"""What `save_pretrained` writes for a patched model.

A patched model's `save_pretrained` (an instance-level wrapper attached inside the patch, removed by
`unpatch_model`) writes the usual transformers checkpoint of the *original* architecture (weights a patch took out
of the module tree, such as GPT-2's `wpe`, are saved as they were) plus the positional module's own state under
`<base model>.posenc.*`, and `posenc_config.json` beside `config.json`: the method, its options, the patches it was
built on, the base model, and the model's shape for validation (checkpoints/restore.py checks it on loading).

`standalone=True` (code that plain transformers runs) and `push_to_hub=True` are the library's: `patch_model` and
`from_pretrained` give the wrapper a `publish` function for them (checkpoints/hub.py). A model patched by a
checkpoint's standalone code has none, and refuses them before writing anything.

This module is copied into standalone checkpoints (checkpoints/export.py).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..config import PosEncConfig
from ..engine.install import applied_patch
from ..errors import PosEncError
from ..methods.base import PositionalMethod
from ..registry import get_family
from ..version import __version__
from .metadata import FORMAT_VERSION, write_metadata

BASE_MODEL_ATTR = "hf_posenc_base_model"
BASE_MODEL_KEYS = ("base_model", "base_model_revision", "base_model_license", "base_model_note")
# On the method module: its state as installed, to tell trained (or loaded) positional weights from initial ones.
INITIAL_STATE_ATTR = "hf_posenc_initial_state"
MODEL_FACTS = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")
# Config attributes a patch may rewrite so that config.json is native (RoPE scalings on LLaMA-style models).
NATIVE_CONFIG_KEYS = ("rope_parameters", "max_position_embeddings")
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_KEY_PREFIX = "base_model.model."  # what PeftModel puts before the base model's state-dict keys
# save_pretrained keywords that only an upload uses (kept from transformers' own save).
PUSH_OPTIONS = ("repo_id", "commit_message", "private", "revision", "create_pr")

# After a checkpoint is written: publish(directory, metadata, standalone=..., upload=..., token=..., **push options);
# before, with check=True: refuse what it cannot do. See checkpoints/hub.py: publish_saved.
Publish = Callable[..., Any]


def attach_save_hook(model: nn.Module, method: PositionalMethod, log, publish: Publish | None = None) -> None:
    """Called inside the patch transaction on the unpatched model, just before the patch is installed: remembers the
    original state dict (references, no copies; under the architecture's own names, `architecture_state`) and gives
    the model a `save_pretrained` that saves the patch.

    The patches the method builds on (`method.builds_on()`: a RoPE scaling on GPT-2 scales a `rope` patch) are
    recorded with it and replayed in order when the checkpoint is loaded."""
    config_before = {name: copy.deepcopy(getattr(model.config, name, None)) for name in NATIVE_CONFIG_KEYS}
    save = PatchedSavePretrained(model, method, architecture_state(model), model.save_pretrained, config_before,
                                 publish)
    log.set_attr(model, "save_pretrained", save)
    object.__setattr__(method, INITIAL_STATE_ATTR,
                       {key: value.detach().clone() for key, value in method.state_dict().items()})


def peft_layers(model: nn.Module) -> list[str]:
    """Names of PEFT's tuner layers in the tree (LoRA's q_proj around the original Linear, its `base_layer`)."""
    import sys

    tuners = sys.modules.get("peft.tuners.tuners_utils")  # imported wherever such a layer exists
    if tuners is None:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, tuners.BaseTunerLayer)]


def architecture_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` under the architecture's names: a PEFT tuner layer gives its base layer's
    tensors under its own name and its adapter weights not at all. A model patched after ``get_peft_model`` (or put
    back under it, as the distillation teacher does each step) is saved merged with the names a loader expects; it
    was saved with ``q_proj.base_layer.weight`` and ``lora_A``, which every loader read as random projections."""
    state = model.state_dict(keep_vars=True)
    tuners = peft_layers(model)
    if not tuners:
        return state
    named = {}
    for key, value in state.items():
        owner = next((name for name in tuners if key.startswith(f"{name}.")), None)
        if owner is None:
            named[key] = value
        elif key.startswith(f"{owner}.base_layer."):
            named[f"{owner}.{key[len(owner) + len('.base_layer.'):]}"] = value
    return named


def changed_positional_state(method: PositionalMethod) -> list[str]:
    """Names of the method's weights that no longer hold the values they were installed with: trained, or loaded
    from a checkpoint (hf_posenc.from_pretrained loads them after installing the patch)."""
    initial = getattr(method, INITIAL_STATE_ATTR, None)
    if initial is None:
        return []
    return [key for key, value in method.state_dict().items()
            if key not in initial or not torch.equal(initial[key].to(value.device, value.dtype), value)]


class PatchedSavePretrained:
    """The patched model's `save_pretrained`. A callable object rather than a closure, so that
    `copy.deepcopy(model)` gives a copy whose save_pretrained saves the copy."""

    def __init__(self, model: nn.Module, method: PositionalMethod, original_state: dict, original_save,
                 config_before: dict, publish: Publish | None = None):
        self.model = model
        self.method = method
        self.original_state = original_state
        self.original_save = original_save
        self.config_before = config_before
        self.publish = publish

    def __call__(self, save_directory, is_main_process: bool = True, state_dict: dict | None = None,
                 push_to_hub: bool = False, *, standalone: bool = False, base_model: str | None = None,
                 base_model_revision: str | None = None, **kwargs):
        """transformers' save_pretrained, plus the positional patch (see hf_posenc/checkpoints/saving.py).

        standalone=True also writes code that plain transformers runs with trust_remote_code=True.
        base_model / base_model_revision: the Hub model this one was made from, for posenc_config.json and
        the model card (default: what the model was loaded from, when that is a Hub id)."""
        if (standalone or push_to_hub) and self.publish is None:
            raise PosEncError(
                f"save_pretrained({'standalone' if standalone else 'push_to_hub'}=True) needs the hf_posenc library, "
                "and this model was patched by a checkpoint's standalone code: install hf_posenc and load the "
                "checkpoint with hf_posenc.from_pretrained to save it that way.")
        model = self.model
        applied = applied_patch(model)
        # the module that computes now: PEFT's merge_and_unload may have put a trained copy in the method's place
        method = applied.method if applied is not None and applied.installed is self.method else self.method
        metadata = posenc_metadata(model, method, base_model=base_model, base_model_revision=base_model_revision,
                                   config_before=self.config_before)
        if getattr(model, "_hf_peft_config_loaded", False):
            # transformers' PEFT integration (model.add_adapter / load_adapter): transformers saves the adapter
            if standalone or push_to_hub:
                raise PosEncError("This model carries a PEFT adapter (add_adapter / load_adapter), and its "
                                  "save_pretrained writes the adapter alone: save it without standalone / "
                                  "push_to_hub, or merge or delete the adapter first.")
            self.original_save(save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs)
            if is_main_process:
                prefix = ADAPTER_KEY_PREFIX if kwargs.get("save_peft_format", True) else ""
                write_adapter_patch(save_directory, metadata, positional_state(model, method), prefix)
            return
        if state_dict is None:
            unmerged = peft_layers(model)
            if unmerged:  # the architecture's weights would be saved without the adapters' updates
                raise PosEncError(f"This model holds PEFT adapter layers not merged ({unmerged[0]}, ...), which its "
                                  "save_pretrained cannot write under the architecture's names: merge them first "
                                  "(peft_model.merge_and_unload()) or save the adapter (hf_posenc.save_adapter).")
            state_dict = checkpoint_state_dict(model, method, self.original_state)
        missing = sorted(set(metadata["positional_state"]) - set(state_dict))
        if missing:
            raise PosEncError(f"The state_dict given to save_pretrained lacks the positional weights {missing}.")
        push_options = {key: kwargs.pop(key) for key in PUSH_OPTIONS if key in kwargs}
        if standalone:  # refuse code that cannot be made before anything is written
            self.publish(save_directory, metadata, standalone=True, upload=False, check=True)
        self.original_save(save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs)
        if not is_main_process:
            return
        share_weight_files(save_directory)
        write_metadata(save_directory, metadata)
        if standalone or push_to_hub:
            self.publish(save_directory, metadata, standalone=standalone, upload=push_to_hub,
                         token=kwargs.get("token"), **push_options)


def write_adapter_patch(save_directory, metadata: dict[str, Any], positional: dict[str, torch.Tensor],
                        key_prefix: str = ADAPTER_KEY_PREFIX) -> None:
    """After an adapter was saved (PEFT's or transformers' save_pretrained): add the positional weights to
    adapter_model.safetensors, under their names in the model with `key_prefix` (PEFT's `base_model.model.`), and
    write posenc_config.json saying it is an adapter's. PEFT's loader passes these keys on to load_state_dict."""
    from safetensors.torch import load_file, save_file

    weights_path = Path(save_directory) / ADAPTER_WEIGHTS_NAME
    tensors = load_file(weights_path)
    for key, value in positional.items():
        tensors[key_prefix + key] = value.detach().to("cpu").contiguous()
    save_file(tensors, weights_path, metadata={"format": "pt"})
    share_weight_files(save_directory)
    write_metadata(save_directory, {**metadata, "adapter": True})


def share_weight_files(directory) -> None:
    """Give the weight files the mode any new file gets here (0666 less the umask, 0644 usually), as config.json has.
    transformers writes them through a private temporary file (mode 0600), so a checkpoint saved for others could
    not be read by them."""
    directory = Path(directory)
    probe = directory / f".hf_posenc-mode-probe-{os.getpid()}"
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        mode = probe.stat().st_mode & 0o777
    finally:
        probe.unlink()
    for weights in directory.glob("*.safetensors"):
        if weights.stat().st_mode & 0o777 == 0o600:  # as transformers left it; a mode set on purpose is kept
            weights.chmod(mode)


def positional_prefix(model: nn.Module, method: PositionalMethod) -> str:
    """Where the method module sits in the model ('model.posenc', 'transformer.posenc'). Inside PEFT's
    modules_to_save wrapper (model.posenc.modules_to_save.default, model.posenc.original_module) it is the
    wrapper's place, the name PEFT itself saves it under."""
    for name, module in model.named_modules():
        if module is method:
            return re.sub(r"\.(modules_to_save\.[^.]+|original_module)$", "", name)
    raise PosEncError("The positional module is not part of this model (was it patched by hf_posenc?).")


def positional_state(model: nn.Module, method: PositionalMethod) -> dict[str, torch.Tensor]:
    prefix = positional_prefix(model, method)
    return {f"{prefix}.{key}": value for key, value in method.state_dict().items()}


def checkpoint_state_dict(model: nn.Module, method: PositionalMethod,
                          original_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original architecture's state dict (current values; tensors the patch took out of the module tree as
    they were) plus the positional state. State of modules the patch put in is left out: the patch rebuilds it."""
    current = model.state_dict()
    state = {key: current[key] if key in current else value.detach() for key, value in original_state.items()}
    state.update(positional_state(model, method))
    return state


def base_model_reference(model: nn.Module) -> dict[str, Any]:
    """{"base_model", "base_model_revision"}: what from_pretrained (or a loader such as the tools' bundled SmolLM2)
    recorded in BASE_MODEL_ATTR, with "base_model_license" and "base_model_note" where it knows them; else what the
    model was loaded from when that is not a local path."""
    recorded = getattr(model, BASE_MODEL_ATTR, None)
    if recorded:
        return {key: value for key, value in recorded.items() if key in BASE_MODEL_KEYS}
    name = getattr(model.config, "_name_or_path", "") or None
    if name and (os.path.isabs(name) or os.path.exists(name) or name.startswith(".")):
        name = None
    return {"base_model": name, "base_model_revision": None}


def posenc_metadata(model: nn.Module, method: PositionalMethod, base_model: str | None = None,
                    base_model_revision: str | None = None, config_before: dict | None = None) -> dict[str, Any]:
    """The content of posenc_config.json for a patched model. `config_before`: the values NATIVE_CONFIG_KEYS had
    before the patch; those it changed are recorded, because loading must start from the original model."""
    family = get_family(model.config)
    info = family.model_info(model)
    recorded = base_model_reference(model)
    recorded_base, recorded_revision = recorded.get("base_model"), recorded.get("base_model_revision")
    # what is known about the recorded base (its license, how its weights were made), when it is the base named
    about_base = {key: recorded[key] for key in ("base_model_license", "base_model_note")
                  if recorded.get(key) and base_model in (None, recorded_base)}
    state = positional_state(model, method)
    return {
        "format": "hf_posenc",
        "format_version": FORMAT_VERSION,
        "hf_posenc_version": __version__,
        "method": method.config.method,
        "options": _options(method.config),
        "applied_after": [{"method": c.method, "options": _options(c)} for c in method.builds_on()],
        "base_model": base_model or recorded_base,
        "base_model_revision": base_model_revision if base_model else (base_model_revision or recorded_revision),
        **about_base,
        "model": {"architecture": type(model).__name__, "family": family.name,
                  **{fact: getattr(info, fact) for fact in MODEL_FACTS}},
        "positional_state": {key: {"shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", "")}
                             for key, value in state.items()},
        "native": family.is_native(model, method),
        "config_before_patch": {name: value for name, value in (config_before or {}).items()
                                if getattr(model.config, name, None) != value},
        # a hybrid (engine/hybrid.py): what each layer runs, a part's method or "native"
        **({"layer_methods": method.config.layer_methods(info.num_layers)}
           if hasattr(method.config, "layer_methods") else {}),
    }


def _options(config: PosEncConfig) -> dict[str, Any]:
    return {key: value for key, value in config.to_dict().items() if key != "method"}
