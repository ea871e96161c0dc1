"""Re-applying a saved patch to a freshly loaded (unpatched) model: check `posenc_config.json` against the model,
build the patch on the meta device to compare the state its options imply with the recorded shapes and the
safetensors headers (so an edited option cannot make the loader allocate memory first), re-apply the patch, and load
the positional state into it. Nothing from the checkpoint is executed.

Both loaders use it: `hf_posenc.from_pretrained` (checkpoints/loading.py) and the generated standalone code, which
carries a copy of this module (checkpoints/export.py): it imports only modules of the engine and, inside functions,
transformers / safetensors / torch.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import PosEncConfig
from ..engine.install import applied_patch, install_patch, method_info, remove_patch
from ..errors import PosEncError
from ..methods.base import PositionalMethod
from ..registry import config_for, get_family, get_method
from .metadata import POSENC_CONFIG_NAME
from .saving import MODEL_FACTS, NATIVE_CONFIG_KEYS, Publish, attach_save_hook, positional_prefix

logger = logging.getLogger(__name__)

# from_pretrained keywords that say where files come from (passed on to transformers' cached_file).
HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def method_configs(metadata: dict[str, Any]) -> list[PosEncConfig]:
    """The configs to patch with, in order (earlier patches first); unknown methods and options are refused."""
    steps = [*(metadata.get("applied_after") or []), {"method": metadata["method"], "options": metadata["options"]}]
    configs = []
    for step in steps:
        if not isinstance(step, dict) or not isinstance(step.get("options"), dict):
            raise PosEncError(f"{POSENC_CONFIG_NAME}: malformed patch entry {step!r}.")
        try:
            configs.append(get_method(step.get("method")).config_class.from_saved_options(**step["options"]))
        except PosEncError as error:
            raise PosEncError(f"{POSENC_CONFIG_NAME} cannot be applied: {error}") from None
    return configs


def config_before_patch(config, metadata: dict[str, Any]):
    """A copy of the checkpoint's config with the values the patch rewrote put back, so the model is built as
    the original one (whose config.json says, for example, YaRN) before the patch is applied again."""
    before = metadata.get("config_before_patch") or {}
    if not isinstance(before, dict) or set(before) - set(NATIVE_CONFIG_KEYS):
        raise PosEncError(f"{POSENC_CONFIG_NAME}: config_before_patch may only hold {NATIVE_CONFIG_KEYS}.")
    # Checked here, before transformers builds anything: a relabelled config.json would build another architecture
    # (a GPT-2 config read as LLaMA's defaults: a 7B model) and a junk rope_type fails inside it (KeyError).
    recorded_type = metadata["model"].get("model_type")
    if recorded_type != getattr(config, "model_type", None):
        raise PosEncError(f"{POSENC_CONFIG_NAME}: the field model.model_type is {recorded_type!r}, and the "
                          f"checkpoint's config.json says model_type {getattr(config, 'model_type', None)!r}; one of "
                          "them was edited. Refusing to load: save the model again with save_pretrained.")
    window = before.get("max_position_embeddings")
    if "max_position_embeddings" in before and not (type(window) is int and window >= 1):
        raise PosEncError(f"{POSENC_CONFIG_NAME}: the field config_before_patch.max_position_embeddings is "
                          f"{window!r}, not a positive integer; the file was edited. Save the model again.")
    if "rope_parameters" in before:
        check_rope_parameters(before["rope_parameters"])
    config = copy.deepcopy(config)
    for name, value in before.items():
        setattr(config, name, copy.deepcopy(value))
    if before.get("rope_parameters") and hasattr(config, "validate_rope"):
        try:
            config.validate_rope()
        except Exception as error:  # transformers' own checks of the parameters (KeyError, ValueError, ...)
            raise PosEncError(f"{POSENC_CONFIG_NAME}: the field config_before_patch.rope_parameters is refused by "
                              f"transformers ({type(error).__name__}: {error}); the file was edited. Save the model "
                              "again with save_pretrained.") from None
    return config


def check_rope_parameters(parameters: Any) -> None:
    """config_before_patch.rope_parameters: None, or a dict (one per layer type, or one for all) whose rope_type
    transformers computes."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if parameters is None:
        return
    field = "config_before_patch.rope_parameters"
    if not isinstance(parameters, dict):
        raise PosEncError(f"{POSENC_CONFIG_NAME}: the field {field} is {parameters!r}, not a dict; the file was "
                          "edited. Save the model again with save_pretrained.")
    nested = parameters and all(isinstance(value, dict) or value is None for value in parameters.values())
    entries = {f"{field}.{key}": value for key, value in parameters.items() if value is not None} if nested \
        else {field: parameters}
    known = ("default", *ROPE_INIT_FUNCTIONS)
    for name, entry in entries.items():
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if not (isinstance(rope_type, str) and rope_type in known):
            raise PosEncError(f"{POSENC_CONFIG_NAME}: the field {name}.rope_type is {rope_type!r}, which "
                              f"transformers does not compute (it knows {', '.join(map(repr, known))}); the file was "
                              "edited. Save the model again with save_pretrained.")


