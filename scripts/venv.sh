#!/usr/bin/env bash
# Create or refresh the project's virtualenv (.venv) so the demo and the tests run on a fresh machine.
#
# torch is installed first and pinned in every pip call: an unpinned torch would pull a multi-GB CUDA
# build, and a later resolver run could otherwise upgrade it. A stamp file holding a hash of every
# pyproject.toml (and of this script) makes the refresh a no-op when nothing changed.
#
# Environment: PYTHON (interpreter that creates the venv, default python3), VENV (default .venv),
# TORCH_SPEC (default torch==2.13.0), CM_VENV_FORCE=1 to reinstall even when the stamp matches.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="dev,data,hf,s3,cli,yaml,lightning,bench"
STAMP="$VENV/.checkpoint-manager-stamp"

log() { printf '[venv] %s\n' "$*" >&2; }

# Every plugin is its own package (plugins/<name>/pyproject.toml), installed editable beside the core.
plugin_dirs=()
for pyproject in plugins/*/pyproject.toml; do
    [ -f "$pyproject" ] && plugin_dirs+=("$(dirname "$pyproject")")
done

fingerprint() {
    {
        echo "$TORCH_SPEC $EXTRAS"
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
        cat scripts/venv.sh scripts/constraints.txt pyproject.toml
        for dir in "${plugin_dirs[@]+"${plugin_dirs[@]}"}"; do
            echo "$dir"
            cat "$dir/pyproject.toml"
        done
    } | sha256sum | cut -d' ' -f1
}

# A venv copied from another path, or built by a removed interpreter, has a python that no longer runs.
if [ -e "$VENV" ] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    log "$VENV is broken; recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

want="$(fingerprint)"
if [ "${CM_VENV_FORCE:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q -c scripts/constraints.txt)
log "installing $TORCH_SPEC"
"${PIP[@]}" "$TORCH_SPEC"
log "installing checkpoint-manager[$EXTRAS] (editable)${plugin_dirs[*]+ and plugins: ${plugin_dirs[*]}}"
editables=(-e ".[$EXTRAS]")
# A plugin whose requires-python this interpreter does not meet (torchtitan's needs 3.11) is left out.
python_fits() {
    "$VENV/bin/python" - "$1/pyproject.toml" <<'PY'
import platform
import re
import sys

from pip._vendor.packaging.specifiers import SpecifierSet

found = re.search(r'^requires-python\s*=\s*"([^"]+)"', open(sys.argv[1], encoding="utf-8").read(), re.M)
sys.exit(0 if found is None or platform.python_version() in SpecifierSet(found.group(1)) else 1)
PY
}
for dir in "${plugin_dirs[@]+"${plugin_dirs[@]}"}"; do
    if ! python_fits "$dir"; then
        log "skipping $dir: its requires-python excludes Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')"
        continue
    fi
    editables+=(-e "$dir")
done
"${PIP[@]}" "$TORCH_SPEC" "${editables[@]}"
"$VENV/bin/python" - "$TORCH_SPEC" <<'PY'
import sys

import torch

want = sys.argv[1].split("==", 1)[1]
if torch.__version__.split("+", 1)[0] != want:
    sys.exit(f"[venv] expected torch {want}, found {torch.__version__}")
PY
echo "$want" >"$STAMP"
log "ready: $VENV"
