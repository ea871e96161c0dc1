"""Op-level benchmark of the learned-table attention (hf_posenc/engine/attention/table_attention.py): one attention call's
forward + backward, 8 heads x 64, float32, batch 1, a [H, L] distance table with a gradient, against native causal
SDPA's forward + backward in the same process. The cases run interleaved (A/B/A/B...), after one warm-up each; the
table prints the minimum and median over --runs and their ratios to native. Writes bench_table_attention.json to
--output-dir.

    .venv/bin/python benchmarks/bench_table_attention.py --lengths 4096,8192 --threads 2 --runs 3 \
        --key-tiles 256,512 --reference main=/tmp/table_attention_main.py --output-dir runs/bench_table_attention

--key-tiles: the backward's KEY_TILE values to time (one case each). --reference NAME=PATH: another version of
table_attention.py (e.g. `git show main:hf_posenc/engine/attention/table_attention.py > PATH`), timed as a case of its own;
its forward and backward are that file's, the blocks are this library's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hf_posenc import attention
from hf_posenc.engine.attention import table_attention
from hf_posenc.tools.machine import machine_description, machine_header


def load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"_reference_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


def case(length: int, function, key_tile: int | None, heads: int = 8, head_dim: int = 64, step: int = 256,
         plan=None, fixed: bool = False):
    """A callable timing one forward + backward (returns seconds) of `function` (None: native causal SDPA; "sdpa
    blocks": SDPA per query block with the block's bias view as its mask, autograd's backward, what a fixed table
    takes on the CPU without the table backward). plan: TableBiasAttention's (a BackwardPlan, or a dict to measure one
    into). fixed: the table takes no gradient (fixed ALiBi, Sandwich in training)."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, head_dim, generator=generator, requires_grad=True)
                         for _ in range(3))
    table = (torch.randn(heads, length, generator=generator) * 0.1).requires_grad_(not fixed)
    if fixed:  # ALiBi's table: -slope x distance, slopes 2^-1 .. 2^-8 (its far keys' probabilities underflow)
        slopes = 2.0 ** -torch.arange(1, heads + 1, dtype=torch.float32)
        table = -slopes[:, None] * torch.arange(length, dtype=torch.float32)
    grad_output = torch.randn(1, heads, length, head_dim, generator=generator)
    blocks = [(rows.start, rows.stop - rows.start, rows.stop, step + rows.start - rows.stop + 1)
              for rows in attention.query_blocks(torch.arange(length)[None], step)]  # as blocked_attention makes

    def run() -> float:
        if key_tile is not None:
            table_attention.KEY_TILE = key_tile
        start = time.perf_counter()
        if function is None:
            output = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        elif function == "sdpa blocks":
            padded = attention.padded_table(table, step, torch.float32)
            flipped_key, flipped_value = key.flip(2), value.flip(2)
            output = torch.cat([F.scaled_dot_product_attention(
                query[:, :, first:first + rows], flipped_key[:, :, length - keys:], flipped_value[:, :, length - keys:],
                attn_mask=attention.toeplitz_view(padded, step, first, rows, keys)[None], scale=head_dim**-0.5)
                for first, rows, keys, _ in blocks], dim=2)
        else:
            padded = attention.padded_table(table, step, torch.float32)
            extra = () if plan is None else (plan,)  # a --reference's apply may take no plan
            output = function.apply(query, key.flip(2), value.flip(2), padded, blocks, head_dim**-0.5, *extra)
        output.backward(grad_output)
        for tensor in (query, key, value, table):
            tensor.grad = None
        return time.perf_counter() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--key-tiles", default=str(table_attention.KEY_TILE))
    parser.add_argument("--reference", action="append", default=[], help="NAME=PATH of another table_attention.py")
    parser.add_argument("--plans", choices=("measured", "all", "none"), default="measured",
                        help="measured: the plan the backward picks on this machine (timed at its first call); all: "
                             "that and every candidate plan forced; none: only the --key-tiles cases")
    parser.add_argument("--fixed", action="store_true",
                        help="a fixed ALiBi table (no gradient): also times SDPA per block with the bias as a mask")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output-dir", default="runs/bench_table_attention")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    default_tile = table_attention.KEY_TILE
    cases = {"native (causal SDPA)": (None, None)}
    for spec in args.reference:
        name, path = spec.split("=", 1)
        cases[name] = (load_module(name, path).TableBiasAttention, None)
    for tile in map(int, args.key_tiles.split(",")):
        cases[f"table, KEY_TILE={tile}"] = (table_attention.TableBiasAttention, tile)
    if args.fixed:
        cases["sdpa blocks, bias as the mask"] = ("sdpa blocks", None)
    machine = machine_description()
    print(machine_header(machine))
    results = []
    for length in map(int, args.lengths.split(",")):
        tuned, plans = {}, {}
        if args.plans != "none":
            plans["table, measured plan"] = tuned
        if args.plans == "all":
            plans.update({f"table, {plan.describe()}": plan for plan in table_attention.candidate_plans()})
        runs = {name: case(length, function, tile, fixed=args.fixed) for name, (function, tile) in cases.items()}
        runs.update({name: case(length, table_attention.TableBiasAttention, None, plan=plan, fixed=args.fixed)
                     for name, plan in plans.items()})
        for run in runs.values():
            run()  # warm-up
        times = {name: [] for name in runs}
        loads = [os.getloadavg()[0]]
        for _ in range(args.runs):
            for name, run in runs.items():
                times[name].append(run())
            loads.append(os.getloadavg()[0])
        table_attention.KEY_TILE = default_tile
        native = times["native (causal SDPA)"]
        picked = {", ".join(map(str, kind)): plan.describe() for kind, plan in tuned.items()}
        print(f"L={length}  1-min load average during the runs: {min(loads):.2f}-{max(loads):.2f}"
              + "".join(f"; measured plan ({kind}): {plan}" for kind, plan in picked.items()))
        print("| case | min s | median s | min x native | median x native |")
        print("| --- | --- | --- | --- | --- |")
        for name, values in times.items():
            row = {"length": length, "case": name, "times_s": values, "min_s": min(values),
                   "median_s": statistics.median(values), "min_ratio": min(values) / min(native),
                   "median_ratio": statistics.median(values) / statistics.median(native),
                   "load_average": [min(loads), max(loads)], "threads": torch.get_num_threads(),
                   "fixed_table": args.fixed, "measured_plan": picked, "machine": machine}
            results.append(row)
            print(f"| {name} | {row['min_s']:.3f} | {row['median_s']:.3f} | {row['min_ratio']:.2f} | "
                  f"{row['median_ratio']:.2f} |", flush=True)
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench_table_attention.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
