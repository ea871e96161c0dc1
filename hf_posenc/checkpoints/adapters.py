"""PEFT adapters of a patched model: the adapter folder carries the patch and its positional weights.

    peft_model = peft.get_peft_model(hf_posenc.patch_model(model, "kerple"), LoraConfig(...))
    ... train ...
    hf_posenc.save_adapter(peft_model, "adapter")     # PEFT's save_pretrained + posenc_config.json + positional weights
    peft_model = hf_posenc.from_pretrained("adapter")  # base model (from adapter_config.json), patch, adapter
    peft_model = hf_posenc.load_adapter("adapter", base_model=model)            # the same, on a base you loaded
    peft_model = PeftModel.from_pretrained(patched_base, "adapter")             # PEFT's own loader, on a base
                                                                                # patched with the same method

PEFT's own `save_pretrained` writes only what PEFT trains (the LoRA matrices): it has no hook through which a
patch could add its state, so `save_adapter` calls it and then adds the positional weights to
`adapter_model.safetensors`, under the names they have in the PeftModel (`base_model.model.<base>.posenc.*`), and
writes `posenc_config.json` (with `"adapter": true`). PEFT's loader passes keys that are not LoRA weights through
to `load_state_dict`, so `PeftModel.from_pretrained` on a base patched with the same method restores the trained
positional weights too; on an unpatched base it cannot apply the patch, which is what `load_adapter`
(checkpoints/loading.py, beside from_pretrained, which it uses for the base model) adds.

With PEFT's own API alone, `LoraConfig(modules_to_save=peft_modules_to_save(model))` makes PEFT train, save and
load the positional module itself (no posenc_config.json: load such an adapter onto a base patched the same way).
transformers' `model.add_adapter` route saves through the patched model's save_pretrained (checkpoints/saving.py),
which writes the same form as save_adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.install import applied_patch
from ..errors import PosEncError
from .saving import (ADAPTER_KEY_PREFIX, ADAPTER_WEIGHTS_NAME, posenc_metadata, positional_prefix,
                     positional_state, write_adapter_patch)

ADAPTER_CONFIG_NAME = "adapter_config.json"
PEFT_PREFIX = ADAPTER_KEY_PREFIX


def _patched_base(peft_model: nn.Module) -> nn.Module:
    get_base = getattr(peft_model, "get_base_model", None)
    if get_base is None:
        raise PosEncError("save_adapter needs a PEFT model (from peft.get_peft_model), got "
                          f"{type(peft_model).__name__}.")
    base = get_base()
    if applied_patch(base) is None:
        raise PosEncError("The PEFT model's base model is not patched by hf_posenc: save it with its own "
                          "save_pretrained, or patch the base model before peft.get_peft_model.")
    return base


def save_adapter(peft_model: nn.Module, save_directory, is_main_process: bool = True, **kwargs) -> None:
    """PEFT's `save_pretrained` (the adapter only, keywords passed on), plus the positional patch: its trained
    weights in adapter_model.safetensors and posenc_config.json. Only the default adapter is supported."""
    base = _patched_base(peft_model)
    if list(peft_model.peft_config) != ["default"] or kwargs.get("selected_adapters") not in (None, ["default"]):
        raise PosEncError("save_adapter saves one adapter, named 'default'; this PEFT model has "
                          f"{sorted(peft_model.peft_config)}. Save the others with PEFT's save_pretrained.")
    if kwargs.get("safe_serialization") is False:
        raise PosEncError("save_adapter writes safetensors; leave safe_serialization at its default (True).")
    method = applied_patch(base).method
    metadata = posenc_metadata(base, method)
    peft_model.save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
    if is_main_process:
        write_adapter_patch(save_directory, metadata, positional_state(base, method), PEFT_PREFIX)


def peft_modules_to_save(model: nn.Module) -> list[str]:
    """The positional module's name for PEFT's `modules_to_save`, so that PEFT's own API trains and saves the patch's
    weights with the adapter:

        config = LoraConfig(r=8, target_modules=[...], modules_to_save=hf_posenc.peft_modules_to_save(model))
        peft_model = peft.get_peft_model(model, config)     # trains a copy of the positional module
        peft_model.save_pretrained("adapter")                # LoRA + the trained positional weights
        PeftModel.from_pretrained(patched_base, "adapter")   # on a base patched the same way: both restored

    Empty when the method has no trainable weights (ALiBi's fixed slopes, RoPE): nothing to save. PEFT trains a copy
    of a listed module; the patch computes with that copy while PEFT's adapter is active, and with the original when
    it is disabled (engine/state.py: active_method). posenc_config.json is not written by PEFT: hf_posenc.save_adapter
    adds it, for loading onto an unpatched base."""
    applied = applied_patch(model)
    if applied is None:
        raise PosEncError("peft_modules_to_save needs a model patched by hf_posenc (hf_posenc.patch_model), before "
                          "peft.get_peft_model.")
    if not any(parameter.requires_grad for parameter in applied.installed.parameters()):
        return []
    return [positional_prefix(model, applied.installed)]


def is_adapter_directory(metadata: dict | None) -> bool:
    return bool(metadata and metadata.get("adapter"))


class AdapterTensors:
    """The positional weights inside an adapter's adapter_model.safetensors, by their base-model names (the interface
    of checkpoints/restore.py's CheckpointTensors)."""

    def __init__(self, directory, hub_kwargs: dict):
        from transformers.utils import cached_file

        path = cached_file(directory, ADAPTER_WEIGHTS_NAME, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if path is None:
            raise PosEncError(f"{directory} has no {ADAPTER_WEIGHTS_NAME}: save the adapter with "
                              "hf_posenc.save_adapter (safetensors).")
        self.path = path

    def shapes(self, keys: list[str]) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as handle:
            held = set(handle.keys())
            return {key: tuple(handle.get_slice(PEFT_PREFIX + key).get_shape()) for key in keys
                    if PEFT_PREFIX + key in held}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as handle:
            return {key: handle.get_tensor(PEFT_PREFIX + key) for key in keys}
