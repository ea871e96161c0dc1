"""Compiled flex_attention with a learned distance table under Triton kernel options: which options compile on this
machine and how fast each runs forward and backward (the gradient into the table included), against causal SDPA in
the same run. hf_posenc's flex path passes `bias_path.FLEX_CUDA_KERNEL_OPTIONS` on CUDA; this is how that choice
was measured (docs/benchmarks.md, "Flex kernel options on CUDA").

    python benchmarks/bench_flex_options.py --device cuda --lengths 2048,8192 --output-dir runs/flex_options

The problem is SmolLM2-135M's attention by default (9 query and 3 key-value heads of 64, batch 1), one T5-style
table [heads, length] captured by the score_mod, causal block mask. Each row: options, dtype, length, the median
time, its ratio to causal SDPA, the first call's time (compilation) and the table gradient's largest error relative
to the materialised reference in float64; or the error that stopped it (inductor's "No valid triton configs.
OutOfMemoryError" where the tiles ask for more shared memory than the GPU has). The CPU has no flex backward: there
rows time the forward only, and the options are ignored. Prints a table, writes bench_flex_options.json and .png.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import device_name, synchronize  # noqa: E402

from hf_posenc.engine.kernels.check import table_attention_reference  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

OPTIONS = {  # name -> kernel_options for flex_attention (None: inductor's defaults)
    "default": None,
    "num_stages=1": {"num_stages": 1},
    "backward tiles 32": {"BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32},
    "backward tiles 32/64": {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
}


@dataclass
class Row:
    options: str
    dtype: str
    length: int
    native_s: float
    seconds: float = float("nan")
    x_native: float = float("nan")
    first_call_s: float = float("nan")
    table_gradient_error: float | None = None  # None where nothing was differentiated (CPU)
    error: str = ""
    device: str = ""


def _timed(function, repeats: int, device) -> float:
    function()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reference_table_gradient(query, key, value, table, grad_output) -> torch.Tensor:
    """The table's gradient through hf_posenc's own materialised reference (kernel_check.table_attention_reference:
    float64, a [B, H, L, L] bias; some tens of GiB at 8192 tokens, which a GPU that runs this holds)."""
    table = table.detach().clone().requires_grad_()
    output = table_attention_reference(query.detach(), key.detach(), value.detach(), table, 0, None,
                                       query.shape[-1] ** -0.5)
    output.backward(grad_output.transpose(1, 2))
    return table.grad


def run(device: str = "cuda", lengths=(2048, 8192), dtypes=("bfloat16", "float32"), options=tuple(OPTIONS),
        heads: int = 9, kv_heads: int = 3, head_dim: int = 64, repeats: int = 5, progress: bool = True) -> list[Row]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from hf_posenc.tools.progress import progress as progress_bar

    backward = torch.device(device).type != "cpu"
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    jobs = [(dtype, length, name) for dtype in dtypes for length in lengths for name in options]
    problem = None
    with torch._dynamo.config.patch(recompile_limit=64):  # one compile per option, dtype and length
        for dtype_name, length, name in progress_bar(jobs, enabled=progress, desc="bench_flex_options"):
            dtype = getattr(torch, dtype_name)
            if problem is None or problem["key"] != (dtype_name, length):
                generator = torch.Generator().manual_seed(0)

                def tensor(*shape, kind=dtype):
                    return torch.randn(*shape, generator=generator, dtype=kind).to(device)

                query, key, value = (tensor(1, h, length, head_dim).requires_grad_(backward)
                                     for h in (heads, kv_heads, kv_heads))
                table = (0.5 * tensor(heads, length, kind=torch.float32)).requires_grad_(backward)
                grad_output = tensor(1, heads, length, head_dim)

                def native():
                    output = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
                    if backward:
                        output.backward(grad_output)
                reference = (_reference_table_gradient(query, key, value, table, grad_output) if backward else None)
                last = length - 1

                def score_mod(score, b, h, q_idx, kv_idx):
                    return score + table[h, (q_idx - kv_idx).clamp(0, last)]

                blocks = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, length, length,
                                           device=device)
                problem = {"key": (dtype_name, length), "native_s": _timed(native, repeats, device)}
            row = Row(name, dtype_name, length, problem["native_s"], device=device_name(device))

            def flex(kernel_options=None if not backward else OPTIONS[name]):
                output = compiled(query, key, value, score_mod=score_mod, block_mask=blocks, enable_gqa=True,
                                  kernel_options=kernel_options)
                if backward:
                    output.backward(grad_output)
            try:
                start = time.perf_counter()
                table.grad = None
                flex()
                synchronize(device)
                row.first_call_s = time.perf_counter() - start
                if backward:
                    scale = reference.abs().max()
                    row.table_gradient_error = ((table.grad - reference).abs().max() / scale).item()
                row.seconds = _timed(flex, repeats, device)
                row.x_native = row.seconds / row.native_s
            except Exception as error:  # noqa: BLE001 (the row records why these options did not run)
                row.error = f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
            for tensor_ in (query, key, value, table):
                tensor_.grad = None
            rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| options | dtype | L | s | x causal SDPA | first call s | table grad error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.options} | {r.dtype} | {r.length} | failed: {r.error[:160]} |")
        else:
            error = "-" if r.table_gradient_error is None else f"{r.table_gradient_error:.1e}"
            lines.append(f"| {r.options} | {r.dtype} | {r.length} | {r.seconds:.4f} | {r.x_native:.2f} | "
                         f"{r.first_call_s:.1f} | {error} |")
    return "\n".join(lines)


def save(rows: list[Row], output_dir) -> dict[str, Path]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_flex_options.json"}
    machine = machine_description()
    paths["json"].write_text(json.dumps([{**asdict(r), "machine": machine} for r in rows], indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    served = [r for r in rows if not r.error]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.5 * len(rows)), 4.5))
    labels = [f"{r.options}\n{r.dtype} {r.length}" for r in served]
    axis.bar(range(len(served)), [r.x_native for r in served])
    axis.set_xticks(range(len(served)), labels, rotation=60, ha="right", fontsize=7)
    axis.set_ylabel("time / causal SDPA")
    failed = len(rows) - len(served)
    axis.set_title(f"compiled flex with a learned table on {rows[0].device if rows else '?'}"
                   + (f" ({failed} option sets failed to compile)" if failed else ""))
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    paths["png"] = out / "bench_flex_options.png"
    figure.savefig(paths["png"], dpi=120)
    plt.close(figure)
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of: {', '.join(OPTIONS)}")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-dir", default="runs/bench_flex_options")
    args = parser.parse_args(argv)
    unknown = [name for name in args.options.split(",") if name not in OPTIONS]
    if unknown:
        parser.error(f"unknown --options {unknown}; use names from: {', '.join(OPTIONS)}")
    rows = run(args.device, [int(n) for n in args.lengths.split(",")], args.dtypes.split(","),
               args.options.split(","), args.heads, args.kv_heads, args.head_dim, args.repeats)
    print(machine_header())
    print(format_table(rows))
    for kind, path in save(rows, args.output_dir).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
