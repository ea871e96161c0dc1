"""Fine-tuning recipes after a swap (issue 18): LM loss vs distillation from the original, optionally with PoSE or
hybrid layers, at the same token budget; held-out perplexity at a few lengths. One recipe per invocation (so each
evidence run stays short); every run appends its row to bench_recipes.json in --output-dir and prints the table so far.

    nice -n 10 python benchmarks/bench_recipes.py --recipe original
    nice -n 10 python benchmarks/bench_recipes.py --recipe lm --method alibi --steps 16 --max-length 256
    nice -n 10 python benchmarks/bench_recipes.py --recipe distill --method alibi --steps 16 --max-length 256

Training text: the first 80 % of Pride and Prejudice; held out: its last 20 % (never trained on), and with
--wikitext-lengths also WikiText-2's test split (one document). On a machine with CUDA the fine-tune and the
evaluation run on the GPU (float32).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import device_name  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
BOOK = DATA / "pg1342-pride-and-prejudice.txt"
WIKITEXT = DATA / "wikitext-2-raw-test.txt"


def held_out_perplexity(model, tokenizer, lengths: list[int], windows: list[int], text: Path = BOOK,
                        fraction: str = "0.8:1") -> dict[str, float]:
    from hf_posenc.tools.perplexity import perplexity_at_length
    from hf_posenc.tools.text import load_documents, tokenize_documents

    docs = tokenize_documents(tokenizer, load_documents([str(text)], fraction=fraction))
    return {str(length): round(perplexity_at_length(model, docs, length, length, max_windows=count,
                                                    progress=False)[0], 2) for length, count in zip(lengths, windows)}


def training_text(args: argparse.Namespace) -> dict:
    """The fine-tune's settings for its text: the book's first 80 % (or whole --text files), in --max-length blocks
    of which the last --eval-blocks are held out."""
    return {"text_file": [str(t) for t in args.text or [BOOK]], "text_fraction": "0:1" if args.text else "0:0.8",
            "max_length": args.max_length, "eval_blocks": args.eval_blocks}


def training_text_perplexity(model, tokenizer, args: argparse.Namespace) -> float:
    """Perplexity on the held-out blocks of the training text, computed as a fine-tune with these settings computes
    its curve (``finetune.evaluate_loss``): the level of the original model or of a swap before training, where the
    recipes' curves start from and aim at."""
    from accelerate import Accelerator

    from hf_posenc.tools import finetune

    settings = finetune.settings(**training_text(args))
    data = finetune.training_data(settings, tokenizer, finetune.documents_of(settings), 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.eval_blocks, data.eval_positions),
                                         batch_size=settings.batch_size)
    loss = finetune.evaluate_loss(model, loader, Accelerator(cpu=True), finetune.position_options(settings, model))
    return round(math.exp(loss), 2)


