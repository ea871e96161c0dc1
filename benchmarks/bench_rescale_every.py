"""What `rescale_every=N` buys for the dynamic scalings in exact mode: time per decoded token past the window.

Exact mode (`exact_cache=True`) replays the text whenever the scale changes. With N = 1 the scale follows the exact
length, so every step past the window replays the whole text; with N > 1 it follows the length rounded up to a
multiple of N, so a replay happens once per N tokens and the other steps cost about what `exact_cache=False` costs
(queries and the un-rotated key cache rotated inside attention).

Decodes `--new-tokens` tokens after a prompt of `--prompt` tokens (past `--window`) on the LLaMA-style stack of
bench_rope_cache.py (shaped like SmolLM2-135M, random weights) and reports, for native RoPE and for each N, the
milliseconds per decoded token (averaged over all the decoded tokens, replays included), the ratio to native RoPE in
the same run, and how many replays happened. Prints a table and writes results.json and results.png to --output-dir.
--device cuda times it on a GPU (device work waited for before each clock reading).

    .venv/bin/python benchmarks/bench_rescale_every.py --window 1024 --prompt 1024 --new-tokens 512
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import device_name, synchronize  # noqa: E402
from bench_rope_cache import build_model  # noqa: E402 (the same model as the other decode benchmark)

from hf_posenc import patch_model, unpatch_model  # noqa: E402
from hf_posenc.engine.cache_names import forward_cache_keyword  # noqa: E402
from hf_posenc.engine.replay import replay_count  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

EVERY = (1, 64, 256, 1024)


@torch.inference_mode()
def decode(model, prompt: int, new_tokens: int) -> tuple[float, int]:
    """(seconds per decoded token, replays) for `new_tokens` tokens decoded one by one after a `prompt`-token
    prompt."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, prompt + new_tokens), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    cached = {forward_cache_keyword(model): cache}
    model(ids[:, :prompt], **cached, use_cache=True)
    replayed_before = replay_count(cache)
    synchronize(device)
    start = time.perf_counter()
    for t in range(prompt, prompt + new_tokens):
        model(ids[:, t:t + 1], **cached, use_cache=True)
    synchronize(device)
    return (time.perf_counter() - start) / new_tokens, replay_count(cache) - replayed_before


def run(method: str = "dynamic", every=EVERY, window: int = 1024, prompt: int = 1024, new_tokens: int = 512,
        layers: int = 4, output_dir: str | Path = "runs/bench_rescale_every", device: str = "cpu") -> dict:
    model = build_model(layers, window).to(device)
    decode(model, min(prompt, 64), 2)  # warm-up (on a GPU: kernel selection)
    rows = {}
    unpatch_model(model)
    seconds, replays = decode(model, prompt, new_tokens)
    rows["native rope"] = {"ms_per_token": seconds * 1000, "replays": replays}
    for n in every:
        patch_model(model, method, factor=4.0, exact_cache=True, rescale_every=n)
        seconds, replays = decode(model, prompt, new_tokens)
        rows[f"{method}, rescale_every={n}"] = {"ms_per_token": seconds * 1000, "replays": replays}
    unpatch_model(model)
    for row in rows.values():
        row["ratio_to_native"] = row["ms_per_token"] / rows["native rope"]["ms_per_token"]
    report = {"settings": {"method": method, "window": window, "prompt": prompt, "new_tokens": new_tokens,
                           "layers": layers, "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "device": device_name(model.device)},
              "machine": machine_description(), "rows": rows}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "results.png")
    return report


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = report["settings"]
    names = list(report["rows"])
    figure, axis = plt.subplots(figsize=(7, 3.8))
    axis.bar(range(len(names)), [report["rows"][n]["ratio_to_native"] for n in names], color="tab:blue")
    axis.set_xticks(range(len(names)), [n.split(", ")[-1] for n in names], rotation=20, ha="right")
    axis.set_yscale("log")
    axis.axhline(1.0, color="k", linewidth=0.8)
    axis.set_ylabel("decode time per token / native RoPE")
    axis.set_title(f"{s['method']} exact mode: {s['new_tokens']} tokens after {s['prompt']} (window {s['window']}), "
                   f"{s['device']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(report: dict) -> str:
    s = report["settings"]
    lines = [f"| {s['new_tokens']} tokens decoded after {s['prompt']} (window {s['window']}) | ms per token | "
             "vs native | replays |", "| --- | --- | --- | --- |"]
    for name, row in report["rows"].items():
        lines.append(f"| {name} | {row['ms_per_token']:.1f} | {row['ratio_to_native']:.2f}x | {row['replays']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="dynamic", choices=["dynamic", "dynamic-yarn"])
    parser.add_argument("--every", default=",".join(map(str, EVERY)), help="values of rescale_every, comma-separated")
    parser.add_argument("--window", type=int, default=1024, help="the model's original window")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--output-dir", default="runs/bench_rescale_every")
    args = parser.parse_args()
    report = run(args.method, tuple(int(n) for n in args.every.split(",")), args.window, args.prompt,
                 args.new_tokens, args.layers, args.output_dir, args.device)
    print(machine_header(report["machine"]))
    print(table(report))
    print(f"wrote {args.output_dir}/results.json")


if __name__ == "__main__":
    main()
