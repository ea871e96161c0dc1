"""Time per decoded token of RoPE scalings under a KV cache (see hf_posenc/rope_cache_benchmark.py)."""

import argparse

from hf_posenc.rope_cache_benchmark import run

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--lengths", default="512,1024,2048,4096", help="prompt lengths, comma-separated")
parser.add_argument("--window", type=int, default=1024, help="the model's original window")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--new-tokens", type=int, default=8)
parser.add_argument("--output-dir", default="runs/bench_rope_cache")
args = parser.parse_args()
run(tuple(int(n) for n in args.lengths.split(",")), args.window, args.layers, args.new_tokens, args.output_dir)
