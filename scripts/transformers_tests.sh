#!/usr/bin/env bash
# transformers' own model tests (../shared/transformers-tests) against patched models, checked against the declared
# expected failures (tests/transformers_expected_failures.py): exit 1 on a failure not declared, or on a declared
# failure that passes now.
# usage: bash scripts/transformers_tests.sh            the identity patches (llama:rope gpt2:learned bloom:alibi); CI
#        bash scripts/transformers_tests.sh --all      those and the 5 other methods triaged (8 runs: about 3x the time)
#        bash scripts/transformers_tests.sh FAMILY:METHOD ...
set -uo pipefail
cd "$(dirname "$0")/.."
suite=${TRANSFORMERS_TESTS:-../shared/transformers-tests}  # the variable: another copy of the suite
if [ ! -f "$suite/run.sh" ]; then
  echo "transformers_tests.sh: $suite/run.sh not found; it holds transformers' model tests (see its README)" >&2
  exit 2
fi
export OUT=${OUT:-$PWD/runs/transformers-tests} PYTHON=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$OUT"
identity=(llama:rope gpt2:learned bloom:alibi)
others=(llama:alibi llama:t5 gpt2:alibi gpt2:rope bloom:rope)
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then cases=("${identity[@]}"); fi
if [ "${cases[0]}" = --all ]; then cases=("${identity[@]}" "${others[@]}"); fi
reports=()
for case in "${cases[@]}"; do
  name="${case%%:*}-${case##*:}"
  rm -f "$OUT/$name.xml"  # a run that stops before writing its report must not be checked on an old one
  bash "$suite/run.sh" "${case%%:*}" "${case##*:}" > "$OUT/$name.log" 2>&1
  echo "$case: $(tail -n 1 "$OUT/$name.log")  (log: $OUT/$name.log)"
  reports+=("$OUT/$name.xml")
done
exec "$PYTHON" tests/transformers_expected_failures.py "${reports[@]}"
