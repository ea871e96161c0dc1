"""Attention-path benchmark: a LLaMA-style layer stack (8 heads x 64) with its native RoPE (sdpa) against every
relative-bias method and attention path, at several lengths, batch 1: forward time, forward+backward time and
peak memory, as ratios to native in the same run. Prints a table and writes bench_attention.json and
bench_attention.png to --output-dir.

    .venv/bin/python benchmarks/bench_attention.py --lengths 512,1024 --mode train --output-dir runs/bench_attention

--mode: "train" (the default) times what a fine-tune runs: logits and a cross-entropy loss over every position,
backward through everything; "last-logit" times a prompt's prefill (the last position's logits only, and a backward
from them). Methods take options as on the command line (`alibi:trainable=true`); the default list has every
learned bias (T5, KERPLE, FIRE, trainable ALiBi) beside the fixed ones.

Each row names the path that served its attention calls (`hf_posenc.attention.last_paths`), which is not always
the one asked for: "flex" or "flash" fall back to "blocked" for calls they cannot serve or that the kernel check
refused on this machine (`attention.kernel_status()`), and a method without a bias over a plain causal square takes
SDPA's own causal kernel ("causal"). Native RoPE never enters hf_posenc's attention path: its rows say "sdpa".

Times are taken first, for every case, with the allocator as users have it. Memory is measured afterwards, in a
second pass: on the CPU the resident high-water mark (VmHWM, reset through /proc/self/clear_refs before each
measurement) with glibc's mmap threshold lowered so that freed tensors go back to the system at once and the mark
follows live tensor memory. (That setting makes every freed block a page fault when it is allocated again, a tax on
code that allocates many per-block tensors: timing under it overstated the blocked path's cost, up to 1.56x instead
of 1.17x for T5 at 4096.) On CUDA (--device cuda) times are taken between device synchronisations and peaks are the
allocator's (torch.cuda.max_memory_allocated above the start). "extra" is the peak minus native's; it is compared
with the size of one materialised float32 bias [1, H, L, L].
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
from hf_posenc.tools.machine import machine_description, machine_header

METHODS = ["alibi", "alibi:trainable=true", "fire", "t5", "kerple", "sandwich", "xpos"]
MODES = ("train", "last-logit")
LENGTHS = [512, 1024, 2048, 4096, 8192]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Row:
    method: str  # with its options, as given (`alibi:trainable=true`)
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
    mode: str = "train"
    device: str = "cpu"  # what ran it (the GPU's name on CUDA)
    tuned: dict[str, str] = field(default_factory=dict)  # choices measured on this machine (attention.tuned_choices)


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


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc), so that the resident size is live memory again after the
    timing pass grew the heap."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def device_name(device: torch.device | str | None = None) -> str:
    """What ran a benchmark, for its outputs: the GPU's name, or "cpu"."""
    return torch.cuda.get_device_name() if torch.device(device or "cpu").type == "cuda" else "cpu"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued device work, so that a host clock around a region times the region (no-op on the CPU)."""
    if torch.device(device or "cpu").type == "cuda":
        torch.cuda.synchronize()


def peak_mib(fn, device: torch.device | str | None = None) -> float:
    """Peak memory above the starting point while fn runs: the resident set on the CPU (Linux), the caching
    allocator's allocated bytes on CUDA."""
    if torch.device(device or "cpu").type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        synchronize(device)
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    _trim_heap()
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


