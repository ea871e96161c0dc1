#!/usr/bin/env bash
# The GPU checks still open on issues 17, 53 (Triton kernels) and 54 (FSDP2 through accelerate): the tests of the paths that differ off the CPU (`--device cuda`), the compiled
# content blocks' tests, flex against blocked for learned tables in bf16, the compiled content path, Sandwich under
# CUDA graphs (reduce-overhead failed with a bare AssertionError on an H100; bench_finetune now prints the traceback),
# xPos in bf16 (one causal flash call per layer since 843d734: its attention calls should read "causal"), and the
# 512-token step without per-layer reads of tensor values. Each stage, in order of priority, has its own time limit
# (about 14 minutes in all) and writes under OUT (default runs/gpu_checks) as it goes. A lent GPU session has 15
# minutes, start included, and 10 per call: run it with `timeout_s` 600 and read what the stages that fit wrote.
#
#     bash scripts/gpu_checks.sh [OUT]
#
# It uses the python3 it finds (the GPU machine's own torch), with this checkout on PYTHONPATH; wheels in .whl/
# (transformers 5.23.0, say, where the machine has an older one) are installed first into a private folder:
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.23.0
# What the runs printed (torch 2.11): docs/benchmarks.md, "Fine-tune throughput" (On GPUs) and "Known gaps".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-runs/gpu_checks}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hf_posenc_site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/hf_posenc_site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
started=$(date +%s)
stage() { echo "=== $(( $(date +%s) - started )) s: $*"; }

stage versions
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
'transformers', transformers.__version__, torch.cuda.get_device_name())"

stage "tests on cuda (docs/attention-paths.md, On a GPU)"
timeout 100 python3 -m pytest -q -p no:cacheprovider --device cuda tests/test_table_attention.py \
  tests/test_content_methods.py tests/test_kernel_check.py \
  -k "backward_equals or recomputed or gradients_equal or training_step_gradients or learned_table" \
  > "$OUT/tests_cuda.log" 2>&1
tail -5 "$OUT/tests_cuda.log"
stage "Triton table, CoPE and CAPE kernels on cuda (issue 53): tests, launches, op-level and fine-tune timing against blocked"
timeout 300 python3 -m pytest -q -p no:cacheprovider --device cuda tests/test_triton_table_attention.py \
  tests/test_triton_path.py tests/test_triton_cope.py tests/test_triton_cape.py \
  > "$OUT/tests_triton_cuda.log" 2>&1
tail -5 "$OUT/tests_triton_cuda.log"
timeout 60 python3 benchmarks/bench_triton_launches.py --lengths 512,8192 --output-dir "$OUT/triton_launches" 2>&1 \
  | grep -E '^\||^device'
timeout 150 python3 benchmarks/bench_attention.py --device cuda --mode train --lengths 4096,16384 \
  --paths blocked,triton --layers 2 --dtype bfloat16 --methods "alibi:trainable=true;t5;kerple;fire;sandwich" \
  --output-dir "$OUT/triton_bf16" 2>&1 | tr '\r' '\n' | grep -E '^\||refused|Error' | grep -v 'it/s'
# CoPE's Triton kernel in bfloat16 (the interpreter's bfloat16 products are wrong: only a GPU checks it); its kernel
# check against the blocked path prints "refused" where it fails.
timeout 90 python3 benchmarks/bench_attention.py --device cuda --mode train --lengths 4096 --paths blocked,triton \
  --layers 2 --dtype bfloat16 --methods "cope" --output-dir "$OUT/triton_cope_bf16" 2>&1 | tr '\r' '\n' \
  | grep -E '^\||refused|Error' | grep -v 'it/s'
timeout 120 python3 benchmarks/bench_attention.py --device cuda --mode train --lengths 4096 \
  --paths blocked,triton --layers 2 --dtype bfloat16 --methods "cape" \
  --output-dir "$OUT/triton_cape_bf16" 2>&1 | tr '\r' '\n' | grep -E '^\||refused|Error' | grep -v 'it/s'
stage "FSDP2 through accelerate on the GPUs (issue 54): fsdp.yaml trains and saves a patched tiny LLaMA"
timeout 150 python3 -m pytest -q -p no:cacheprovider --device cuda tests/tools/test_fsdp2.py -k runs_fsdp2_on_gpus \
  > "$OUT/tests_fsdp2_cuda.log" 2>&1
tail -5 "$OUT/tests_fsdp2_cuda.log"
stage "compiled content tests on cuda (each compiles for a minute or more)"
timeout 180 python3 -m pytest -q -p no:cacheprovider --device cuda tests/test_compiled_content.py -k train_like \
  > "$OUT/tests_compiled_cuda.log" 2>&1
tail -5 "$OUT/tests_compiled_cuda.log"

bench() {  # NAME SECONDS ARGS...: one bench_finetune run into $OUT/NAME; its table and tracebacks, no progress bars
  local name=$1 seconds=$2; shift 2
  stage "bench_finetune $name: $*"
  timeout "$seconds" python3 benchmarks/bench_finetune.py --steps 3 --checkpointing no --mixed-precision bf16 \
    --output-dir "$OUT/$name" "$@" 2>&1 | tr '\r' '\n' | grep -E '^\||refused|not used|Error|^  File' | grep -v 'it/s'
}
# Issue 53: what serves Transformer-XL, TAPE, Self-Extend and ReRoPE on a GPU (docs/attention-paths.md, "What serves
# the other content methods on a GPU"), tokens/s over native RoPE's in the same run.
bench other_content_gpu 120 --layers 30 --lengths 4096 --methods "transformer-xl;tape;self-extend;rerope"
stage "flex against blocked for learned tables, bf16 (FLEX_CUDA_KERNEL_OPTIONS)"
timeout 120 python3 benchmarks/bench_attention.py --device cuda --mode train --lengths 2048,8192 \
  --paths blocked,flex --layers 2 --dtype bfloat16 --methods "t5;fire" --output-dir "$OUT/flex_bf16" 2>&1 \
  | tr '\r' '\n' | grep -E '^\||refused|Error' | grep -v 'it/s'
stage "flex's Triton options in float32 at 8192 (bench_flex_options.py)"
timeout 90 python3 benchmarks/bench_flex_options.py --lengths 8192 --dtypes float32 --options "default,num_stages=1" \
  --output-dir "$OUT/flex_options" 2>&1 | tr '\r' '\n' | grep -E '^\|'
bench compiled_path 120 --layers 4 --lengths 2048 --methods "cope;stick-breaking" --attention-path compiled
bench compile_reduce_overhead 100 --layers 2 --lengths 512 --methods "sandwich" --compile inductor \
  --compile-fullgraph --compile-mode reduce-overhead
bench xpos_bf16 60 --layers 2 --lengths 4096 --methods "xpos"
# No reads of tensor values per layer since f324afb (docs/attention-paths.md, "Reads of tensor values"): against the
# H200's 512-token column of 2026-11-26 (trainable ALiBi 0.74, FIRE 0.61, FoX 0.64, sinks 0.57, xPos 0.74).
bench host_reads_512 90 --layers 30 --lengths 512 --methods "alibi:trainable=true;fire;fox;sinks;xpos"
# The device tool brings back at most 8 files: the two logs and the JSON, not the plots.
find "$OUT" -name '*.png' -delete
stage done
