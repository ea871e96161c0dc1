"""What every subcommand shares: the one error type of bad requests and the one place that turns it into an exit
code, option checks, the method asked for on the command line, and processes started by ``accelerate launch``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable

UNPATCHED = "none"  # the method name that means "the model as loaded"


class TorchDtypes(Mapping):
    """``--dtype`` names -> torch dtypes. torch is imported on the first look-up, not when a command builds its
    options (``--help`` stays fast)."""

    NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
             "float16": "float16", "fp16": "float16"}

    def __getitem__(self, name: str):
        import torch

        return getattr(torch, self.NAMES[name])

    def __iter__(self):
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)


DTYPES = TorchDtypes()


class UsageError(ValueError):
    """A bad command-line request (bad option value, missing file, not enough text or memory): the message says
    what is wrong and what to do instead."""


def run_command(body: Callable[[], int | None]) -> int:
    """Run a command's ``body`` and return its exit code (None: 0). Bad input ends as one line ``error: ...`` on
    stderr and exit code 2 instead of a traceback: our own refusals, a file that is missing, unreadable or not what
    was expected, a missing optional package. Every subcommand runs through here (``hf_posenc.tools.cli``)."""
    from hf_posenc import PosEncError

    try:
        return body() or 0
    except (UsageError, PosEncError, OSError, ModuleNotFoundError) as error:
        if isinstance(error, OSError) and error.strerror and error.filename:  # "[Errno 13] ..." -> what and where
            return fail(f"{error.strerror}: {error.filename}")
        return fail(str(error))


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


# --- option values --------------------------------------------------------------------------------------------
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


def check_at_least(args, minimum: int, *names: str) -> None:
    """``check_number`` for several options of ``args`` at once (attribute names, e.g. "max_steps")."""
    for name in names:
        check_number(flag(name), getattr(args, name), minimum)


def flag(name: str) -> str:
    """The option of an ``args`` attribute: "max_steps" -> "--max-steps"."""
    return "--" + name.replace("_", "-")


def _show(number: float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


def parse_numbers(text: str, option: str, kind: type = float) -> list:
    """'256,512' -> [256, 512] (sorted, without duplicates), refusing anything else with a message naming
    ``option``."""
    try:
        return sorted({kind(x) for x in text.replace(" ", ",").split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"{option} {text!r} must be {'whole ' if kind is int else ''}numbers separated by "
                         "commas") from None


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's intra-op threads of this process (unset: torch's own choice)."""
    check_number("--threads", threads, 1)
    if threads:
        import torch

        torch.set_num_threads(threads)


def versions() -> dict[str, str]:
    import accelerate
    import torch
    import transformers

    from hf_posenc import __version__

    return {"hf_posenc": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that shows each option's default in --help, except where there is none to show (None,
    a flag's False) or the help already says it in its own words."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def settings_from(parser, **overrides):
    """The settings of a run as its command line would give them: ``parser``'s defaults with ``overrides`` (keyword
    names as the options', '-' -> '_'), for calling a command's run function from code."""
    args = parser.parse_args([])
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise TypeError(f"{parser.prog} has no setting {', '.join(unknown)}")
    vars(args).update(overrides)
    return args


def settings_of(args) -> dict[str, Any]:
    """The parsed options as JSON-ready values (paths as strings), for the settings a run writes down."""
    return {key: (str(value) if isinstance(value, os.PathLike) else value) for key, value in vars(args).items()}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --tokenizer and --method, as the evaluation commands take them."""
    parser.add_argument("--model", action="append", default=None, help="as eval-ppl; repeatable (default: smollm2)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's own")
    parser.add_argument("--method", action="append", default=None,
                        help="'none' or NAME[:KEY=VALUE,...]; repeatable")


# --- the method asked for -------------------------------------------------------------------------------------
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
class MethodRequest:
    """A positional method asked for on the command line, with its options; ``none`` = the model as loaded. Parts
    joined by ``+`` make a hybrid of several methods, each with its ``layers=`` (engine/hybrid.py):
    ``kerple:layers=every:2+yarn:factor=2,layers=rest``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    parts: list["MethodRequest"] = field(default_factory=list)  # a hybrid's parts, in the order they are patched

    def __post_init__(self) -> None:
        self.label = self.label or self.name + (
            ":" + ",".join(f"{k}={json.dumps(v)}" for k, v in self.options.items()) if self.options else "")

    @classmethod
    def parse(cls, text: str) -> "MethodRequest":
        """'yarn:factor=4,beta_fast=32' (values as JSON; a list value may contain commas); parts of a hybrid joined
        by '+', each with layers=."""
        pieces = re.split(r"\+(?=\s*[A-Za-z][A-Za-z0-9_-]*\s*(?::|$))", text.strip())
        if len(pieces) > 1:
            parts = [cls.parse(piece) for piece in pieces]
            for part in parts:
                if part.layers is None or not part.patches:
                    raise UsageError(f"{part.label!r} in {text.strip()!r}: each part of a hybrid joined by '+' is a "
                                     "method with layers= (e.g. 'kerple:layers=every:2+yarn:factor=2,layers=rest')")
            return cls("hybrid", label=text.strip(), parts=parts)
        name, _, rest = text.strip().partition(":")
        items = re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)", rest) if rest.strip() else []
        return cls(name.strip().lower(), parse_options(items), label=text.strip())

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> "MethodRequest":
        """The request whose ``settings()`` these are (as a run records them: a method's every option, or a hybrid's
        parts)."""
        options = {key: value for key, value in settings.items() if key != "method"}
        if settings.get("method") == "hybrid" and "parts" in options:
            parts = [cls.from_settings(part) for part in options["parts"]]
            return cls("hybrid", label="+".join(part.label for part in parts), parts=parts)
        return cls(str(settings.get("method")), options)

    @property
    def patches(self) -> bool:
        return self.name != UNPATCHED

    @property
    def layers(self):
        """The `layers=` of a hybrid patch (`nope:layers="every:4"`; engine/hybrid.py), or None: every layer."""
        return self.options.get("layers")

    @property
    def method_options(self) -> dict[str, Any]:
        return {key: value for key, value in self.options.items() if key != "layers"}

    def settings(self) -> dict[str, Any]:
        """Every option of the method (defaults included) and its layers, as JSON-able data."""
        if self.parts:
            return {"method": self.name, "parts": [part.settings() for part in self.parts]}
        return {**self.config().to_dict(), **({"layers": self.layers} if self.layers is not None else {})}

    def check(self) -> None:
        """Fail early (before loading any model) on an unknown method or option."""
        if not self.patches:
            if self.options:
                raise UsageError(f"method '{UNPATCHED}' takes no options, got {self.options}")
            return
        for part in self.parts or [self]:
            part.config()

    def config(self):
        """The method's validated config (refusing unknown methods and options); only for one method that patches
        (parts joined by '+' are checked part by part: their hybrid's layers depend on the model)."""
        from hf_posenc import get_method

        config = get_method(self.name).config_class.from_options(**self.method_options)
        if self.layers is not None:
            from hf_posenc.engine.hybrid import refuse_per_layer

            refuse_per_layer(config)
        return config

    def check_patchable(self, model) -> None:
        """Patch and unpatch once, so an unpatchable model fails before any long work (or output) starts."""
        from hf_posenc import get_posenc_config, unpatch_model

        if not self.patches or get_posenc_config(model) is not None:
            return  # a loaded patched checkpoint: patch_model would replace its patch, which is the user's call
        try:
            self.apply(model)
        finally:
            unpatch_model(model)

    def apply(self, model) -> None:
        if not self.patches:
            return
        from hf_posenc import patch_model, unpatch_model

        if not self.parts:
            patch_model(model, self.name, layers=self.layers, **self.method_options)
            return
        for index, part in enumerate(self.parts):
            try:
                patch_model(model, part.name, layers=part.layers, **part.method_options)
            except Exception:
                if index:  # the earlier parts are this request's own: remove them with the rest
                    unpatch_model(model)
                raise

    def remove(self, model) -> None:
        if self.patches:
            from hf_posenc import unpatch_model

            unpatch_model(model)


