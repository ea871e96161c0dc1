"""A tiny length-extrapolation check: a byte-level LLaMA-style model (2 layers, hidden 128, 4 heads, vocab 256) trained
from scratch for --steps steps at length 128 on the first 90% of tiny Shakespeare, once per method (same seed, data
order and optimiser), then its perplexity on the last 10% at lengths 128..1024 (up to 8 windows each, no overlap).
Prints a table and writes extrapolation_tiny.json. A signal, not a result: the models are far from converged.

    HF_POSENC_DATA=../shared/data .venv/bin/python benchmarks/extrapolation_tiny.py --steps 300 \\
        --methods rope,nope,alibi,fox,stick-breaking,cope,transformer-xl,cape --output-dir runs/extrapolation_tiny

"rope" is the model's own mechanism (no patch); every other name is patched with its defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_posenc
from hf_posenc.tools.text import data_dir

TRAIN_LENGTH = 128
EVAL_LENGTHS = [128, 256, 512, 1024]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=TRAIN_LENGTH)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def train_and_evaluate(method: str, train: torch.Tensor, held: torch.Tensor, steps: int, batch: int) -> dict:
    model = build_model()
    if method != "rope":
        hf_posenc.patch_model(model, method)
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
    row = {"method": method, "train_s": round(time.perf_counter() - start, 1), "final_loss": round(loss.item(), 3)}
    model.eval()
    with torch.no_grad():
        for length in EVAL_LENGTHS:
            windows = min(8, (len(held) - 1) // length)
            ids = torch.stack([held[i * length:(i + 1) * length] for i in range(windows)])
            row[f"ppl_{length}"] = round(math.exp(model(ids, labels=ids).loss.item()), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="rope,nope,alibi,fox,stick-breaking,cope,transformer-xl,cape")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", default=None, help="the shared text folder (default: $HF_POSENC_DATA)")
    parser.add_argument("--output-dir", default="runs/extrapolation_tiny")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = torch.tensor(list((data_dir(args.data_dir) / "tinyshakespeare.txt").read_bytes()), dtype=torch.long)
    split = int(0.9 * len(data))
    rows = []
    header = "| method | train s | final loss | " + " | ".join(f"ppl @{n}" for n in EVAL_LENGTHS) + " |"
    print(header + "\n|" + " --- |" * (3 + len(EVAL_LENGTHS)), flush=True)
    for method in args.methods.split(","):
        row = train_and_evaluate(method, data[:split], data[split:], args.steps, args.batch)
        rows.append(row)
        print(f"| {method} | {row['train_s']} | {row['final_loss']} | "
              + " | ".join(str(row[f"ppl_{n}"]) for n in EVAL_LENGTHS) + " |", flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "extrapolation_tiny.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
