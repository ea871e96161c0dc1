#!/usr/bin/env bash
# The GPU checks of issue 17 in one run of about 7 minutes on an H200 (a lent GPU session has 15 minutes in all):
# the tests of the paths that differ off the CPU (`--device cuda`), the fine-tune step of the content methods and
# Sandwich at the real depth, the compiled content path, and the whole step under torch.compile (fullgraph, then
# reduce-overhead). Each stage has its own time limit and writes under OUT (default runs/gpu_checks) as it goes.
#
#     bash scripts/gpu_checks.sh [OUT]
#
# It uses the python3 it finds (the GPU machine's own torch), with this checkout on PYTHONPATH; wheels in .whl/
# (transformers 5.23.0, say, where the machine has an older one) are installed first into a private folder:
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.23.0
# What it printed on 2026-11-27 (H200, torch 2.11): docs/benchmarks.md, "On an H200 (CUDA), 2026-11-27".
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
timeout 240 python3 -m pytest -q -p no:cacheprovider --device cuda tests/test_table_attention.py \
  tests/test_content_methods.py tests/test_compiled_content.py \
  -k "backward_equals or recomputed or gradients_equal or training_step_gradients or train_like" \
  > "$OUT/tests_cuda.log" 2>&1
tail -5 "$OUT/tests_cuda.log"

bench() {  # NAME SECONDS ARGS...: one bench_finetune run into $OUT/NAME; its table, without the progress bars
  local name=$1 seconds=$2; shift 2
  stage "bench_finetune $name: $*"
  timeout "$seconds" python3 benchmarks/bench_finetune.py --steps 3 --checkpointing no --mixed-precision bf16 \
    --output-dir "$OUT/$name" "$@" 2>&1 | tr '\r' '\n' | grep -E '^\||refused|not used|Error' | grep -v 'it/s'
}
bench content_30_layers 200 --layers 30 --lengths 512,2048,4096 --methods "cope;stick-breaking;cape;fox;sandwich"
bench compiled_path 150 --layers 4 --lengths 2048 --methods "cope;stick-breaking" --attention-path compiled
bench compile_fullgraph 120 --layers 4 --lengths 2048 --methods "t5;sandwich" --compile inductor --compile-fullgraph
bench compile_reduce_overhead 120 --layers 4 --lengths 512 --methods "alibi;sandwich" --compile inductor \
  --compile-fullgraph --compile-mode reduce-overhead
# The device tool brings back at most 8 files: the log, four JSON and the 30-layer plot.
find "$OUT" -name '*.png' ! -path '*content_30_layers*' -delete
stage done
