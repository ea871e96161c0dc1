"""Shared plumbing of the fine-tuning and evaluation front-ends: loading a model from a path, Hub id, GGUF file
or the bundled SmolLM2; parsing method specs; memory estimates; writing an output folder atomically."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


SMOLLM2 = "smollm2"
UNPATCHED = "none"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class UsageError(ValueError):
    """A bad command-line request (bad option value, missing file, not enough text or memory)."""


# --- method specs -----------------------------------------------------------------------------------------
def parse_value(text: str) -> Any:
    """JSON when it parses ('4' -> 4, '[1,2]' -> list, 'true' -> True), Python's True/False/None, else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return {"True": True, "False": False, "None": None}.get(text, text)


def parse_options(items: list[str] | None) -> dict[str, Any]:
    """['factor=4', 'beta_fast=32'] -> {'factor': 4, 'beta_fast': 32}."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"method option {item!r} must look like KEY=VALUE (e.g. factor=4)")
        options[key] = parse_value(value.strip())
    return options


@dataclass
class MethodSpec:
    """A method name with its options; ``none`` = the model as loaded."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or self.name + (
            ":" + ",".join(f"{k}={json.dumps(v)}" for k, v in self.options.items()) if self.options else "")

    @classmethod
    def parse(cls, spec: str) -> "MethodSpec":
        """'yarn:factor=4,beta_fast=32' (values as JSON; a list value may contain commas)."""
        name, _, rest = spec.strip().partition(":")
        items = re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)", rest) if rest.strip() else []
        return cls(name.strip().lower(), parse_options(items), label=spec.strip())

    def check(self) -> None:
        """Fail early (before loading any model) on an unknown method or option."""
        if self.name == UNPATCHED:
            if self.options:
                raise UsageError(f"method '{UNPATCHED}' takes no options, got {self.options}")
            return
        from hf_posenc import get_method

        get_method(self.name).config_class.from_options(**self.options)

    def apply(self, model) -> None:
        if self.name != UNPATCHED:
            from hf_posenc import patch_model

            patch_model(model, self.name, **self.options)


