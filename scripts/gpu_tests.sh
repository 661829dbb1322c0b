#!/usr/bin/env bash
# The GPU tests (marker gpu), as .github/workflows/gpu-tests.yml runs them on a self-hosted GPU
# runner: a venv with torch, cudelta compiled for the GPUs present (FORCE_BUILD=1), pytest -m gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$PWD/.ci-cache/venvs/gpu"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch>=2.10" "pytest>=8"
FORCE_BUILD=1 "$venv/bin/python" -m pip install -v --force-reinstall --no-deps .
# The pytest script, not `python -m pytest`: the source tree's cudelta/ must not shadow the install.
exec "$venv/bin/pytest" -m gpu tests/gpu -p no:cacheprovider -rs "$@"
