"""Perplexity versus context length, for several models and positional methods in one run.

    hf-posenc eval-ppl --model smollm2 --method none --method yarn:factor=4 --method alibi \\
        --lengths 256,512,1024 --text-file ../shared/data/wikitext-2-raw-test.txt --max-windows 2
    accelerate launch --num_processes 2 scripts/eval_ppl.py ...      # windows split across processes

Protocol (``hf_posenc.perplexity``): at each length L, windows of L tokens start every ``--sliding-window``
tokens (default 256, as jquesnelle/yarn ``eval/perplexity.py``; ``--non-overlapping`` makes the stride L). The
first window of a document scores all its tokens but the first, each later window only the tokens past the
previous one, so every token is scored once. ``--truncate`` keeps the first window of each document only (YaRN's
``--truncate``: the first L tokens). Each book or file is one document (WikiText is one stream), and a
``--dataset`` row is one document; documents with fewer than ``--min-document-tokens`` (default: the longest
length) are skipped, so every length is measured on the same documents. The perplexity reported is
exp(total NLL / tokens scored) over all documents.

Outputs in ``--output-dir``: ``perplexity.csv`` (a row per model/method, a column per length, YaRN's layout),
``perplexity.json`` (every number and the settings) and ``perplexity.png`` (log perplexity vs length, a line per
model, a star at the length it was trained at).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .data import DataError, load_documents, tokenize_documents
from .perplexity import _CHUNK, _forward_kwargs, _window_nll, window_starts
from .runtime import (DTYPES, OVERWRITE_HELP, UNPATCHED, MethodSpec, UsageError, atomic_output_dir, check_memory,
                      check_number, check_output_dir_on_main, check_patchable, estimate_forward_bytes, load_model,
                      run_command, set_threads, versions, write_json)
from .text import DEFAULT_ENCODING, check_encoding

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


@dataclass
class EvalRun:
    """Every number of one evaluation, plus how it was made."""

    settings: dict[str, Any]
    results: list[LengthResult] = field(default_factory=list)
    training_lengths: dict[str, int | None] = field(default_factory=dict)

    def labels(self) -> list[str]:
        seen: list[str] = []
        for r in self.results:
            key = row_label(r.model, r.method)
            if key not in seen:
                seen.append(key)
        return seen

    def table(self) -> dict[str, dict[int, float | None]]:
        out: dict[str, dict[int, float | None]] = {}
        for r in self.results:
            out.setdefault(row_label(r.model, r.method), {})[r.length] = r.ppl
        return out


def row_label(model: str, method: str) -> str:
    return model if method == UNPATCHED else f"{model} + {method}"


# --- the measurement ---------------------------------------------------------------------------------------
def _batched_nll(model, windows: torch.LongTensor, n_scored: list[int]) -> list[float]:
    """Summed NLL of the last ``n_scored[b]`` tokens of each window ``b`` of a [B, L] batch (one forward)."""
    length = windows.shape[1]
    n_keep = max(n_scored) + 1
    logits = model(input_ids=windows, **_forward_kwargs(model, n_keep, length)).logits
    out = []
    for b, n in enumerate(n_scored):
        rows = logits[b, -n - 1 : -1]
        targets = windows[b, -n:]
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        for lo in range(0, n, _CHUNK):
            total += F.cross_entropy(rows[lo : lo + _CHUNK].float(), targets[lo : lo + _CHUNK], reduction="sum")
        out.append(float(total))
    return out


def window_plan(doc_lengths: list[int], length: int, stride: int, max_windows: int | None) -> list[tuple[int, int, int]]:
    """(document, start, tokens scored) of every window at ``length``, documents in order."""
    plan = []
    for d, n in enumerate(doc_lengths):
        if n < length:
            continue
        for i, start in enumerate(window_starts(n, length, stride, max_windows)):
            plan.append((d, start, length - 1 if (i == 0 or stride == length) else stride))
    return plan


def perplexity_at_length(model, token_docs: list[torch.LongTensor], length: int, stride: int,
                         max_windows: int | None = None, batch_size: int = 1, accelerator=None,
                         progress: bool = True, desc: str = "") -> tuple[float | None, float, int, int]:
    """(ppl, nll_sum, tokens scored, windows) at one length. With an ``accelerator`` of several processes, the
    windows are split across them (round robin) and the per-window NLLs gathered and summed in window order on
    every process, so the numbers equal a one-process run's."""
    from tqdm.auto import tqdm

    plan = window_plan([ids.numel() for ids in token_docs], length, stride, max_windows)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    mine = list(range(rank, len(plan), world))
    device = next(model.parameters()).device
    local: list[tuple[int, float]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            bar = tqdm(total=len(mine), desc=desc or f"ppl@{length}", unit="win", leave=False,
                       disable=not progress or rank != 0)
            for lo in range(0, len(mine), batch_size):
                chunk = mine[lo : lo + batch_size]
                if len(chunk) == 1:
                    d, start, n = plan[chunk[0]]
                    nlls = [float(_window_nll(model, token_docs[d][start : start + length].to(device), n))]
                else:
                    windows = torch.stack([token_docs[plan[i][0]][plan[i][1] : plan[i][1] + length] for i in chunk])
                    nlls = _batched_nll(model, windows.to(device), [plan[i][2] for i in chunk])
                local.extend(zip(chunk, nlls))
                bar.update(len(chunk))
            bar.close()
    finally:
        model.train(was_training)
    if world > 1:
        from accelerate.utils import gather_object

        gathered = gather_object(local)
    else:
        gathered = local
    by_index = dict(gathered)
    if len(by_index) != len(plan):
        raise RuntimeError(f"gathered {len(by_index)} window results, expected {len(plan)}")
    nll_sum = 0.0
    for i in range(len(plan)):  # fixed order: the same float sum whatever the process count
        nll_sum += by_index[i]
    n_scored = sum(p[2] for p in plan)
    ppl = math.exp(nll_sum / n_scored) if n_scored else None
    return ppl, nll_sum, n_scored, len(plan)


def training_length(model, model_dir: str | None = None) -> int | None:
    """The context the weights were trained at: ``max_length`` of a fine-tune (``training_args.json``), else the
    model's original window (RoPE scaling keeps it as ``original_max_position_embeddings``)."""
    import json

    if model_dir is not None and (Path(model_dir) / "training_args.json").is_file():
        try:
            return int(json.loads((Path(model_dir) / "training_args.json").read_text())["max_length"])
        except (KeyError, ValueError, TypeError):
            pass
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    for value in (rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None,
                  getattr(config, "max_position_embeddings", None), getattr(config, "n_positions", None)):
        if value:
            return int(value)
    return None


# --- outputs -----------------------------------------------------------------------------------------------
def write_csv(path: Path, run: EvalRun, lengths: list[int]) -> None:
    table = run.table()
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["model", *lengths])
        for label, row in table.items():
            writer.writerow([label, *("" if row.get(n) is None else f"{row[n]:.4f}" for n in lengths)])


