"""What exactness under a KV cache costs for length-dependent RoPE scalings: time per decoded token.

Decodes a few tokens after prompts of several lengths on a LLaMA-style stack shaped like SmolLM2-135M
(hidden 576, 9 query / 3 key-value heads of 64), random weights, and compares:

- native RoPE (keys rotated once, before the cache);
- `yarn` (static: rotated before the cache, like native);
- `dynamic` with exact_cache=False (queries and the whole un-rotated key cache rotated in attention);
- `dynamic` with exact_cache=True (as above, plus the text replayed whenever the scale changes: every step
  past the window).

Every figure is a ratio to native RoPE measured in the same run. Prints a table and writes results.json and
decode_time.png to --output-dir.

    .venv/bin/python benchmarks/bench_rope_cache.py --lengths 512,1024,2048,4096 --output-dir runs/bench_rope_cache
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_posenc import patch_model, unpatch_model
from hf_posenc.engine.cache_names import forward_cache_keyword
from hf_posenc.tools.machine import machine_description, machine_header
from hf_posenc.tools.progress import progress

VARIANTS = {
    "native rope": None,
    "yarn": ("yarn", {"factor": 4.0}),
    "dynamic, exact_cache=False": ("dynamic", {"factor": 4.0, "exact_cache": False}),
    "dynamic, exact_cache=True": ("dynamic", {"factor": 4.0, "exact_cache": True}),
}


def build_model(layers: int, window: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=window,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def seconds_per_token(model, prompt_length: int, new_tokens: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_length + new_tokens))
    cache = DynamicCache(config=model.config)
    cached = {forward_cache_keyword(model): cache}
    model(ids[:, :prompt_length], **cached, use_cache=True)
    start = time.perf_counter()
    for t in range(prompt_length, prompt_length + new_tokens):
        model(ids[:, t:t + 1], **cached, use_cache=True)
    return (time.perf_counter() - start) / new_tokens


def run(lengths=(512, 1024, 2048, 4096), window: int = 1024, layers: int = 4, new_tokens: int = 8,
        output_dir: str | Path = "runs/bench_rope_cache") -> dict:
    model = build_model(layers, window)
    results: dict[str, dict[int, float]] = {name: {} for name in VARIANTS}
    jobs = [(name, length) for length in lengths for name in VARIANTS]
    for name, length in progress(jobs, desc="decode benchmark", unit="run"):
        unpatch_model(model)
        if VARIANTS[name] is not None:
            method, options = VARIANTS[name]
            patch_model(model, method, **options)
        results[name][length] = seconds_per_token(model, length, new_tokens)
    unpatch_model(model)
    report = {
        "settings": {"lengths": list(lengths), "window": window, "layers": layers, "new_tokens": new_tokens,
                     "threads": torch.get_num_threads(), "torch": torch.__version__},
        "machine": machine_description(),
        "seconds_per_token": results,
        "ratio_to_native": {name: {length: results[name][length] / results["native rope"][length]
                                   for length in lengths} for name in VARIANTS},
    }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "decode_time.png")
    return report


def table(report: dict) -> str:
    lengths = report["settings"]["lengths"]
    window = report["settings"]["window"]
    lines = [f"| method (window {window}) | " + " | ".join(f"prompt {n}" for n in lengths) + " |",
             "| --- |" + " --- |" * len(lengths)]
    for name, by_length in report["seconds_per_token"].items():
        cells = [f"{by_length[n] * 1000:.1f} ms ({report['ratio_to_native'][name][n]:.2f}x)" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = report["settings"]["lengths"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_length in report["seconds_per_token"].items():
        ax.plot(lengths, [by_length[n] * 1000 for n in lengths], marker="o", label=name)
    ax.axvline(report["settings"]["window"], color="grey", linestyle=":", label="original window")
    ax.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="ms per decoded token",
           title="Decoding cost of RoPE scalings under a KV cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--window", type=int, default=1024, help="the model's original window")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--output-dir", default="runs/bench_rope_cache")
    args = parser.parse_args()
    report = run(tuple(int(n) for n in args.lengths.split(",")), args.window, args.layers, args.new_tokens,
                 args.output_dir)
    print(machine_header(report["machine"]))
    print(table(report))
    print(f"wrote {args.output_dir}/results.json, decode_time.png")


if __name__ == "__main__":
    main()
