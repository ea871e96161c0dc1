"""A tiny length-extrapolation check: a byte-level LLaMA-style model (2 layers, hidden 128, 4 heads, vocab 256) trained
from scratch for --steps steps at length 128 on the first 90% of tiny Shakespeare, once per method (same seed, data
order and optimiser), then its perplexity on the last 10% at lengths 128..1024 (up to 8 windows each, no overlap).
Prints a table and writes extrapolation_tiny.json, extrapolation_tiny.csv (a row per method, a column per length, as
jquesnelle/yarn's eval) and extrapolation_tiny.png (perplexity against length). A signal, not a result: the models are
far from converged.

    HF_POSENC_DATA=../shared/data .venv/bin/python benchmarks/extrapolation_tiny.py --steps 300 \\
        --methods rope,nope,alibi,fox,stick-breaking,cope,transformer-xl,cape --output-dir runs/extrapolation_tiny
    # more methods beside an earlier run (same seed, data order and optimiser), then the CSV and plot of them all:
    ... extrapolation_tiny.py --methods fox-pro --append --output-dir runs/extrapolation_tiny
    ... extrapolation_tiny.py --plot-only --output-dir runs/extrapolation_tiny

"rope" is the model's own mechanism (no patch); "fox-pro" is fox with every FoX-Pro part (QK-norm, output norm,
output gate, key and value token shift); every other name is patched with its defaults.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_posenc
from hf_posenc.tools.text import data_dir
from hf_posenc.tools.machine import machine_description, machine_header

TRAIN_LENGTH = 128
EVAL_LENGTHS = [128, 256, 512, 1024]
VARIANTS = {"fox-pro": ("fox", {"qk_norm": True, "output_norm": True, "output_gate": True, "key_shift": True,
                                "value_shift": True})}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=TRAIN_LENGTH)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def train_and_evaluate(method: str, train: torch.Tensor, held: torch.Tensor, steps: int, batch: int) -> dict:
    model = build_model()
    if method != "rope":
        name, options = VARIANTS.get(method, (method, {}))
        hf_posenc.patch_model(model, name, **options)
    optimiser = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(1)
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, len(train) - TRAIN_LENGTH - 1, (batch,), generator=generator)
        ids = torch.stack([train[s:s + TRAIN_LENGTH] for s in starts])
        loss = model(ids, labels=ids).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    row = {"method": method, "train_s": round(time.perf_counter() - start, 1), "final_loss": round(loss.item(), 3),
           "machine": machine_description()}
    model.eval()
    with torch.no_grad():
        for length in EVAL_LENGTHS:
            windows = min(8, (len(held) - 1) // length)
            ids = torch.stack([held[i * length:(i + 1) * length] for i in range(windows)])
            row[f"ppl_{length}"] = round(math.exp(model(ids, labels=ids).loss.item()), 3)
    return row


def write_outputs(rows: list[dict], out: Path) -> None:
    """extrapolation_tiny.json, .csv and (with matplotlib) .png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "extrapolation_tiny.json").write_text(json.dumps(rows, indent=2))
    with open(out / "extrapolation_tiny.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "train_s", "final_loss", *EVAL_LENGTHS])
        for row in rows:
            writer.writerow([row["method"], row["train_s"], row["final_loss"], *(row[f"ppl_{n}"] for n in EVAL_LENGTHS)])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        style = "--" if row["method"] in ("rope", "nope", "alibi") else "-"
        axis.plot(EVAL_LENGTHS, [row[f"ppl_{n}"] for n in EVAL_LENGTHS], style, marker="o", label=row["method"])
    axis.axvline(TRAIN_LENGTH, color="grey", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xticks(EVAL_LENGTHS, [str(n) for n in EVAL_LENGTHS])
    axis.set_xlabel(f"evaluation length (trained at {TRAIN_LENGTH})")
    axis.set_ylabel("held-out perplexity (bytes)")
    axis.set_title("tiny byte LLaMA trained from scratch, tiny Shakespeare")
    axis.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    figure.savefig(out / "extrapolation_tiny.png", dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="rope,nope,alibi,fox,stick-breaking,cope,transformer-xl,cape")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", default=None, help="the shared text folder (default: $HF_POSENC_DATA)")
    parser.add_argument("--output-dir", default="runs/extrapolation_tiny")
    parser.add_argument("--append", action="store_true",
                        help="add these methods' rows to the JSON already in --output-dir (replacing same-named rows)")
    parser.add_argument("--plot-only", action="store_true", help="write the CSV and plot of the JSON in --output-dir")
    args = parser.parse_args()
    out = Path(args.output_dir)
    existing = json.loads((out / "extrapolation_tiny.json").read_text()) if args.append or args.plot_only else []
    if args.plot_only:
        write_outputs(existing, out)
        return
    torch.set_num_threads(args.threads)
    data = torch.tensor(list((data_dir(args.data_dir) / "tinyshakespeare.txt").read_bytes()), dtype=torch.long)
    split = int(0.9 * len(data))
    rows = []
    header = "| method | train s | final loss | " + " | ".join(f"ppl @{n}" for n in EVAL_LENGTHS) + " |"
    print(machine_header())
    print(header + "\n|" + " --- |" * (3 + len(EVAL_LENGTHS)), flush=True)
    for method in args.methods.split(","):
        row = train_and_evaluate(method, data[:split], data[split:], args.steps, args.batch)
        rows.append(row)
        print(f"| {method} | {row['train_s']} | {row['final_loss']} | "
              + " | ".join(str(row[f"ppl_{n}"]) for n in EVAL_LENGTHS) + " |", flush=True)
        names = {r["method"] for r in rows}
        write_outputs([r for r in existing if r["method"] not in names] + rows, out)


if __name__ == "__main__":
    main()
