#!/usr/bin/env bash
# The main job, set-up included: patch the real SmolLM2-135M to every method and compare them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python scripts/demo.py "$@"