def markdown_table(run: EvalRun, lengths: list[int]) -> str:
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |",
             "| --- | " + " | ".join("---:" for _ in lengths) + " |"]
    for label, row in run.table().items():
        cells = ["-" if row.get(n) is None else (f"{row[n]:.2f}" if row[n] < 1e5 else f"{row[n]:.3g}")
                 for n in lengths]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, run: EvalRun, lengths: list[int], title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, row in run.table().items():
        xs = [n for n in lengths if row.get(n) is not None and math.isfinite(row[n])]
        ys = [math.log(row[n]) for n in xs]
        trained = run.training_lengths.get(label)
        name = label + (f" (trained at {trained})" if trained else "")
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=name)
        if trained and xs and xs[0] <= trained <= xs[-1]:
            # log-x interpolation of the line at the training length
            y = ys[0] if len(xs) == 1 else _interp(trained, xs, ys)
            ax.plot([trained], [y], marker="*", markersize=13, color=line.get_color(), markeredgecolor="black",
                    linestyle="none")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(n) for n in lengths], fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("log perplexity (lower is better)")
    ax.set_title(title or "perplexity vs context length", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _interp(x: float, xs: list[int], ys: list[float]) -> float:
    lx = [math.log(v) for v in xs]
    t = math.log(x)
    for i in range(len(xs) - 1):
        if lx[i] <= t <= lx[i + 1]:
            w = 0.0 if lx[i + 1] == lx[i] else (t - lx[i]) / (lx[i + 1] - lx[i])
            return ys[i] + w * (ys[i + 1] - ys[i])
    return ys[-1]


def write_outputs(directory: Path, run: EvalRun, lengths: list[int], title: str = "") -> None:
    write_csv(directory / "perplexity.csv", run, lengths)
    write_json(directory / "perplexity.json", {"settings": run.settings, "training_lengths": run.training_lengths,
                                                "table": {k: {str(n): v for n, v in row.items()}
                                                          for k, row in run.table().items()},
                                                "results": [asdict(r) for r in run.results]})
    plot(directory / "perplexity.png", run, lengths, title)


# --- the whole run -----------------------------------------------------------------------------------------
def parse_lengths(lengths: str | None, min_length: int | None, max_length: int | None,
                  length_step: int | None) -> list[int]:
    if lengths:
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
    for name in ("batch_size", "sliding_window", "max_windows", "samples", "min_document_tokens", "length_step",
                 "training_length", "threads"):
        check_number("--" + name.replace("_", "-"), getattr(args, name), 1)
    check_encoding(args.encoding)


def run_eval(args: argparse.Namespace, accelerator=None) -> EvalRun:
    """Everything ``eval-ppl`` does, from parsed arguments; returns the run (written by ``main``)."""
    check_args(args)
    lengths = parse_lengths(args.lengths, args.min_length, args.max_length, args.length_step)
    specs = [MethodSpec.parse(m) for m in (args.method or [UNPATCHED])]
    for spec in specs:
        spec.check()  # unknown methods and options fail before any model is loaded
    min_doc = args.min_document_tokens or max(lengths)
    if min_doc < max(lengths):
        raise UsageError(f"--min-document-tokens {min_doc} is below the longest length {max(lengths)}")
    docs = load_documents(args.text_file, args.dataset, args.dataset_config, args.split, args.text_column,
                          args.text_fraction, args.start_text, encoding=args.encoding)
    main_process = accelerator is None or accelerator.is_main_process
    progress = not args.no_progress and main_process
    dtype = DTYPES[args.dtype]
    device = accelerator.device if accelerator is not None else torch.device("cpu")

    settings = {k: v for k, v in vars(args).items() if k not in ("func",)}
    settings.update(lengths=lengths, min_document_tokens=min_doc,
                    num_processes=accelerator.num_processes if accelerator is not None else 1,
                    protocol="non-overlapping" if args.non_overlapping else
                    ("truncate (first window of each document)" if args.truncate
                     else f"sliding window, stride {args.sliding_window}"),
                    versions=versions())
    run = EvalRun(settings=settings)
    token_docs = None
    for model_spec in args.model:
        model, tokenizer = load_model(model_spec, dtype=dtype, tokenizer=args.tokenizer, verbose=progress)
        model.to(device)
        loaded_patched = _posenc_config(model) is not None
        if token_docs is None:
            budget = max(lengths) if args.truncate else (
                None if args.max_windows is None else max(lengths) + (args.max_windows - 1) * max(lengths))
            all_docs = tokenize_documents(tokenizer, docs, budget)
            token_docs = [ids for ids in all_docs if ids.numel() >= min_doc]
            if args.samples:
                token_docs = token_docs[: args.samples]
            if not token_docs:
                longest = max((ids.numel() for ids in all_docs), default=0)
                raise DataError(f"perplexity at length {max(lengths)} needs a document of at least {min_doc} tokens; "
                                f"the longest of {len(all_docs)} document(s) has {longest} tokens")
        if not args.no_memory_check:
            check_memory(estimate_forward_bytes(model, max(lengths), args.batch_size),
                         f"a forward of {args.batch_size} x {max(lengths)} tokens with {model_spec}")
        for spec in specs:
            check_patchable(model, spec)  # an unpatchable model fails here, before hours of work
        name = Path(model_spec).name if Path(model_spec).exists() else model_spec
        for j, spec in enumerate(specs):
            if j and loaded_patched:  # a patched checkpoint: start again from it rather than stack patches
                model, _ = load_model(model_spec, dtype=dtype, tokenizer=args.tokenizer, verbose=False)
                model.to(device)
            spec.apply(model)
            label = row_label(name, spec.label)
            run.training_lengths[label] = args.training_length or training_length(
                model, model_spec if Path(model_spec).is_dir() else None)
            for length in lengths:
                stride = length if (args.non_overlapping or args.truncate) else min(args.sliding_window, length)
                max_windows = 1 if args.truncate else args.max_windows
                t0 = time.perf_counter()
                ppl, nll, n_tok, n_win = perplexity_at_length(
                    model, token_docs, length, stride, max_windows, args.batch_size, accelerator, progress,
                    desc=f"{label} @{length}")
                result = LengthResult(name, spec.label, length, ppl, nll, n_tok, n_win, len(token_docs), stride,
                                      time.perf_counter() - t0)
                run.results.append(result)
                if main_process:
                    print(f"  {label:<40} {length:>6} tokens: ppl {ppl:.3f} ({n_win} windows, "
                          f"{result.seconds:.1f} s)", flush=True)
            if spec.name != UNPATCHED and not loaded_patched:
                from hf_posenc import unpatch_model

                unpatch_model(model)
        del model
    return run


def _posenc_config(model):
    from hf_posenc import get_posenc_config

    return get_posenc_config(model)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="hf-posenc eval-ppl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None,
                   help="local checkpoint, Hub id, .gguf file, or 'smollm2' (the bundled SmolLM2-135M); repeatable "
                        "(default: smollm2)")
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
    g.add_argument("--batch-size", type=int, default=1)
    g.add_argument("--training-length", type=int, default=None,
                   help="where to put the plot's marker (default: training_args.json or the model's window)")
    add_text_arguments(p)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--output-dir", type=Path, default=Path("runs/eval_ppl"))
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--title", default="", help="plot title")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process")
    p.add_argument("--no-memory-check", action="store_true", help="skip the memory estimate")
    p.add_argument("--no-progress", action="store_true")
    return p


