#!/usr/bin/env bash
# The whole check, exactly as CI runs it: refresh .venv, then ruff, mypy and the full pytest suite.
#
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k resume -x`). Every step runs even when
# an earlier one fails, so one run shows every problem; the exit status is non-zero if any failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/venv.sh || { echo "scripts/test.sh: could not set up .venv" >&2; exit 1; }
BIN="$ROOT/.venv/bin"
failed=()

echo "== ruff check ."
"$BIN/ruff" check . || failed+=(ruff)

echo "== mypy (strict, per pyproject.toml)"
"$BIN/mypy" || failed+=(mypy)

echo "== pytest"
"$BIN/python" -m pytest -q -p no:cacheprovider -ra --durations=10 --timeout=300 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    # pytest's 5 means "collected nothing": only possible with a selecting argument that matched no test.
    echo "scripts/test.sh: pytest collected no tests for: ${*:-<whole suite>}" >&2
    [ "$#" -gt 0 ] || failed+=(pytest-no-tests)
elif [ "$rc" -ne 0 ]; then
    failed+=(pytest)
fi

if [ "${#failed[@]}" -gt 0 ]; then
    echo "scripts/test.sh: FAILED: ${failed[*]}" >&2
    exit 1
fi
