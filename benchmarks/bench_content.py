"""Content-method benchmark: the LLaMA-style stack of bench_attention.py (8 heads x 64, 2 layers, batch 1) with its
native RoPE under causal SDPA against each content-dependent method (`fox`, `stick-breaking`, `cope`,
`transformer-xl`, `cape`, base="none", served by the shared attention path per query block), at several lengths:
forward time, forward+backward time and peak memory, as ratios to native in the same run. Prints a table and writes
bench_content.json and bench_content.png to --output-dir (--device cuda: on a GPU).

    .venv/bin/python benchmarks/bench_content.py --lengths 1024,2048,4096 --output-dir runs/bench_content
    .venv/bin/python benchmarks/bench_content.py --lengths 8192 --forward-only --repeats 1 --output-dir runs/bench_content_8192

Measurement as in bench_attention.py (median times, resident high-water mark above the start for peak memory);
"% of bias" is the extra forward peak over native relative to one materialised float32 [1, H, L, L] tensor.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import DTYPES, format_table, run_benchmark, save  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

METHODS = ["fox", "stick-breaking", "cope", "transformer-xl", "cape"]
LENGTHS = [1024, 2048, 4096]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated content methods")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per case (median)")
    parser.add_argument("--backward-repeats", type=int, default=2, help="timed forward+backward per case (median)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward only (no forward+backward, no memory pass): for long lengths")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--output-dir", default="runs/bench_content")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):  # one length at a time, written as it completes
        rows += run_benchmark(lengths=[length], methods=args.methods.split(","), paths=("blocked",),
                              layers=args.layers, repeats=args.repeats,
                              backward_repeats=0 if args.forward_only else args.backward_repeats,
                              threads=args.threads, memory=not args.forward_only, progress=False,
                              device=args.device, dtype=DTYPES[args.dtype])
        (out / "bench_content.json").write_text(json.dumps([{**asdict(r), "machine": machine_description()}
                                                            for r in rows], indent=2))
        print(machine_header())
        print(format_table(rows), flush=True)
    for kind, path in save(rows, out, "bench_content").items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
