#!/usr/bin/env bash
# Installs everything into .venv and runs the whole test suite (slow cases included); with no arguments, also
# transformers' own model tests on the identity patches (scripts/transformers_tests.sh: 127 s of CPU time measured
# in one process, about 2-4 min on 2 cores), where ../shared/transformers-tests is there. setup_venv.sh's deepspeed
# adds about 10 s to a first install, and its first run about 25 s more (one C++ op compiled, then cached).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
# OMP_NUM_THREADS=1: one thread per test process (see tests/conftest.py), the processes the tests start included.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# -n auto: one test process per CPU core (pytest-xdist, in the test extras); the suite is independent per test.
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -n auto "$@"
fi
status=0
# --durations: the slowest tests, so that a CI run that creeps toward its 30-minute limit shows where the time went.
.venv/bin/python -m pytest -q -n auto --durations=40 || status=$?
if [ -f ../shared/transformers-tests/run.sh ]; then
  bash scripts/transformers_tests.sh || status=$((status ? status : 1))
else
  echo "test.sh: ../shared/transformers-tests is not there: transformers' own model tests NOT run" >&2
fi
exit $status