def same_value(recorded: Any, actual: Any) -> bool:
    """Equal and of the same type (in JSON `true` equals 1, but is not a head count)."""
    return type(recorded) is type(actual) and recorded == actual


def check_model_matches(metadata: dict[str, Any], model: nn.Module) -> None:
    info = get_family(model.config).model_info(model)
    recorded = metadata["model"]
    wrong = [f"{fact}: {recorded.get(fact)!r} in {POSENC_CONFIG_NAME}, {getattr(info, fact)!r} in the model"
             for fact in MODEL_FACTS if not same_value(recorded.get(fact), getattr(info, fact))]
    if wrong:
        raise PosEncError(f"{POSENC_CONFIG_NAME} does not match the checkpoint's model ({'; '.join(wrong)}); it "
                          "was written for another model or edited. Refusing to load.")


def planned_method(model: nn.Module, configs: list[PosEncConfig]) -> PositionalMethod:
    """The method the saved patch builds, built on the meta device (shapes, no memory), each config on top of the
    one before as patch_model would build it."""
    family = get_family(model.config)
    method = None
    for config in configs:
        info = method_info(family, model, method)
        with torch.device("meta"):
            method = config_for(config).module_class(config, info)
    return method


def check_before_building(model: nn.Module, metadata: dict[str, Any], configs: list[PosEncConfig],
                          tensors: "CheckpointTensors") -> list[str]:
    """Refuse a checkpoint whose patch history or positional state does not match what its options build, before
    anything is built: a few edited bytes in posenc_config.json (an MLP width, a bucket count) must not make the
    loader allocate gigabytes first. The shapes the options imply are compared with the recorded ones and with
    the safetensors headers. Returns the model's names of the positional weights the weight files lack: as
    transformers does for any weight missing from a checkpoint, they keep the values the patch initialises them
    with, and are reported (a weight of another shape is refused, as transformers refuses it)."""
    method = planned_method(model, configs)
    if method.builds_on() != configs[:-1]:
        needed = [c.method for c in method.builds_on()] or "nothing"
        raise PosEncError(f"{POSENC_CONFIG_NAME}: applied_after lists {[c.method for c in configs[:-1]]}, but "
                          f"{metadata['method']!r} with these options builds on {needed}; the file was edited or "
                          "written by another tool. Refusing to load.")
    # where the family installs the method: `<base model>.posenc` (GPT-2's absolute methods: `<base model>.wpe`)
    family = get_family(model.config)
    base_name = _module_name(model, family.base_model(model))  # "" when the model is the base model
    prefix = f"{base_name}.{family.method_attribute(method)}." if base_name else f"{family.method_attribute(method)}."
    expected = {prefix + key: tuple(value.shape) for key, value in method.state_dict().items()}
    recorded = metadata["positional_state"]
    in_checkpoint = checkpoint_keys(model, recorded, expected)
    if in_checkpoint is None:
        raise PosEncError(
            f"{POSENC_CONFIG_NAME} lists positional weights {sorted(recorded)}, but {metadata['method']!r} with "
            f"these options has {sorted(expected)}. Refusing to load.")
    in_files = tensors.shapes(sorted(in_checkpoint.values())) if expected else {}
    for key, shape in expected.items():
        entry = recorded[in_checkpoint[key]]
        written = tuple(entry.get("shape", ())) if isinstance(entry, dict) else None
        if written != shape or in_files.get(in_checkpoint[key], shape) != shape:
            raise PosEncError(f"Positional weight {key}: {metadata['method']!r} with these options needs shape "
                              f"{shape}; {POSENC_CONFIG_NAME} records {written} and the weights file holds "
                              f"{in_files.get(in_checkpoint[key], 'nothing')}. Refusing to load.")
    return sorted(key for key in expected if in_checkpoint[key] not in in_files)