# --- models -----------------------------------------------------------------------------------------------
def load_model(spec: str, dtype: torch.dtype = torch.float32, tokenizer: str | None = None, verbose: bool = True):
    """``(model, tokenizer)`` for a local directory, a Hub id, a ``.gguf`` file, or ``smollm2`` (the bundled
    SmolLM2-135M-Instruct). A directory with ``posenc_config.json`` comes back with its patch applied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.lower() == SMOLLM2:
        from .models import load_smollm2

        model, tok = load_smollm2(dtype=dtype, verbose=verbose)
    elif spec.lower().endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UsageError(f"--model {spec!r}: GGUF file not found")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        model.hf_quantizer = None  # the weights are plain tensors once de-quantised (see hf_posenc.smollm2)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        path = Path(spec).expanduser()
        if not path.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
            raise UsageError(f"--model {spec!r}: no such directory (and not a Hub id)")
        if path.exists() and not (path / "config.json").is_file():
            raise UsageError(f"--model {spec!r}: {path} has no config.json (not a transformers checkpoint)")
        from hf_posenc import from_pretrained

        try:
            model = from_pretrained(str(path) if path.exists() else spec, dtype=dtype)
        except OSError as exc:
            raise UsageError(f"--model {spec!r} could not be loaded: {exc}") from None
        tok = None
    if tok is None or tokenizer:
        source = tokenizer or spec
        try:
            tok = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise UsageError(f"no tokenizer found for {source!r} ({type(exc).__name__}); pass --tokenizer") from None
    model.eval()
    return model, tok


def check_patchable(model, spec: MethodSpec) -> None:
    """Patch and unpatch once, so an unpatchable model fails before any long work (or output) starts."""
    if spec.name == UNPATCHED:
        return
    from hf_posenc import get_posenc_config, patch_model, unpatch_model

    if get_posenc_config(model) is not None:
        return  # a loaded patched checkpoint: patch_model would replace its patch, which is the user's call
    patch_model(model, spec.name, **spec.options)
    unpatch_model(model)


# --- memory -----------------------------------------------------------------------------------------------
def available_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with contextlib.suppress(OSError, ValueError):
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 1 << 62


def _shape(model) -> tuple[int, int, int, int]:
    c = model.config
    get = lambda *names, default=0: next((getattr(c, n) for n in names if getattr(c, n, None)), default)  # noqa: E731
    return (int(get("hidden_size", "n_embd", default=512)), int(get("num_hidden_layers", "n_layer", default=12)),
            int(get("num_attention_heads", "n_head", default=8)), int(get("vocab_size", default=32000)))


def estimate_forward_bytes(model, length: int, batch: int = 1) -> int:
    """Rough, deliberately high peak memory of a no-grad forward at ``length`` tokens: weights, the fp32 logits,
    a layer's activations and an fp32 attention block of [heads, 2048, length]. For SmolLM2-135M it says 4.2 GB
    at 8k and 7.8 GB at 16k tokens, where 2.5 and 7.5 GB were measured (DESIGN.md)."""
    hidden, _layers, heads, vocab = _shape(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = 4 * (vocab * 1.1 + hidden * 24)
    attention = 4 * heads * min(length, 2048) * length
    return int(1.25 * (params + batch * (length * per_token + attention)))


def estimate_training_bytes(model, length: int, batch: int, trainable: int, checkpointing: bool) -> int:
    """Rough peak memory of one training micro-step: weights, gradients and AdamW state of the trainable
    parameters, activations kept for backward (all layers, or one with gradient checkpointing), fp32 logits."""
    hidden, layers, heads, vocab = _shape(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    kept_layers = 1 if checkpointing else layers
    per_token = 4 * (vocab * 3 + hidden * 34 * kept_layers + (hidden * 2 * layers if checkpointing else 0))
    attention = 4 * heads * length * length * kept_layers
    return int(1.25 * (params + 12 * trainable + batch * (length * per_token + attention)))


def check_memory(needed: int, what: str, available: int | None = None) -> None:
    available = available_memory_bytes() if available is None else available
    if needed > 0.9 * available:
        raise UsageError(f"{what} needs about {needed / 2**30:.1f} GiB of memory by estimate, and "
                         f"{available / 2**30:.1f} GiB is available; use a shorter length or a smaller batch "
                         "(or --no-memory-check to try anyway)")


# --- output -----------------------------------------------------------------------------------------------
MANIFEST = "hf_posenc_output.json"  # marks a folder as our output and lists what we wrote there
_STAGING = ".hf_posenc-staging-"
_REPLACED = ".hf_posenc-replaced-"
OVERWRITE_HELP = ("write into an --output-dir that holds other files (not an earlier output of this command): "
                  "same-named files are replaced, nothing else in it is removed")


def output_path(path: str | os.PathLike) -> Path:
    """``path`` absolute and normalised ('.' is the current folder, '~' expanded); symbolic links are kept."""
    return Path(os.path.abspath(os.path.expanduser(path)))


def read_manifest(folder: Path) -> dict | None:
    """The manifest an earlier run of ours left in ``folder`` ({"command": ..., "entries": [...], ...}), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(manifest, dict) and manifest.get("written_by") == "hf_posenc"
            and isinstance(manifest.get("entries"), list)):
        return None
    # Plain names only: an edited manifest must never make us remove anything outside the folder.
    manifest["entries"] = [name for name in manifest["entries"] if isinstance(name, str)
                           and name not in ("", ".", "..", MANIFEST) and "/" not in name and os.sep not in name]
    return manifest


def our_entries(folder: Path, command: str) -> list[str] | None:
    """The entries an earlier run of ``command`` wrote in ``folder``, or None when it holds no output of it."""
    manifest = read_manifest(folder)
    return manifest["entries"] if manifest is not None and manifest.get("command") == command else None


def check_output_dir(output_dir: str | os.PathLike, command: str, overwrite: bool = False) -> None:
    """Refuse, before any work, an ``--output-dir`` that is a file, or a folder that holds files and is not an
    earlier output of ``command`` (unless ``overwrite``). Evaluating a fine-tuned model into its own folder, for
    example, is refused: the evaluation would otherwise be mixed into the model's folder."""
    folder = output_path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output-dir {folder} is a file, not a folder; choose another --output-dir")
    if overwrite or not folder.is_dir() or our_entries(folder, command) is not None:
        return
    foreign = sorted(p.name for p in folder.iterdir() if not p.name.startswith(_STAGING))
    if not foreign:
        return
    manifest = read_manifest(folder)
    listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    holds = (f"the output of hf-posenc {manifest.get('command')}" if manifest is not None
             else f"files that hf-posenc {command} did not write ({listed})")
    raise UsageError(f"--output-dir {folder} holds {holds}; choose a new or empty folder, or pass --overwrite to write "
                     "into it (same-named files are replaced, nothing else is removed)")


def check_output_dir_on_main(accelerator, output_dir: str | os.PathLike, command: str,
                             overwrite: bool = False) -> None:
    """``check_output_dir`` decided by the main process (the one that writes) and raised on every process, so
    that all of them stop together instead of the others waiting for a main process that has gone."""
    refusal = None
    if accelerator is None or accelerator.is_main_process:
        try:
            check_output_dir(output_dir, command, overwrite)
        except (UsageError, OSError) as error:  # OSError: e.g. a folder we may not read
            refusal = str(error)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        refusal = broadcast_object_list([refusal])[0]
    if refusal:
        raise UsageError(refusal)


