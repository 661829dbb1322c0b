#!/usr/bin/env bash
# The test suite CI runs, from a fresh machine: makes its own venv, installs what the tests need,
# runs everything that needs no GPU (unit, release build + wheel checks, end-to-end pip installs).
#   scripts/test.sh                      # all of it (~15 min on 2 cores, first run longer)
#   scripts/test.sh -m "not e2e and not build"   # the fast unit tests only
# GPU tests (marker gpu) run on a GPU machine: pytest -m gpu tests/gpu, with cudelta installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDELTA_TEST_CACHE="${CUDELTA_TEST_CACHE:-$PWD/.ci-cache}"
runner="$CUDELTA_TEST_CACHE/venvs/runner"
reqs="pytest>=8 responses>=0.25 requests packaging urllib3 filelock platformdirs wheel setuptools torch==2.13.0 nvidia-cuda-cuobjdump abi3audit torch-abi-audit uv"
if [ ! -x "$runner/bin/python" ] || [ "$(cat "$runner/.reqs" 2>/dev/null)" != "$reqs" ]; then
    python3 -m venv --clear "$runner"
    # shellcheck disable=SC2086
    "$runner/bin/python" -m pip install -q $reqs
    echo "$reqs" > "$runner/.reqs"
fi
markers="not gpu"
if [ "${1:-}" = "-m" ]; then markers="$2"; shift 2; fi
exec "$runner/bin/python" -m pytest -m "$markers" -p no:cacheprovider -rs "$@"