def plot_curves(rows: list[dict], path: Path) -> None:
    """Perplexity on the held-out blocks of the training text against fine-tuning tokens, one line per recipe run
    with --eval-blocks."""
    rows = [r for r in rows if r.get("curve")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return
    if not rows:
        return
    figure, axis = plt.subplots(figsize=(12, 4.5))
    axis.set_prop_cycle(color=plt.cm.tab20.colors)  # 20 colours: the default 10 repeat across a long file
    for r in rows:
        label = " ".join([r["recipe"], *([r["method"]] if r.get("method") else []),
                          *([f"PoSE {r['pose_target_length']}"] if r.get("pose_target_length") else []),
                          *([f"lr {r['lr']:g},"] if r.get("steps") else []),
                          f"{r.get('eval_blocks', '?')} x {r['max_length']}-token blocks"])
        axis.plot([c["tokens"] for c in r["curve"]], [c["perplexity"] for c in r["curve"]], marker="o", label=label)
    axis.set_xlabel("fine-tuning tokens")
    axis.set_ylabel("perplexity, held-out blocks of the training text")
    axis.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")  # 34, not 3.4 x 10^1
    axis.yaxis.set_major_formatter(plain)
    low, high = axis.get_ylim()
    if high < 10 * low:  # under a decade a log axis labels one or two values: about 8 round ones over the data
        axis.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(
            [t for t in matplotlib.ticker.MaxNLocator(8).tick_values(low, high) if low <= t <= high]))
        axis.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    else:
        axis.yaxis.set_minor_formatter(plain)
    axis.set_title("recipes after a swap: SmolLM2-135M")
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: the lines stay visible
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="the model to swap: smollm2 (default), a folder or a .gguf file")
    p.add_argument("--recipe", choices=("original", "swap", "lm", "distill", "saved"), required=True)
    p.add_argument("--method", default="alibi", help="NAME[:KEY=VALUE,...] (layers=... for a hybrid)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--train-only", default="all")
    p.add_argument("--distill-alpha", type=float, default=0.5)
    p.add_argument("--distill-temperature", type=float, default=1.0)
    p.add_argument("--pose-target-length", type=int, default=None)
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="training text instead of the book's first 80 %% (repeatable; whole files)")
    p.add_argument("--eval-blocks", type=int, default=0,
                   help="held-out blocks of the training text, for a perplexity-vs-tokens curve (0: none; with "
                        "--recipe original or swap: the curve's point at 0 tokens)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate those blocks every N steps")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--windows", default="2,1", help="held-out windows per length (one number, or one per length)")
    p.add_argument("--wikitext-lengths", default="",
                   help="also WikiText-2 test perplexity at these lengths (one window each), e.g. 2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-dir", type=Path, default=Path("runs/bench_recipes"),
                   help="where bench_recipes.json collects the rows (default %(default)s)")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep the fine-tuned model in this folder and stop before evaluating (evaluate it later with "
                        "--recipe saved --keep FOLDER): splits one long run in two")
    p.add_argument("--save-model", type=Path, default=None,
                   help="keep the fine-tuned model in this folder and evaluate it too (more lengths later with "
                        "--recipe saved --keep FOLDER)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    import hf_posenc
    from hf_posenc.tools import finetune
    from hf_posenc.tools.models import load_model
    from hf_posenc.tools.runtime import MethodRequest

    started = time.perf_counter()
    lengths = [int(x) for x in args.lengths.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    windows = windows * len(lengths) if len(windows) == 1 else windows
    row = {"model": args.model, "windows": dict(zip(map(str, lengths), windows)), "recipe": args.recipe,
           "method": None if args.recipe == "original" else args.method,
           "steps": args.steps, "max_length": args.max_length, "lr": args.lr, "train_only": args.train_only,
           "pose_target_length": args.pose_target_length, "eval_blocks": args.eval_blocks,
           "text": [Path(t).name for t in args.text or [BOOK]]}
    if args.recipe == "saved":  # a model kept by an earlier --keep run: evaluate it, with that run's row
        from transformers import AutoTokenizer

        row = json.loads((args.keep / "bench_row.json").read_text())
        model, tokenizer = hf_posenc.from_pretrained(args.keep), AutoTokenizer.from_pretrained(args.keep)
        row["windows"] = dict(zip(map(str, lengths), windows))
    elif args.recipe in ("original", "swap"):
        model, tokenizer = load_model(args.model, dtype=torch.float32, verbose=False)
        if args.recipe == "swap":
            MethodRequest.parse(args.method).apply(model)
        row["steps"] = 0
        if args.eval_blocks:  # the curve's point at 0 tokens
            row["curve"] = [{"step": 0, "tokens": 0, "perplexity": training_text_perplexity(model, tokenizer, args)}]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = args.keep or args.save_model or Path(tmp) / "ft"
            extra = {"distill_from": "original", "distill_alpha": args.distill_alpha,
                     "distill_temperature": args.distill_temperature} if args.recipe == "distill" else {}
            summary = finetune.run_finetune(finetune.settings(
                model=args.model, method=args.method, train_only=args.train_only, **training_text(args),
                eval_every=args.eval_every, max_steps=args.steps, lr=args.lr, output_dir=out, no_progress=False,
                threads=args.threads, pose_target_length=args.pose_target_length, no_memory_check=True, **extra))
            row["train_seconds"] = summary["seconds"]
            log = json.loads((out / "loss_log.json").read_text())
            row["loss"] = [round(e["loss"], 3) for e in log]
            row["curve"] = [{"step": e["step"], "tokens": e["tokens"], "perplexity": round(math.exp(e["eval_loss"]), 2)}
                            for e in log if "eval_loss" in e]
            model = hf_posenc.from_pretrained(out)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(out)
        if args.recipe == "distill":
            row.update(distill_alpha=args.distill_alpha, distill_temperature=args.distill_temperature)
        if args.keep or args.save_model:
            (out / "bench_row.json").write_text(json.dumps(row, indent=2) + "\n")
        if args.keep:
            print(f"kept in {args.keep}; evaluate with --recipe saved --keep {args.keep}")
            return
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the fine-tune (accelerate) picks the GPU alike
    row["device"] = device_name(device)
    row["perplexity"] = held_out_perplexity(model.to(device), tokenizer, lengths, windows)
    if args.wikitext_lengths:
        wiki = [int(x) for x in args.wikitext_lengths.split(",")]
        row["perplexity_wikitext"] = held_out_perplexity(model, tokenizer, wiki, [1] * len(wiki), WIKITEXT, "0:1")
    row["seconds"] = round(time.perf_counter() - started, 1)
    row["machine"] = machine_description()
    output = args.output_dir / "bench_recipes.json"
    rows = json.loads(output.read_text()) if output.is_file() else []
    rows.append(row)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(rows, indent=2) + "\n")
    plot_curves(rows, args.output_dir / "bench_recipes.png")
    print(machine_header())
    print(f"{'recipe':10} {'method':24} {'steps':>5} " + " ".join(f"{'ppl@' + str(n):>9}" for n in lengths)
          + "  train s")
    for r in rows:
        print(f"{r['recipe']:10} {str(r['method']):24} {r['steps']:>5} "
              + " ".join(f"{r['perplexity'].get(str(n), float('nan')):>9}" for n in lengths)
              + f"  {r.get('train_seconds', '')}")


if __name__ == "__main__":
    main()