@contextlib.contextmanager
def atomic_output_dir(output_dir: str | os.PathLike, command: str, overwrite: bool = False, enabled: bool = True,
                      checked: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder to write a run of ``command`` into. On success its entries move into
    ``output_dir`` and are listed in the folder's manifest (``hf_posenc_output.json``); they replace the entries
    that the previous run of the same command listed there, and nothing else in the folder is touched (other runs,
    a --checkpoint-dir inside it, the user's files). On failure the staging folder is removed and ``output_dir``
    stays as it was, so it never holds a half-written run. A folder that is not empty and not an output of
    ``command`` is refused unless ``overwrite`` (``checked``: the caller ran ``check_output_dir`` before a run that
    may have put its own things there since, such as checkpoints). ``enabled=False`` (the processes other than the
    main one) writes nowhere and yields ``output_dir``."""
    final = output_path(output_dir)
    if not enabled:
        yield final
        return
    if not checked:
        check_output_dir(final, command, overwrite)
    if final.is_dir():  # staged inside it: the same file system, so entries move by rename
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=final))
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    staging.chmod(0o755)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        _move_into_place(staging, final, command, overwrite)
    except OSError as error:
        raise UsageError(f"could not move the run into --output-dir {final} ({error}); its files are in "
                         f"{staging}") from None


def _move_into_place(staging: Path, final: Path, command: str, overwrite: bool) -> None:
    entries = sorted(p.name for p in staging.iterdir())
    if not final.exists():  # the usual first run: one rename publishes the whole folder
        _write_manifest(staging, command, entries)
        os.replace(staging, final)
        return
    previous = our_entries(final, command) or []
    clashes = [name for name in entries if os.path.lexists(final / name) and name not in previous]
    if clashes and not overwrite:
        raise UsageError(f"--output-dir {final}: {', '.join(clashes[:3])} appeared there during the run and was not "
                         f"written by it; the run's files are in {staging} (move them, or run with --overwrite)")
    # Listed first: whatever an interruption leaves, every entry of ours stays listed and the folder stays ours.
    _write_manifest(final, command, sorted(set(previous) | set(entries)))
    replaced = Path(tempfile.mkdtemp(prefix=_REPLACED, dir=final))
    for name in set(previous) | set(entries):
        if os.path.lexists(final / name):
            os.replace(final / name, replaced / name)
    for name in entries:
        os.replace(staging / name, final / name)
    _write_manifest(final, command, entries)
    shutil.rmtree(replaced, ignore_errors=True)
    staging.rmdir()


def _write_manifest(folder: Path, command: str, entries: list[str]) -> None:
    from hf_posenc import __version__

    manifest = {"written_by": "hf_posenc", "command": command, "version": __version__,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "entries": entries}
    partial = folder / f".{MANIFEST}.partial"
    write_json(partial, manifest)
    os.replace(partial, folder / MANIFEST)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n", encoding="utf-8")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return repr(obj)


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run_command(body: Callable[[], int | None]) -> int:
    """Run a command's ``body`` and return its exit code (None: 0). Bad input ends as one line ``error: ...`` on
    stderr and exit code 2 instead of a traceback: our own refusals, a file that is missing, unreadable or not what
    was expected, a missing optional package. Every command's ``main`` goes through here."""
    from hf_posenc import PosEncError
    from .text import DataError

    try:
        return body() or 0
    except (UsageError, DataError, PosEncError, OSError, ModuleNotFoundError) as error:
        if isinstance(error, OSError) and error.strerror and error.filename:  # "[Errno 13] ..." -> what and where
            return fail(f"{error.strerror}: {error.filename}")
        return fail(str(error))


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's intra-op threads of this process (unset: torch's own choice)."""
    check_number("--threads", threads, 1)
    if threads:
        torch.set_num_threads(threads)


def check_number(option: str, value: float | None, minimum: float, *, above: bool = False,
                 maximum: float | None = None, hint: str = "") -> None:
    """Refuse (UsageError) an option value that is not a finite number at least ``minimum`` (strictly above it when
    ``above``; at most ``maximum`` when given). ``None`` means the option was left unset."""
    if value is None:
        return
    too_low = value <= minimum if above else value < minimum
    if math.isfinite(value) and not too_low and (maximum is None or value <= maximum):
        return
    bound = f"{'>' if above else '>='} {_show(minimum)}" + (f" and <= {_show(maximum)}" if maximum is not None else "")
    kind = "an integer" if isinstance(value, int) else "a finite number"
    raise UsageError(f"{option} must be {kind} {bound}, got {_show(value)}" + (f"; {hint}" if hint else ""))


def _show(number: float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


def versions() -> dict[str, str]:
    import accelerate
    import transformers

    from hf_posenc import __version__

    return {"hf_posenc": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}