def checkpoint_keys(model: nn.Module, recorded, model_keys) -> dict[str, str] | None:
    """{the model's key: the checkpoint's key} for the positional weights, or None if they do not correspond. A
    checkpoint saved from a base model (GPT2Model: `posenc.weight`) loads into a model with a head
    (`transformer.posenc.weight`) and the other way round, as transformers loads the other weights."""
    head_prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else None

    def without_head(key: str) -> str:
        return key[len(head_prefix):] if head_prefix and key.startswith(head_prefix) else key

    by_relative = {without_head(key): key for key in recorded}
    relative = {key: without_head(key) for key in model_keys}
    if len(by_relative) != len(recorded) or set(by_relative) != set(relative.values()):
        return None
    return {key: by_relative[relative[key]] for key in model_keys}


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def apply_saved_patch(model: nn.Module, metadata: dict[str, Any], tensors: "CheckpointTensors",
                      publish: Publish | None = None, missing_keys: list[str] | None = None) -> nn.Module:
    """Patch a freshly loaded (unpatched) model as `metadata` says and load the positional state into it. `publish`:
    what the model's save_pretrained uses for standalone=True / push_to_hub=True (see checkpoints/saving.py).
    Positional weights the checkpoint lacks keep their initial values (as patch_model builds them), as transformers
    initialises any missing weight: they are added to `missing_keys` when it is given (from_pretrained's loading
    info), else logged as a warning."""
    configs = method_configs(metadata)
    check_model_matches(metadata, model)
    missing = check_before_building(model, metadata, configs, tensors)
    try:
        for config in configs:
            install_patch(model, config, functools.partial(attach_save_hook, publish=publish))
        method = applied_patch(model).method
        prefix = positional_prefix(model, method) + "."
        in_checkpoint = {key: saved for key, saved in
                         checkpoint_keys(model, metadata["positional_state"],
                                         [prefix + key for key in method.state_dict()]).items()
                         if key not in missing}
        values = tensors.read(sorted(in_checkpoint.values())) if in_checkpoint else {}
        with torch.no_grad():
            result = method.load_state_dict({key[len(prefix):]: values[saved] for key, saved in in_checkpoint.items()},
                                            strict=False)
        if result.unexpected_keys or {prefix + key for key in result.missing_keys} != set(missing):
            raise PosEncError(f"Loading the positional weights went wrong: {result}.")  # cannot happen: checked above
    except BaseException:
        remove_patch(model)
        raise
    if missing and missing_keys is not None:
        missing_keys.extend(key for key in missing if key not in missing_keys)
    elif missing:
        logger.warning("The checkpoint lacks the positional weights %s of its %r patch: they are newly initialised "
                       "(untrained), as transformers initialises any weight missing from a checkpoint.",
                       missing, metadata["method"])
    return model


class CheckpointTensors:
    """Named tensors of a checkpoint's safetensors files (one file or shards), local or on the Hub. `shapes` reads
    only the file headers."""

    def __init__(self, name_or_path, hub_kwargs: dict):
        self.name_or_path = name_or_path
        self.hub_kwargs = hub_kwargs

    def _fetch(self, filename: str):
        from transformers.utils import cached_file

        return cached_file(self.name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                           **self.hub_kwargs)

    def _open_files(self, keys: list[str]):
        """Yield (open safetensors file, the wanted keys it holds)."""
        from safetensors import safe_open

        index = self._fetch("model.safetensors.index.json")
        if index is not None:
            weight_map = json.loads(Path(index).read_text(encoding="utf-8")).get("weight_map", {})
            files = sorted({weight_map[key] for key in keys if key in weight_map})
        else:
            files = ["model.safetensors"]
        for filename in files:
            path = self._fetch(filename)
            if path is None:
                raise PosEncError(f"{self.name_or_path} has no {filename}: hf_posenc checkpoints are saved as "
                                  "safetensors.")
            with safe_open(path, framework="pt") as handle:
                yield handle, set(keys) & set(handle.keys())

    def shapes(self, keys: list[str]) -> dict[str, tuple[int, ...]]:
        return {key: tuple(handle.get_slice(key).get_shape()) for handle, held in self._open_files(keys)
                for key in held}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {key: handle.get_tensor(key) for handle, held in self._open_files(keys) for key in held}


def load_saved_patch(model: nn.Module, name_or_path, metadata: dict[str, Any], hub_kwargs: dict,
                     publish: Publish | None = None, tensors=None, missing_keys: list[str] | None = None) -> nn.Module:
    """`tensors`: where the positional weights are read (default: the checkpoint's safetensors files; an adapter's
    are in adapter_model.safetensors, see checkpoints/adapters.py). `missing_keys`: see apply_saved_patch."""
    return apply_saved_patch(model, metadata, tensors or CheckpointTensors(name_or_path, hub_kwargs), publish,
                             missing_keys)
