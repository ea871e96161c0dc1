"""What one attention call costs in launches on the Triton path (issue 53), a figure the CPU gives honestly: the
Triton kernels launched and the aten operators run (torch.profiler's CPU events) by one forward and one backward of
the distance-table kernel (engine/kernels/triton/table_attention.py) with a learned table, beside native causal
SDPA's, at each length. The count must not grow with the length: every tile runs inside one launch.

On a CPU the Triton kernels run only through the interpreter (TRITON_INTERPRET=1, set here), far too slowly for 8192
tokens, so by default (--execute off) a launch is counted at its call site and not run (the outputs are then
uninitialised; the aten work around the launches runs as it would). --execute runs them (short lengths only).
Prints a markdown table and writes bench_triton_launches.json to --output-dir.

    .venv/bin/python benchmarks/bench_triton_launches.py --lengths 512,8192 --output-dir runs/bench_triton_launches
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from collections import Counter
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

KERNEL_NAMES = ("_forward", "_backward_query", "_backward_key")


class CountedKernel:
    """A Triton kernel whose launches (`kernel[grid](...)`) are counted in `launches`, and run where `execute`."""

    def __init__(self, name, kernel, launches: Counter, execute: bool):
        self.name, self.kernel, self.launches, self.execute = name, kernel, launches, execute

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
            if self.execute:
                self.kernel[grid](*args, **kwargs)
        return launch


def aten_events(function) -> tuple[int, Counter]:
    """(number of aten operator events, the counts by name) that `function()` records on the CPU (nested calls: the
    outermost counted once per call through its own event, as profiler.key_averages lists them)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        function()
    names = Counter(event.name for event in profiler.events() if event.name.startswith("aten::"))
    return sum(names.values()), names


def measure(length: int, execute: bool, heads: int, head_dim: int, device: str) -> dict:
    module = importlib.import_module("hf_posenc.engine.kernels.triton.table_attention")

    generator = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=generator).to(device).requires_grad_(True)  # noqa: E731
    query, key, value = make(1, heads, length, head_dim), make(1, heads, length, head_dim), make(1, heads, length,
                                                                                             head_dim)
    table = make(heads, length)
    positions = torch.arange(length, device=device)[None]
    launches = Counter()
    originals = {name: getattr(module, name) for name in KERNEL_NAMES}
    try:
        for name, kernel in originals.items():
            setattr(module, name, CountedKernel(name, kernel, launches, execute))
        result = {}
        output = None

        def forward():
            nonlocal output
            output = module.table_attention(query, key, value, table, positions, positions)

        result["triton forward aten"], _ = aten_events(forward)
        result["triton forward launches"] = sum(launches.values())
        launches.clear()
        grad = torch.ones_like(output)
        result["triton backward aten"], _ = aten_events(lambda: output.backward(grad))
        result["triton backward launches"] = sum(launches.values())
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)
    native = None

    def native_forward():
        nonlocal native
        native = F.scaled_dot_product_attention(query, key, value, is_causal=True)

    result["sdpa forward aten"], _ = aten_events(native_forward)
    result["sdpa backward aten"], _ = aten_events(lambda: native.backward(torch.ones_like(native)))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,8192")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--execute", action="store_true", help="run the Triton kernels too (slow under the "
                        "interpreter: short lengths only)")
    parser.add_argument("--output-dir", default="runs/bench_triton_launches")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    execute = args.execute or device == "cuda"
    rows = {int(length): measure(int(length), execute, args.heads, args.head_dim, device)
            for length in args.lengths.split(",")}
    columns = list(next(iter(rows.values())))
    print(machine_header())
    print(f"device {device}, torch {torch.__version__}, kernels {'run' if execute else 'counted, not run'}")
    print("| tokens | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for length, row in rows.items():
        print(f"| {length} | " + " | ".join(str(row[column]) for column in columns) + " |")
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench_triton_launches.json").write_text(json.dumps(
        {"device": device, "machine": machine_description(), "torch": torch.__version__, "executed": execute,
         "heads": args.heads, "head_dim": args.head_dim, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
