"""``hf-posenc eval-ppl``: perplexity versus context length, for several models and positional methods in one run.

    hf-posenc eval-ppl --model smollm2 --method none --method yarn:factor=4 --method alibi \\
        --lengths 256,512,1024 --text-file ../shared/data/wikitext-2-raw-test.txt --max-windows 2
    accelerate launch --num_processes 2 -m hf_posenc eval-ppl ...      # windows split across processes

Protocol (``hf_posenc.tools.perplexity``): at each length L, windows of L tokens start every ``--sliding-window``
tokens (default 256, as jquesnelle/yarn ``eval/perplexity.py``; ``--non-overlapping`` makes the stride L). The
first window of a document scores all its tokens but the first, each later window only the tokens past the
previous one, so every token is scored once. ``--truncate`` keeps the first window of each document only (YaRN's
``--truncate``: the first L tokens). Each book or file is one document (WikiText is one stream), and a
``--dataset`` row is one document; documents with fewer than ``--min-document-tokens`` (default: the longest
length) are skipped, so every length is measured on the same documents. The perplexity reported is
exp(total NLL / tokens scored) over all documents.

Outputs in ``--output-dir``: ``perplexity.csv`` (a row per model/method, a column per length, YaRN's layout),
``perplexity.json`` (every number and the settings) and ``perplexity.png`` (perplexity on a log axis vs length, a
line per model, a star at the length its weights and positions were trained at; none for an untrained swap).

A ``--model`` may be a fine-tune's resumable checkpoint (``OUTPUT-checkpoints/step-N``, ``finetune --save-every``):
its run's model and method with the weights it saved. Given two or more points of a run (its checkpoints, its
output folder), ``training_curve.csv`` and ``training_curve.png`` add perplexity against the tokens trained on (a
line per run and length).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only; torch is imported where it is used, so that --help stays fast
    import torch

from . import tables
from .tables import row_label
from .estimates import announce_run_time, check_memory, estimate_forward_bytes, model_forward_seconds
from ..registry import get_family
from .training_state import IncompleteCheckpoint, read_state
from .models import SMOLLM2, is_training_checkpoint, load_model, model_name
from .outputs import (CHECKPOINTS_SUFFIX, OVERWRITE_HELP, atomic_output_dir, beside, check_output_dir_on_main,
                      write_json)
from .perplexity import perplexity_at_length, window_plan
from .progress import progress as progress_bar
from .runtime import (DTYPES, UNPATCHED, MethodRequest, UsageError, accelerator_if_launched, check_at_least, is_main,
                      process_count, set_threads, settings_from, settings_of, versions)
from .text import DataError, add_text_arguments, check_encoding, documents_of, tokenize_documents

DEFAULT_SLIDING_WINDOW = 256  # jquesnelle/yarn eval/perplexity.py --sliding-window


@dataclass
class LengthResult:
    model: str
    method: str
    length: int
    ppl: float | None
    nll_sum: float
    n_scored_tokens: int
    n_windows: int
    n_documents: int
    stride: int
    seconds: float
    error: str = ""
    label: str = ""  # the row (row_label): what was evaluated


@dataclass
class EvalRun:
    """Every number of one evaluation, plus how it was made."""

    settings: dict[str, Any]
    results: list[LengthResult] = field(default_factory=list)
    training_lengths: dict[str, int | None] = field(default_factory=dict)  # row label -> length trained at
    training_points: tables.TrainingPoints = field(default_factory=dict)  # row label -> step, tokens trained on

    def table(self) -> tables.PerplexityTable:
        out: tables.PerplexityTable = {}
        for r in self.results:
            out.setdefault(r.label or row_label(r.model, r.method), {})[r.length] = r.ppl
        return out

    def extend(self, other: "EvalRun") -> None:
        """Add the rows of another run (of the same lengths and text) to this one."""
        self.results += other.results
        self.training_lengths.update(other.training_lengths)
        self.training_points.update(other.training_points)

    def rename_model(self, old: str, new: str) -> None:
        for r in self.results:
            if r.model == old:
                r.model = new
                if r.label == old:  # the row of the model as loaded (the table's row name)
                    r.label = new
        self.training_lengths = {(new if label == old else label): length
                                 for label, length in self.training_lengths.items()}

    def to_json(self) -> dict:
        return {"settings": self.settings, "training_lengths": self.training_lengths,
                "training_points": self.training_points,
                "table": {label: {str(n): v for n, v in row.items()} for label, row in self.table().items()},
                "results": [asdict(r) for r in self.results]}


def keeps_trained_positions(model, request: MethodRequest) -> bool:
    """Whether the positions the weights were trained with survive the method: the model as loaded, or a RoPE
    scaling of a model that has RoPE. A swap (ALiBi, KERPLE, ... in place of RoPE) was never trained at any length."""
    from hf_posenc import RopeScalingConfig, get_method

    if not request.patches:
        return True
    return (issubclass(get_method(request.name).config_class, RopeScalingConfig)
            and get_family(model.config).native_method == "rope")


def training_length(model, model_dir: str | None = None) -> int | None:
    """The context the weights were trained at: ``max_length`` of a fine-tune (``training_args.json``, or a
    training checkpoint's settings), else the model's original window."""
    if model_dir is not None:
        try:
            if is_training_checkpoint(model_dir):
                return int(read_state(Path(model_dir))["settings"]["max_length"])
            if (Path(model_dir) / "training_args.json").is_file():
                return int(json.loads((Path(model_dir) / "training_args.json").read_text())["max_length"])
        except (KeyError, ValueError, TypeError):
            pass
    return get_family(model.config).trained_window(model)


def training_point(model_spec: str) -> dict[str, Any] | None:
    """Where in its run a fine-tune's folder stands: the step, the tokens trained on by then and the run (its
    checkpoint folder's name less ``-checkpoints``), from a training checkpoint's state or an output folder's
    ``loss_log.json`` (None: not a fine-tune's folder)."""
    path = Path(model_spec).expanduser().resolve()
    try:
        if is_training_checkpoint(model_spec):
            log, checkpoint_dir = read_state(path)["log"], path.parent
        elif (path / "loss_log.json").is_file():
            log = json.loads((path / "loss_log.json").read_text())
            chosen = json.loads((path / "training_args.json").read_text()).get("checkpoint_dir")
            checkpoint_dir = Path(chosen).resolve() if chosen else beside(path, CHECKPOINTS_SUFFIX)
        else:
            return None
        run = checkpoint_dir.name.removesuffix(CHECKPOINTS_SUFFIX) or checkpoint_dir.name
        return {"step": int(log[-1]["step"]), "tokens": int(log[-1]["tokens"]), "run": run,
                "checkpoint_dir": str(checkpoint_dir)} if log else None
    except (OSError, KeyError, ValueError, TypeError, IndexError, IncompleteCheckpoint):
        return None


# --- settings -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc eval-ppl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None,
                   help="local checkpoint, Hub id, .gguf file, or 'smollm2' (the bundled SmolLM2-135M-Instruct, "
                        "de-quantised from Q4_1), or a fine-tune's resumable checkpoint (OUTPUT-checkpoints/step-N); "
                        "repeatable (default: smollm2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's own")
    p.add_argument("--method", action="append", default=None,
                   help="'none' (the model as loaded) or NAME[:KEY=VALUE,...], e.g. yarn:factor=4; repeatable "
                        "(default: none)")
    g = p.add_argument_group("lengths")
    g.add_argument("--lengths", default=None, help="comma-separated context lengths, e.g. 512,1024,2048")
    g.add_argument("--min-length", type=int, default=None)
    g.add_argument("--max-length", type=int, default=None)
    g.add_argument("--length-step", type=int, default=None, help="default: powers of two from min to max")
    g = p.add_argument_group("protocol")
    g.add_argument("--sliding-window", type=int, default=DEFAULT_SLIDING_WINDOW,
                   help="stride between windows (default %(default)s, as jquesnelle/yarn eval/perplexity.py)")
    g.add_argument("--non-overlapping", action="store_true", help="stride = length (each token once, less context)")
    g.add_argument("--truncate", action="store_true", help="only the first window of each document (YaRN --truncate)")
    g.add_argument("--max-windows", type=int, default=None, help="windows per document and length (default: all)")
    g.add_argument("--samples", type=int, default=None, help="documents to use (default: all that are long enough)")
    g.add_argument("--min-document-tokens", type=int, default=None,
                   help="skip shorter documents (default: the longest length)")
    g.add_argument("--batch-size", type=int, default=1, help="windows per forward")
    g.add_argument("--training-length", type=int, default=None,
                   help="where to put the plot's marker (default: training_args.json or the model's window)")
    add_text_arguments(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--output-dir", type=Path, default=Path("runs/eval_ppl"), help="where the results go")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--title", default="", help="plot title")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--no-memory-check", action="store_true", help="skip the memory estimate")
    p.add_argument("--no-progress", action="store_true")
    return p


def settings(**overrides) -> argparse.Namespace:
    """The settings of an evaluation: the command's defaults with ``overrides`` (e.g. ``model=["smollm2"]``,
    ``lengths=[256, 512]``, ``text_file=[path]``), for ``run_eval``."""
    return settings_from(build_parser(), **overrides)


def parse_lengths(lengths: str | list[int] | None, min_length: int | None, max_length: int | None,
                  length_step: int | None) -> list[int]:
    if isinstance(lengths, (list, tuple)):
        out = sorted(set(lengths))
    elif lengths:
        try:
            out = sorted({int(x) for x in lengths.replace(" ", ",").split(",") if x})
        except ValueError:
            raise UsageError(f"--lengths {lengths!r} must be integers separated by commas") from None
    elif min_length and max_length:
        if length_step:
            out = list(range(min_length, max_length + 1, length_step))
        else:  # powers of two from min to max
            out, n = [], min_length
            while n <= max_length:
                out.append(n)
                n *= 2
    else:
        raise UsageError("give --lengths 512,1024,... or --min-length and --max-length (and --length-step)")
    if not out:
        raise UsageError(f"no length from --min-length {min_length} to --max-length {max_length}")
    if out[0] < 2:
        raise UsageError(f"lengths must be at least 2 tokens, got {out}")
    return out


def check_args(args: argparse.Namespace) -> None:
    """Refuse nonsense settings before any model is loaded."""
    check_at_least(args, 1, "batch_size", "sliding_window", "max_windows", "samples", "min_document_tokens",
                   "length_step", "training_length", "threads")
    check_encoding(args.encoding)


def _protocol(args: argparse.Namespace, length: int) -> tuple[int, int | None]:
    """(stride, windows per document) at ``length``."""
    stride = length if (args.non_overlapping or args.truncate) else min(args.sliding_window, length)
    return stride, 1 if args.truncate else args.max_windows


def _protocol_name(args: argparse.Namespace) -> str:
    if args.non_overlapping:
        return "non-overlapping"
    if args.truncate:
        return "truncate (first window of each document)"
    return f"sliding window, stride {args.sliding_window}"


# --- the run --------------------------------------------------------------------------------------------------
def run_eval(args: argparse.Namespace, accelerator=None) -> EvalRun:
    """Everything ``eval-ppl`` computes, from its settings (``settings(...)`` or parsed options); returns the run
    (written by ``run``)."""
    check_args(args)
    lengths = parse_lengths(args.lengths, args.min_length, args.max_length, args.length_step)
    requests = [MethodRequest.parse(m) for m in (args.method or [UNPATCHED])]
    for request in requests:
        request.check()  # unknown methods and options fail before any model is loaded
    min_doc = args.min_document_tokens or max(lengths)
    if min_doc < max(lengths):
        raise UsageError(f"--min-document-tokens {min_doc} is below the longest length {max(lengths)}")
    docs = documents_of(args)
    run = EvalRun(settings={**settings_of(args), "lengths": lengths, "min_document_tokens": min_doc,
                            "num_processes": process_count(accelerator), "protocol": _protocol_name(args),
                            "versions": versions()})
    token_docs = None
    for model_spec in args.model or [SMOLLM2]:
        model, tokenizer = _load(args, model_spec, accelerator)
        if token_docs is None:  # tokenised once, with the first model's tokenizer
            token_docs = _documents_to_score(args, tokenizer, docs, lengths, min_doc)
            if is_main(accelerator):
                seconds = evaluation_seconds(args, model, token_docs, lengths, len(requests)) * len(args.model or [1])
                announce_run_time(seconds / process_count(accelerator), "this evaluation",
                                  "--max-windows N, --truncate or fewer --lengths shorten it")
        if not args.no_memory_check:
            check_memory(estimate_forward_bytes(model, max(lengths), args.batch_size),
                         f"a forward of {args.batch_size} x {max(lengths)} tokens with {model_spec}")
        for request in requests:
            request.check_patchable(model)  # an unpatchable model fails here, before hours of work
        _evaluate_model(args, run, model, model_spec, requests, token_docs, lengths, accelerator)
        del model
    return run


def _load(args: argparse.Namespace, model_spec: str, accelerator):
    import torch

    model, tokenizer = load_model(model_spec, dtype=DTYPES[args.dtype], tokenizer=args.tokenizer,
                                  verbose=_progress(args, accelerator))
    model.to(accelerator.device if accelerator is not None else torch.device("cpu"))
    return model, tokenizer


def _progress(args: argparse.Namespace, accelerator) -> bool:
    return not args.no_progress and is_main(accelerator)


def evaluation_seconds(args: argparse.Namespace, model, token_docs: list, lengths: list[int], n_methods: int) -> float:
    """Estimated run time of every method on one model at every length (one process)."""
    doc_lengths = [ids.numel() for ids in token_docs]
    windows = {n: len(window_plan(doc_lengths, n, *_protocol(args, n))) for n in lengths}
    return n_methods * sum(count * model_forward_seconds(model, n) for n, count in windows.items())


def _token_budget(args: argparse.Namespace, lengths: list[int]) -> int | None:
    """Tokens of each document that the windows can reach (None: all)."""
    if args.truncate:
        return max(lengths)
    return None if args.max_windows is None else max(lengths) * args.max_windows


def _documents_to_score(args: argparse.Namespace, tokenizer, docs, lengths: list[int],
                        min_doc: int) -> list[torch.LongTensor]:
    """The documents of at least ``min_doc`` tokens (``--min-document-tokens``: measured on the whole document),
    each cut to the tokens the windows can reach (``--max-windows``, ``--truncate``)."""
    budget = _token_budget(args, lengths)
    all_docs = tokenize_documents(tokenizer, docs, None if budget is None else max(budget, min_doc))
    return [ids[:budget] for ids in _long_enough(args, all_docs, lengths, min_doc)]


def _long_enough(args: argparse.Namespace, all_docs: list[torch.LongTensor], lengths: list[int],
                 min_doc: int) -> list[torch.LongTensor]:
    token_docs = [ids for ids in all_docs if ids.numel() >= min_doc][: args.samples]
    if not token_docs:
        longest = max((ids.numel() for ids in all_docs), default=0)
        raise DataError(f"perplexity at length {max(lengths)} needs a document of at least {min_doc} tokens; "
                        f"the longest of {len(all_docs)} document(s) has {longest} tokens")
    return token_docs


def _evaluate_model(args: argparse.Namespace, run: EvalRun, model, model_spec: str, requests: list[MethodRequest],
                    token_docs: list[torch.LongTensor], lengths: list[int], accelerator) -> None:
    """Every method on one model, at every length."""
    from hf_posenc import get_posenc_config

    loaded_patched = get_posenc_config(model) is not None
    name = model_name(model_spec)
    for j, request in enumerate(requests):
        if j and loaded_patched:  # a patched checkpoint: start again from it rather than stack patches
            model, _ = _load(args, model_spec, accelerator)
        saved = get_posenc_config(model)
        replaced = saved.method if saved is not None and request.patches else None
        if replaced and is_main(accelerator):
            print(f"note: --method {request.label} replaces {name}'s own {replaced} patch (its trained positional "
                  "weights are not used); the row says so", flush=True)
        with warnings.catch_warnings():  # the note above says it for the command line
            warnings.filterwarnings("ignore", message="patch_model replaces")
            request.apply(model)
        label = row_label(name, request.label, replaced)
        trained = keeps_trained_positions(model, request) and not replaced
        point = training_point(model_spec) if not request.patches else None
        if point is not None:
            run.training_points[label] = point
        run.training_lengths[label] = (args.training_length or training_length(
            model, model_spec if Path(model_spec).is_dir() else None)) if trained else None
        bar = progress_bar(total=_windows_of_this_process(args, token_docs, lengths, accelerator), desc=label,
                           unit="win", enabled=_progress(args, accelerator))  # one bar for every length
        for length in lengths:
            stride, max_windows = _protocol(args, length)
            started = time.perf_counter()
            ppl, nll, n_scored, n_windows = perplexity_at_length(
                model, token_docs, length, stride, max_windows, args.batch_size, accelerator, bar=bar)
            result = LengthResult(name, request.label, length, ppl, nll, n_scored, n_windows, len(token_docs),
                                  stride, time.perf_counter() - started, label=label)
            run.results.append(result)
            if is_main(accelerator):
                bar.write(f"  {label:<40} {length:>6} tokens: ppl {ppl:.3f} ({n_windows} windows, "
                          f"{result.seconds:.1f} s)")
        bar.close()
        if not loaded_patched:
            request.remove(model)


def _windows_of_this_process(args: argparse.Namespace, token_docs: list, lengths: list[int], accelerator) -> int:
    """The windows this process scores at every length (round robin, as ``perplexity_at_length`` splits them)."""
    doc_lengths = [ids.numel() for ids in token_docs]
    rank = accelerator.process_index if accelerator is not None else 0
    return sum(len(range(rank, len(window_plan(doc_lengths, n, *_protocol(args, n))), process_count(accelerator)))
               for n in lengths)


def write_outputs(directory: Path, run: EvalRun, lengths: list[int], title: str = "") -> None:
    tables.write_perplexity_csv(directory / "perplexity.csv", lengths, {None: run.table()})
    write_json(directory / "perplexity.json", run.to_json())
    tables.plot_perplexity(directory / "perplexity.png", lengths,
                               {title or "perplexity vs context length": (run.table(), run.training_lengths)})
    if tables.has_training_curve(run.training_points):  # points of a run (its checkpoints, its end)
        tables.write_training_curve_csv(directory / "training_curve.csv", lengths, run.table(), run.training_points)
        tables.plot_training_curve(directory / "training_curve.png", lengths, run.table(), run.training_points,
                                   title)


def run(args: argparse.Namespace) -> None:
    """The command: evaluate, write ``--output-dir`` (from the main process), print the table."""
    set_threads(args.threads)
    check_args(args)
    accelerator = accelerator_if_launched()
    main_process = is_main(accelerator)
    check_output_dir_on_main(accelerator, args.output_dir, "eval-ppl", args.overwrite)
    with atomic_output_dir(args.output_dir, "eval-ppl", args.overwrite, enabled=main_process) as out:
        result = run_eval(args, accelerator)
        if main_process:
            lengths = result.settings["lengths"]
            write_outputs(out, result, lengths, args.title)
            print()
            print(tables.perplexity_markdown(result.table(), lengths))
    if main_process:
        curve = ", training_curve.csv, training_curve.png" if tables.has_training_curve(result.training_points) \
            else ""
        print(f"wrote {args.output_dir}/perplexity.csv, perplexity.json, perplexity.png{curve}")
