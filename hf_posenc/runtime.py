"""Shared plumbing of the fine-tuning and evaluation front-ends: loading a model from a path, Hub id, GGUF file
or the bundled SmolLM2; parsing method specs; memory estimates; writing an output folder atomically."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

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
        from .registry import get_method

        get_method(self.name).config_class.from_options(**self.options)

    def apply(self, model) -> None:
        if self.name != UNPATCHED:
            from .patching import patch_model

            patch_model(model, self.name, **self.options)


# --- models -----------------------------------------------------------------------------------------------
def load_model(spec: str, dtype: torch.dtype = torch.float32, tokenizer: str | None = None, verbose: bool = True):
    """``(model, tokenizer)`` for a local directory, a Hub id, a ``.gguf`` file, or ``smollm2`` (the bundled
    SmolLM2-135M-Instruct). A directory with ``posenc_config.json`` comes back with its patch applied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.lower() == SMOLLM2:
        from .smollm2 import load_smollm2

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
        try:
            from .checkpoint import from_pretrained
        except ImportError:  # pragma: no cover - the checkpoint module ships with the library
            from_pretrained = AutoModelForCausalLM.from_pretrained
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
    from .patching import get_posenc_config, patch_model, unpatch_model

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
@contextlib.contextmanager
def atomic_output_dir(output_dir: str | os.PathLike, overwrite: bool = True, enabled: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside ``output_dir``; on success it replaces ``output_dir``, on failure it is
    removed, so the output folder never holds a half-written run. ``enabled=False`` (non-main processes) yields
    the temporary path of nothing and writes nowhere."""
    final = Path(output_dir).expanduser()
    if not enabled:
        yield final
        return
    if final.exists() and not overwrite:
        raise UsageError(f"--output-dir {final} exists; pass --overwrite to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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


def versions() -> dict[str, str]:
    import accelerate
    import transformers

    from .version import __version__

    return {"hf_posenc": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}
