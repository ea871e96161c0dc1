"""Rotation benchmark (issue 13): the learned and generalised rotations beside native RoPE on the same LLaMA-style
layer stack as bench_attention.py (8 heads x 64, batch 1), at several lengths: forward and forward+backward time and
peak memory, as ratios to native RoPE in the same run. Reuses bench_attention's model and measurement.

    .venv/bin/python benchmarks/bench_rotations.py --lengths 1024,4096 --output-dir runs/bench_rotations

ComRoPE and LieRE rotate inside the shared attention path (a b x b matrix per block and position: matrix_exp once
per forward, float32, shared by the layers); FoPE and 2-D RoPE are cos/sin pairs that the layers apply as native RoPE does. TAPE is a content method (per-token
position features updated per layer, carried on the KV cache): the content path, per query block.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import _fix_mmap_threshold, build_model, measure  # noqa: E402

from hf_posenc import patch_model, unpatch_model  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

CASES = [("comrope-ap", {"block_size": 2}), ("comrope-ap", {"block_size": 4}), ("comrope-ld", {"block_size": 8}),
         ("liere", {"block_size": 16}), ("liere", {}), ("fope", {}), ("rope-2d", {}), ("tape", {})]


def label(method, options) -> str:
    return method + "".join(f" {key}={value}" for key, value in options.items())


def run(lengths, layers=2, heads=8, head_dim=64, repeats=3, backward_repeats=2, long_from=None, long_cases=None,
        output=None):
    """Every case at every length; from `long_from` tokens on, only the cases labelled in `long_cases` (None: all).
    Rows are written to `output` as they come, so a run stopped early keeps what it measured."""
    _fix_mmap_threshold()
    model = build_model(layers, heads, head_dim, max(lengths))
    rows, machine = [], machine_description()
    print(machine_header(machine), flush=True)
    for length in lengths:
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
        native = measure(model, ids, repeats, backward_repeats)
        rows.append({"method": "native RoPE", "length": length, "forward_s": native[0],
                     "forward_backward_s": native[1], "forward_peak_mib": native[2], "machine": machine})
        print(json.dumps(rows[-1]), flush=True)
        for method, options in CASES:
            if long_from and length >= long_from and long_cases is not None \
                    and label(method, options) not in long_cases:
                continue
            patch_model(model, method, **options)
            forward, backward, peak, _ = measure(model, ids, repeats, backward_repeats)
            unpatch_model(model)
            rows.append({"method": method, "options": options, "length": length, "forward_s": forward,
                         "forward_backward_s": backward, "forward_peak_mib": peak,
                         "forward_ratio": forward / native[0], "forward_backward_ratio": backward / native[1],
                         "extra_forward_mib": peak - native[2], "machine": machine})
            print(json.dumps(rows[-1]), flush=True)
            if output:
                output.write_text(json.dumps(rows, indent=2))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_rotations"),
                        help="where bench_rotations.json is written, row by row (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per case (median)")
    parser.add_argument("--backward-repeats", type=int, default=2, help="timed forward+backward per case (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long-from", type=int, default=None, help="from this length on, only --long-cases")
    parser.add_argument("--long-cases", default=None,
                        help="';'-separated case labels ('comrope-ap block_size=4;liere;fope') for the long lengths")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    long_cases = set(args.long_cases.split(";")) if args.long_cases else None
    args.output_dir.mkdir(parents=True, exist_ok=True)
    output = args.output_dir / "bench_rotations.json"
    rows = run([int(n) for n in args.lengths.split(",")], repeats=args.repeats, backward_repeats=args.backward_repeats,
               long_from=args.long_from, long_cases=long_cases, output=output)
    output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
