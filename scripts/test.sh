#!/usr/bin/env bash
# Installs everything into .venv and runs the whole test suite (slow cases included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# -n auto: one test process per CPU core (pytest-xdist, in the test extras); the suite is independent per test.
exec .venv/bin/python -m pytest -q -n auto "$@"