def step_functions(model, ids, mode: str):
    """(forward, forward_backward) for `mode` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")

    def forward():
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1 if mode == "last-logit" else 0)

    def forward_backward():
        model.train()
        if mode == "train":
            model(ids, labels=ids, use_cache=False).loss.backward()
        else:
            model(ids, use_cache=False, logits_to_keep=1).logits.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    return forward, forward_backward


def measure_time(model, ids, mode: str, repeats: int, backward_repeats: int) -> tuple[float, float]:
    """Median seconds of a forward and of a forward+backward, after one warm-up of each (and compilation, for
    flex)."""
    model.eval()
    forward, forward_backward = step_functions(model, ids, mode)
    medians = []
    for fn, count in ((forward, repeats), (forward_backward, backward_repeats)):
        if count == 0:  # not measured (bench_content.py --forward-only)
            medians.append(float("nan"))
            continue
        fn()
        times = []
        for _ in range(count):
            synchronize(ids.device)
            start = time.perf_counter()
            fn()
            synchronize(ids.device)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return medians[0], medians[1]


def measure_memory(model, ids, mode: str) -> tuple[float, float]:
    """Peak resident MiB above the start of a forward and of a forward+backward (needs _fix_mmap_threshold)."""
    model.eval()
    forward, forward_backward = step_functions(model, ids, mode)
    forward_backward()  # gradients allocated once, as in the timing pass
    return peak_mib(forward, ids.device), peak_mib(forward_backward, ids.device)


def measure(model, ids, repeats: int, backward_repeats: int, mode: str = "last-logit"):
    """(forward s, forward+backward s, forward peak MiB, forward+backward peak MiB) of one case, times first (for
    scripts that measure a case at a time, such as bench_rotations.py; peaks need _fix_mmap_threshold)."""
    return (*measure_time(model, ids, mode, repeats, backward_repeats), *measure_memory(model, ids, mode))


def run_benchmark(lengths=LENGTHS, methods=METHODS, paths=("blocked",), layers: int = 2, heads: int = 8,
                  head_dim: int = 64, repeats: int = 3, backward_repeats: int = 2, threads: int | None = None,
                  mode: str = "train", memory: bool = True, progress: bool = True, device: str = "cpu",
                  dtype: torch.dtype = torch.float32, on_row=None) -> list[Row]:
    """Run every (method, path) at every length; returns rows with ratios to native RoPE (sdpa). Times first for
    every case, then (with `memory`) peak memory for every case (on the CPU with the mmap threshold lowered).
    ``on_row(rows)`` after every measurement (a run cut short keeps what it measured)."""
    from hf_posenc.tools.progress import progress as progress_bar

    from hf_posenc.tools.runtime import MethodRequest

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    if threads:
        torch.set_num_threads(threads)
    requests = {spec: MethodRequest.parse(spec) for spec in methods}
    for request in requests.values():
        request.check()
    model = build_model(layers, heads, head_dim, max(lengths)).to(device=device, dtype=dtype)
    jobs = [(length, "rope (native)", "sdpa") for length in lengths]
    for length in lengths:
        for method in methods:
            for path in paths:
                if path == "blocked" or requests[method].name != "xpos":  # xPos has no bias table: no flex
                    jobs.append((length, method, path))
    jobs.sort(key=lambda job: job[0])

    def each_job(desc):
        for length, method, path in progress_bar(jobs, enabled=progress, desc=desc):
            ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
            unpatch_model(model)
            if method != "rope (native)":
                requests[method].apply(model)
            attention.last_paths.clear()
            with attention.attention_path(path if path != "sdpa" else "auto"):
                yield length, method, path, ids

    rows: list[Row] = []
    native: dict[int, Row] = {}
    for length, method, path, ids in each_job(f"bench_attention ({mode}): time"):
        forward_s, backward_s = measure_time(model, ids, mode, repeats, backward_repeats)
        calls = Counter(attention.last_paths)
        row = Row(method, served_path(calls), path, length, forward_s, backward_s, float("nan"), float("nan"),
                  dict(calls), mode=mode, device=device_name(device), tuned=attention.tuned_choices(model))
        if method == "rope (native)":
            native[length] = row
        row.forward_ratio = forward_s / native[length].forward_s
        row.forward_backward_ratio = backward_s / native[length].forward_backward_s
        rows.append(row)
        if on_row:
            on_row(rows)
    if memory:
        _fix_mmap_threshold()
        for row, (length, method, path, ids) in zip(rows, each_job(f"bench_attention ({mode}): memory")):
            row.forward_peak_mib, row.forward_backward_peak_mib = measure_memory(model, ids, mode)
            base = native[length]
            row.extra_forward_mib = row.forward_peak_mib - base.forward_peak_mib
            row.extra_vs_materialised_bias = row.extra_forward_mib / (heads * length * length * 4 / 2**20)
            if device != "cpu":
                torch.cuda.empty_cache()
            if on_row:
                on_row(rows)
    unpatch_model(model)
    return rows


def format_table(rows: list[Row]) -> str:
    """A markdown table; the path column says what served, and what was asked for when that differs."""
    lines = ["| method | path | L | forward s | x native | fwd+bwd s | x native | fwd+bwd peak MiB | extra fwd peak MiB "
             "| % of bias |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        path = r.path if r.path == r.requested_path else f"{r.path} ({r.requested_path} asked)"
        lines.append(f"| {r.method} | {path} | {r.length} | {r.forward_s:.3f} | {r.forward_ratio:.2f} | "
                     f"{r.forward_backward_s:.3f} | {r.forward_backward_ratio:.2f} | {r.forward_backward_peak_mib:.0f} | "
                     f"{r.extra_forward_mib:.0f} | "
                     f"{100 * r.extra_vs_materialised_bias:.1f}% |")
    return "\n".join(lines)


def refused_kernels() -> list[str]:
    """One line per kernel the kernel check refused in this process (the blocked path served it instead)."""
    return [f"{v.kernel} on {v.device}: {v.detail}" for v in attention.kernel_status() if not v.passed]


def save(rows: list[Row], output_dir: str | Path, name: str = "bench_attention",
         plot: bool = True) -> dict[str, Path]:
    """``name``.json and ``name``.png (the ratios to native and the extra memory per method) in ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    machine = machine_description()
    json_path.write_text(json.dumps([{**asdict(r), "machine": machine} for r in rows], indent=2))
    paths = {"json": json_path}
    if not plot:
        return paths
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
    png = out / f"{name}.png"
    figure.savefig(png, dpi=120)
    plt.close(figure)
    paths["png"] = png
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--methods", default=";".join(METHODS),
                        help="semicolon-separated methods, with options as on the command line "
                             "(default %(default)s)")
    parser.add_argument("--mode", default="train", choices=MODES,
                        help="train: loss over every position; last-logit: a prefill's last logits (default "
                             "%(default)s)")
    parser.add_argument("--no-memory", action="store_true", help="times only (no second pass for peak memory)")
    parser.add_argument("--paths", default="blocked",
                        help="comma-separated attention paths to ask for: blocked, flex (compiles per shape: minutes "
                             "on CPU), flash (CUDA with flash-attn); each row says which path served")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per case (median)")
    parser.add_argument("--backward-repeats", type=int, default=2, help="timed forward+backward per case (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and activations dtype")
    parser.add_argument("--output-dir", default="runs/bench_attention")
    args = parser.parse_args()
    rows = run_benchmark(device=args.device, dtype=DTYPES[args.dtype],
                         lengths=[int(x) for x in args.lengths.split(",")], methods=args.methods.split(";"),
                         paths=tuple(args.paths.split(",")), layers=args.layers, repeats=args.repeats,
                         backward_repeats=args.backward_repeats, threads=args.threads, mode=args.mode,
                         memory=not args.no_memory,
                         on_row=lambda so_far: save(so_far, args.output_dir, plot=False))
    print(machine_header())
    print(format_table(rows))
    for line in refused_kernels():
        print(f"refused by the kernel check: {line}")
    for kind, path in save(rows, args.output_dir).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
