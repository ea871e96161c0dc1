"""Benchmark the attention paths: native RoPE (sdpa) against every relative-bias method and path.

    .venv/bin/python scripts/bench_attention.py --lengths 512,1024 --out runs/bench
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_posenc.benchmark import LENGTHS, METHODS, format_table, run_benchmark, save  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    parser.add_argument("--paths", default="blocked",
                        help="comma-separated attention paths: blocked, flex (flex compiles per shape: minutes on CPU)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per case (median)")
    parser.add_argument("--backward-repeats", type=int, default=2, help="timed forward+backward per case (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="runs/bench_attention")
    args = parser.parse_args()
    rows = run_benchmark(lengths=[int(x) for x in args.lengths.split(",")], methods=args.methods.split(","),
                         paths=tuple(args.paths.split(",")), layers=args.layers, repeats=args.repeats,
                         backward_repeats=args.backward_repeats, threads=args.threads)
    print(format_table(rows))
    for kind, path in save(rows, args.out).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