def add_text_arguments(p: argparse.ArgumentParser, split: str = "test") -> None:
    g = p.add_argument_group("text")
    g.add_argument("--text-file", action="append", default=None, help="text file or glob; repeatable")
    g.add_argument("--encoding", default=DEFAULT_ENCODING,
                   help="encoding of the text files (default utf-8; a file that does not decode is refused, naming "
                        "the byte; e.g. cp1252 or latin-1 for older files)")
    g.add_argument("--dataset", default=None, help="a datasets name or path (Hub, offline cache, or local)")
    g.add_argument("--dataset-config", default=None)
    g.add_argument("--split", default=split, help="dataset split (default %(default)s)")
    g.add_argument("--text-column", default="text")
    g.add_argument("--text-fraction", default=None,
                   help="part of every document to use, START:END fractions, e.g. 0:0.8 or 0.8:1 (default: all)")
    g.add_argument("--start-text", default=None, help="start each text file at the first occurrence of this string")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.model = args.model or ["smollm2"]
    return run_command(lambda: _evaluate_and_write(args))


def _evaluate_and_write(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    check_args(args)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available()) if _launched() else None
    main_process = accelerator is None or accelerator.is_main_process
    check_output_dir_on_main(accelerator, args.output_dir, "eval-ppl", args.overwrite)
    with atomic_output_dir(args.output_dir, "eval-ppl", args.overwrite, enabled=main_process) as out:
        run = run_eval(args, accelerator)
        if main_process:
            lengths = run.settings["lengths"]
            write_outputs(out, run, lengths, args.title)
            print()
            print(markdown_table(run, lengths))
    if main_process:
        print(f"wrote {args.output_dir}/perplexity.csv, perplexity.json, perplexity.png")


def _launched() -> bool:
    """Whether this process was started by ``accelerate launch`` (or torchrun) with several processes."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ


if __name__ == "__main__":
    sys.exit(main())
