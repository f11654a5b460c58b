#!/usr/bin/env bash
# The crash-and-resume demo: train, SIGKILL a second run mid-training, resume it, and prove the final
# weights equal (bit for bit) those of a run that never stopped. Arguments go to examples/train.py demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/venv.sh
exec "$ROOT/.venv/bin/python" examples/train.py demo "$@"
