#!/usr/bin/env bash
# The main job, set-up included: on the real SmolLM2-135M-Instruct (de-quantised from Q4_1), swap RoPE for KERPLE on
# the last 4 layers (YaRN x2 on the others) and distil it briefly from the original on the first 80% of a book, then
# perplexity vs context length of the original, the original + YaRN and the fine-tuned swap on held-out text
# (`hf-posenc main-job`, hf_posenc/tools/main_job.py).
# `--quick` for a short run, `--help` for the options. The texts come from $HF_POSENC_DATA, by default the shared
# folder ../shared/data beside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_POSENC_DATA="${HF_POSENC_DATA:-$(cd .. && pwd)/shared/data}"
exec .venv/bin/python -m hf_posenc main-job "$@"
