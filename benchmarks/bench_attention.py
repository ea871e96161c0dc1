"""Attention-path benchmark: a LLaMA-style layer stack (8 heads x 64) with its native RoPE (sdpa) against every
relative-bias method and attention path, at several lengths, batch 1: forward time, forward+backward time and
peak memory, as ratios to native in the same run. Prints a table and writes bench_attention.json and
bench_attention.png to --output-dir.

    .venv/bin/python benchmarks/bench_attention.py --lengths 512,1024 --output-dir runs/bench_attention

Each row names the path that served its attention calls (`hf_posenc.attention.last_paths`), which is not always
the one asked for: "flex" or "flash" fall back to "blocked" for calls they cannot serve or that the kernel check
refused on this machine (`attention.kernel_status()`), and a method without a bias over a plain causal square takes
SDPA's own causal kernel ("causal"). Native RoPE never enters hf_posenc's attention path: its rows say "sdpa".

Peak memory on CPU is the process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs before
each measurement) with glibc's mmap threshold fixed low, so freed tensors go back to the system at once and the
mark follows live tensor memory. "extra" is the peak minus native's; it is compared with the size of one
materialised float32 bias [1, H, L, L].
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hf_posenc import attention, patch_model, unpatch_model

METHODS = ["alibi", "fire", "t5", "kerple", "sandwich", "xpos"]
LENGTHS = [512, 1024, 2048, 4096, 8192]


@dataclass
class Row:
    method: str
    path: str  # the path(s) that served the attention calls, most calls first ("blocked", "flex+blocked", ...)
    requested_path: str
    length: int
    forward_s: float
    forward_backward_s: float
    forward_peak_mib: float
    forward_backward_peak_mib: float
    served_calls: dict[str, int] = field(default_factory=dict)  # attention calls per path, warm-up included
    forward_ratio: float = 1.0
    forward_backward_ratio: float = 1.0
    extra_forward_mib: float = 0.0
    extra_vs_materialised_bias: float = 0.0  # extra forward peak / size of a materialised [1, H, L, L] bias


def served_path(calls: Counter) -> str:
    """The paths that served, most calls first; "sdpa" when hf_posenc's attention path was not called (native)."""
    return "+".join(path for path, _ in calls.most_common()) or "sdpa"