def each_method(model, requests: list[MethodRequest], reload: Callable[[], Any]):
    """Yield ``(request, model, replaced)`` for each request, the request applied to the model and removed after the
    caller's step. On a patched checkpoint (``replaced``: the method of its own patch, which a patching request
    replaces, else "") every request after the first runs on a fresh copy from ``reload()``, so that ``none`` still
    means the checkpoint as trained; the replacement warning is left to the row label, which says it."""
    import warnings

    from hf_posenc import get_posenc_config

    saved = get_posenc_config(model)
    for j, request in enumerate(requests):
        if j and saved is not None:
            model = reload()
        replaced = saved.method if saved is not None and request.patches else ""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="patch_model replaces")
            request.apply(model)
        yield request, model, replaced
        if saved is None:
            request.remove(model)


# --- several processes ----------------------------------------------------------------------------------------
def uncompiled(model):
    """The module a torch.compile wrapper holds (accelerate's ``--dynamo_backend`` wraps the prepared model in one),
    else the model itself. Read from ``_modules``: the wrapper forwards unknown attributes to the module it holds, so
    getattr cannot tell the two apart."""
    return model.__dict__.get("_modules", {}).get("_orig_mod", model)


def launched_by_accelerate() -> bool:
    """Whether this process was started by ``accelerate launch`` (or torchrun) with several processes."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ


def accelerator_if_launched():
    """An ``accelerate.Accelerator`` when ``accelerate launch`` started this process, else None (one process)."""
    if not launched_by_accelerate():
        return None
    import torch
    from accelerate import Accelerator

    return Accelerator(cpu=not torch.cuda.is_available())


def is_main(accelerator) -> bool:
    return accelerator is None or accelerator.is_main_process


def process_count(accelerator) -> int:
    return 1 if accelerator is None else accelerator.num_processes


def gather_in_order(local: list[tuple[int, Any]], accelerator) -> list[Any]:
    """``(index, item)`` pairs from every process, as one list of the items in index order (the same on every
    process and for any process count)."""
    if process_count(accelerator) > 1:
        from accelerate.utils import gather_object

        local = gather_object(local)
    return [item for _, item in sorted(local, key=lambda pair: pair[0])]


def greedy_answers(model, tokenizer, count: int, prompt_of: Callable[[int], list[int]],
                   score: Callable[[int, Any, str], Any], max_new_tokens: int, accelerator=None, desc: str = "",
                   progress: bool = True) -> list[Any]:
    """The loop that passkey and niah share: this process's round-robin share of the prompts ``0..count-1``, each
    ``prompt_of(i)`` (token ids) answered by greedy decoding of ``max_new_tokens`` tokens and turned into a result by
    ``score(i, ids, answer)`` (``ids``: the prompt, [1, L] on the model's device; ``answer``: the decoded text); the
    results of every process in index order (``gather_in_order``)."""
    import torch
    from .progress import progress as progress_bar

    rank = accelerator.process_index if accelerator is not None else 0
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    local = []
    with torch.inference_mode():
        mine = range(rank, count, process_count(accelerator))
        for i in progress_bar(mine, desc=desc, unit="prompt", enabled=progress and rank == 0):
            ids = torch.tensor([prompt_of(i)], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            local.append((i, score(i, ids, answer)))
    return gather_in_order(local, accelerator)
