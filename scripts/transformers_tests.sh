#!/usr/bin/env bash
# transformers' own model tests against the identity patches (llama+rope, gpt2+learned, bloom+alibi), checked
# against the declared expected failures (tests/transformers_expected_failures.py).
# usage: bash scripts/transformers_tests.sh [FAMILY:METHOD ...]   (needs the suite in ../shared/transformers-tests)
set -uo pipefail
cd "$(dirname "$0")/.."
suite=../shared/transformers-tests
if [ ! -f "$suite/run.sh" ]; then
  echo "transformers_tests.sh: $suite/run.sh not found; it holds transformers' model tests (see its README)" >&2
  exit 2
fi
export OUT=${OUT:-$PWD/runs/transformers-tests} PYTHON=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$OUT"
cases=("$@"); [ ${#cases[@]} -gt 0 ] || cases=(llama:rope gpt2:learned bloom:alibi)
reports=()
for case in "${cases[@]}"; do
  bash "$suite/run.sh" "${case%%:*}" "${case##*:}" > "$OUT/${case%%:*}-${case##*:}.log" 2>&1 || true
  tail -n 1 "$OUT/${case%%:*}-${case##*:}.log"
  reports+=("$OUT/${case%%:*}-${case##*:}.xml")
done
exec "$PYTHON" tests/transformers_expected_failures.py "${reports[@]}"