def _fix_mmap_threshold() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib(fn) -> float:
    """Peak resident memory above the starting point while fn runs (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return float("nan")
    start = _rss_mib("VmRSS")
    fn()
    return _rss_mib("VmHWM") - start


def build_model(layers: int, heads: int, head_dim: int, max_length: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hidden = heads * head_dim
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=int(hidden * 8 / 3) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_length, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def measure(model, ids, repeats: int, backward_repeats: int) -> tuple[float, float, float, float]:
    model.eval()

    def forward():
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)

    def forward_backward():
        model.train()
        model(ids, use_cache=False, logits_to_keep=1).logits.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    forward()  # warm-up (and compilation, for flex)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    forward_peak = peak_mib(forward)
    forward_backward()
    backward_times = []
    for _ in range(backward_repeats):
        start = time.perf_counter()
        forward_backward()
        backward_times.append(time.perf_counter() - start)
    backward_peak = peak_mib(forward_backward)
    return statistics.median(times), statistics.median(backward_times), forward_peak, backward_peak


def run_benchmark(lengths=LENGTHS, methods=METHODS, paths=("blocked",), layers: int = 2, heads: int = 8,
                  head_dim: int = 64, repeats: int = 3, backward_repeats: int = 2, threads: int | None = None,
                  progress: bool = True) -> list[Row]:
    """Run every (method, path) at every length; returns rows with ratios to native RoPE (sdpa)."""
    from tqdm import tqdm

    _fix_mmap_threshold()
    if threads:
        torch.set_num_threads(threads)
    model = build_model(layers, heads, head_dim, max(lengths))
    jobs = [(length, "rope (native)", "sdpa") for length in lengths]
    for length in lengths:
        for method in methods:
            for path in paths:
                if path == "blocked" or method != "xpos":  # xPos has no bias table: flex does not apply
                    jobs.append((length, method, path))
    jobs.sort(key=lambda job: job[0])
    rows: list[Row] = []
    native: dict[int, Row] = {}
    for length, method, path in tqdm(jobs, disable=not progress, desc="bench_attention"):
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
        if method == "rope (native)":
            unpatch_model(model)
        else:
            patch_model(model, method)
        attention.last_paths.clear()
        with attention.attention_path(path if path != "sdpa" else "auto"):
            forward_s, backward_s, forward_peak, backward_peak = measure(model, ids, repeats, backward_repeats)
        calls = Counter(attention.last_paths)
        row = Row(method, served_path(calls), path, length, forward_s, backward_s, forward_peak, backward_peak,
                  dict(calls))
        if method == "rope (native)":
            native[length] = row
        base = native[length]
        row.forward_ratio = forward_s / base.forward_s
        row.forward_backward_ratio = backward_s / base.forward_backward_s
        row.extra_forward_mib = forward_peak - base.forward_peak_mib
        row.extra_vs_materialised_bias = row.extra_forward_mib / (heads * length * length * 4 / 2**20)
        rows.append(row)
    unpatch_model(model)
    return rows


def format_table(rows: list[Row]) -> str:
    """A markdown table; the path column says what served, and what was asked for when that differs."""
    lines = ["| method | path | L | forward s | x native | fwd+bwd s | x native | extra fwd peak MiB | % of bias |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        path = r.path if r.path == r.requested_path else f"{r.path} ({r.requested_path} asked)"
        lines.append(f"| {r.method} | {path} | {r.length} | {r.forward_s:.3f} | {r.forward_ratio:.2f} | "
                     f"{r.forward_backward_s:.3f} | {r.forward_backward_ratio:.2f} | {r.extra_forward_mib:.0f} | "
                     f"{100 * r.extra_vs_materialised_bias:.1f}% |")
    return "\n".join(lines)


def refused_kernels() -> list[str]:
    """One line per kernel the kernel check refused in this process (the blocked path served it instead)."""
    return [f"{v.kernel} on {v.device}: {v.detail}" for v in attention.kernel_status() if not v.passed]


def save(rows: list[Row], output_dir: str | Path) -> dict[str, Path]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench_attention.json"
    json_path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    paths = {"json": json_path}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    keys = sorted({(r.method, r.requested_path) for r in rows if r.method != "rope (native)"})
    for method, requested in keys:
        series = sorted((r for r in rows if (r.method, r.requested_path) == (method, requested)),
                        key=lambda r: r.length)
        path = "/".join(dict.fromkeys(r.path for r in series))  # what served
        lengths = [r.length for r in series]
        axes[0].plot(lengths, [r.forward_ratio for r in series], marker="o", label=f"{method} ({path})")
        axes[1].plot(lengths, [r.forward_backward_ratio for r in series], marker="o", label=f"{method} ({path})")
        axes[2].plot(lengths, [100 * r.extra_vs_materialised_bias for r in series], marker="o",
                     label=f"{method} ({path})")
    for axis, title in zip(axes, ["forward time / native", "forward+backward time / native",
                                  "extra forward peak, % of a materialised bias"]):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].axhline(1.3, color="k", linestyle="--", linewidth=0.8)
    axes[2].axhline(5, color="k", linestyle="--", linewidth=0.8)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    png = out / "bench_attention.png"
    figure.savefig(png, dpi=120)
    plt.close(figure)
    paths["png"] = png
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    parser.add_argument("--paths", default="blocked",
                        help="comma-separated attention paths to ask for: blocked, flex (compiles per shape: minutes "
                             "on CPU), flash (CUDA with flash-attn); each row says which path served")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per case (median)")
    parser.add_argument("--backward-repeats", type=int, default=2, help="timed forward+backward per case (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/bench_attention")
    args = parser.parse_args()
    rows = run_benchmark(lengths=[int(x) for x in args.lengths.split(",")], methods=args.methods.split(","),
                         paths=tuple(args.paths.split(",")), layers=args.layers, repeats=args.repeats,
                         backward_repeats=args.backward_repeats, threads=args.threads)
    print(format_table(rows))
    for line in refused_kernels():
        print(f"refused by the kernel check: {line}")
    for kind, path in save(rows, args.output_dir).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
