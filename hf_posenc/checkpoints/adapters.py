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
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..engine.install import applied_patch
from ..errors import PosEncError
from .metadata import write_metadata
from .saving import posenc_metadata, positional_state, share_weight_files

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's state-dict keys


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
    from safetensors.torch import load_file, save_file

    base = _patched_base(peft_model)
    if list(peft_model.peft_config) != ["default"] or kwargs.get("selected_adapters") not in (None, ["default"]):
        raise PosEncError("save_adapter saves one adapter, named 'default'; this PEFT model has "
                          f"{sorted(peft_model.peft_config)}. Save the others with PEFT's save_pretrained.")
    if kwargs.get("safe_serialization") is False:
        raise PosEncError("save_adapter writes safetensors; leave safe_serialization at its default (True).")
    method = applied_patch(base).method
    metadata = posenc_metadata(base, method)
    metadata["adapter"] = True
    peft_model.save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
    if not is_main_process:
        return
    weights_path = Path(save_directory) / ADAPTER_WEIGHTS_NAME
    tensors = load_file(weights_path)
    for key, value in positional_state(base, method).items():
        tensors[PEFT_PREFIX + key] = value.detach().to("cpu").contiguous()
    save_file(tensors, weights_path, metadata={"format": "pt"})
    share_weight_files(save_directory)
    write_metadata(save_directory, metadata)


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
