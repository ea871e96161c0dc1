#!/usr/bin/env bash
# The main job, set-up included: on the real SmolLM2-135M, swap RoPE for KERPLE and fine-tune it briefly on the
# first 80% of a book, then perplexity vs context length of the original, the original + YaRN and the fine-tuned
# swap on held-out text (hf_posenc/pipeline.py). `--quick` for a short run, `--help` for the options.
# The per-method swap demo that this command ran before is `.venv/bin/python scripts/demo.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m hf_posenc.tools.main_job "$@"
