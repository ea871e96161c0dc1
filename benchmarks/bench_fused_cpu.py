"""The fused CPU kernels (engine/kernels/fused_cpu.py: stick-breaking, CoPE, Self-Extend, ReRoPE, and the plain causal kernel
of Transformer-XL's and TAPE's kernel form) against the path they replace (the blocked path; for Transformer-XL and
TAPE, SDPA on their form padded to one head size) and against native RoPE with causal SDPA, all in one process, on
the CPU:

- per layer step: SmolLM2-135M's shapes (9 query and 3 key-value heads of 64, hidden 576; `--layers` decoder layers,
  a 512-word output layer so that the layers dominate), one sequence, forward, a loss over every position, backward.
  Each timed round runs native, the method under "auto" (the fused kernel) and the method on the blocked path, one
  step each, interleaved; the medians over the rounds, and tokens/s over native's;
- the kernel alone: the fused call's forward and backward against causal SDPA's on the same queries, keys and values
  (the key-value heads repeated; Self-Extend's and ReRoPE's kernel with its far keys past the window; Transformer-XL's
  and TAPE's at their form's head sizes), median over the rounds.

    python benchmarks/bench_fused_cpu.py --lengths 2048,4096 --threads 2 --output-dir runs/bench_fused_cpu

Methods take options as the tools do ("cope:max_pos=4096": no key's position clamped, the kernel's slowest case).
Prints a table, writes bench_fused_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_posenc.tools.machine import machine_description, machine_header

METHODS = ("stick-breaking", "cope", "cope:max_pos=4096", "self-extend:window=256,group=4", "rerope:window=256",
           "transformer-xl", "tape")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (query and key, value) head sizes of a kernel form at the method's default options: Transformer-XL's queries and keys
# carry the sinusoid's 2 x relative_dim / 2 terms beside the content; TAPE's values carry the keys' features.
FORM_WIDTHS = {"transformer-xl": (2 * HEAD_DIM, HEAD_DIM), "tape": (HEAD_DIM, 2 * HEAD_DIM)}
FUSED_PATHS = ("fused content", "fused near far", "fused causal")


@dataclass
class Row:
    method: str
    length: int
    native_s: float  # one layer step (the model's steps over --layers)
    fused_s: float
    blocked_s: float
    fused_x_native: float  # tokens/s over native's
    blocked_x_native: float
    kernel_s: float  # the fused kernel's forward + backward
    sdpa_s: float  # causal SDPA's, same shapes
    kernel_x_sdpa: float
    fused_calls: int  # layer calls the fused kernel served (0: it was refused or did not apply)
    threads: int


def _model(method: str, layers: int, length: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_posenc.tools.runtime import MethodRequest

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=HEADS * HEAD_DIM, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=max(8192, length), tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    if method != "native":
        MethodRequest.parse(method).apply(model)
    return model


def _step(model, ids, path: str) -> float:
    from hf_posenc import attention

    start = time.perf_counter()
    with attention.attention_path(path):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def _kernel_times(method: str, model, length: int, rounds: int) -> tuple[float, float]:
    """(fused forward + backward, causal SDPA's) on random queries, keys and values of the model's shapes."""
    from hf_posenc import get_positional_module
    from hf_posenc.engine.kernels.by_method import kernels_for
    from hf_posenc.engine.kernels.fused_cpu import causal_attention, near_far_causal

    module = get_positional_module(model)
    generator = torch.Generator().manual_seed(1)
    query, key, value, grad = (torch.randn(1, HEADS, length, HEAD_DIM, generator=generator) for _ in range(4))
    form = FORM_WIDTHS.get(module.config.method)
    if form is not None:
        form_query, form_key = (torch.randn(1, HEADS, length, form[0], generator=generator) for _ in range(2))
        form_value, form_grad = (torch.randn(1, HEADS, length, form[1], generator=generator) for _ in range(2))

    def fused():
        if form is not None:
            inputs = [x.clone().requires_grad_() for x in (form_query, form_key, form_value)]
            causal_attention(*inputs, HEAD_DIM ** -0.5).backward(form_grad)
            return
        inputs = [x.clone().requires_grad_() for x in (query, key, value)]
        if kernels_for(module).near_far:  # both pairs the same tensors: the kernel's cost is the same
            output = near_far_causal(inputs[0], inputs[1], inputs[0], inputs[1], inputs[2], module.window,
                                     HEAD_DIM ** -0.5)
        else:
            positions = torch.arange(length)[None]
            output = kernels_for(module).causal.run(module, 0, *inputs, HEAD_DIM ** -0.5, positions)
        output.backward(grad)

    def sdpa():
        inputs = [x.clone().requires_grad_() for x in (query, key, value)]
        F.scaled_dot_product_attention(*inputs, is_causal=True).backward(grad)

    times = {fused: [], sdpa: []}
    for function in times:
        function()  # warm-up (the first fused call builds or loads the extension)
    for _ in range(rounds):
        for function, kept in times.items():
            start = time.perf_counter()
            function()
            kept.append(time.perf_counter() - start)
    return statistics.median(times[fused]), statistics.median(times[sdpa])


def run(methods=METHODS, lengths=(2048, 4096), layers: int = 1, rounds: int = 5, threads: int | None = None,
        progress: bool = True) -> list[Row]:
    from hf_posenc.tools.progress import progress as progress_bar

    from hf_posenc import attention

    if threads:
        torch.set_num_threads(threads)
    rows = []
    for length, method in progress_bar([(n, m) for n in lengths for m in methods], enabled=progress,
                               desc="bench_fused_cpu"):
        native, patched = _model("native", layers, length), _model(method, layers, length)
        ids = torch.randint(0, 512, (1, length), generator=torch.Generator().manual_seed(2))
        cases = {"native": (native, "auto"), "fused": (patched, "auto"), "blocked": (patched, "blocked")}
        for model, path in cases.values():
            _step(model, ids, path)  # warm-up: builds the kernel, runs its check
        attention.last_paths.clear()
        times = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (model, path) in cases.items():
                times[name].append(_step(model, ids, path) / layers)
        fused_calls = sum(attention.last_paths[name] for name in FUSED_PATHS)
        kernel_s, sdpa_s = _kernel_times(method, patched, length, rounds)
        median = {name: statistics.median(kept) for name, kept in times.items()}
        rows.append(Row(method, length, median["native"], median["fused"], median["blocked"],
                        median["native"] / median["fused"], median["native"] / median["blocked"], kernel_s, sdpa_s,
                        kernel_s / sdpa_s, fused_calls, torch.get_num_threads()))
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| method | L | native s/layer | fused s/layer | blocked s/layer | fused x native | blocked x native | "
             "kernel x causal SDPA | fused calls |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.method} | {r.length} | {r.native_s:.3f} | {r.fused_s:.3f} | {r.blocked_s:.3f} | "
                     f"{r.fused_x_native:.2f} | {r.blocked_x_native:.2f} | {r.kernel_x_sdpa:.2f} | {r.fused_calls} |")
    return "\n".join(lines)


def save(rows: list[Row], output_dir) -> dict[str, Path]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_fused_cpu.json"}
    machine = machine_description()
    paths["json"].write_text(json.dumps([{**asdict(r), "machine": machine} for r in rows], indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    figure, axis = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.5))
    positions = range(len(rows))
    axis.bar([p - 0.2 for p in positions], [r.fused_x_native for r in rows], width=0.4, label="fused kernel")
    axis.bar([p + 0.2 for p in positions], [r.blocked_x_native for r in rows], width=0.4, label="blocked path")
    axis.axhline(0.9, color="grey", linestyle="--", linewidth=1, label="0.9x native")
    axis.set_xticks(list(positions), [f"{r.method}\n{r.length}" for r in rows], fontsize=7)
    axis.set_ylabel("training tokens/s over native RoPE's (one layer)")
    axis.set_title(f"fused CPU kernels, {rows[0].threads if rows else '?'} threads")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    paths["png"] = out / "bench_fused_cpu.png"
    figure.savefig(paths["png"], dpi=120)
    plt.close(figure)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=";".join(METHODS), help="';'-separated methods with options")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/bench_fused_cpu")
    args = parser.parse_args(argv)
    rows = run(args.methods.split(";"), [int(n) for n in args.lengths.split(",")], args.layers, args.rounds,
               args.threads)
    print(machine_header())
    print(format_table(rows))
    written = save(rows, args.output_dir)
    print("\n".join(f"{kind}: {path}" for kind, path in written.items()))


if __name__ == "__main__":
    main()
