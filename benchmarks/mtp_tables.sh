#!/usr/bin/env bash
# The results files' 3-process tables in one device call: this checkout built for the GPU at hand,
# the multi-token GPU tests on that build, then mtp_bench.py at each head shape (vLLM's CUDA op and
# its Triton port beside cudelta; carry .peers/cuda_op and .peers/vllm_fla, from fetch_vllm_ops.py).
#
#   bash benchmarks/mtp_tables.sh      # on the GPU machine, from the repo root
#
# Environment: HEADS (16/32 4/8 32/32 16/64), PROCS (3), TESTS (tests/gpu/test_mtp_gpu.py; "none"
# skips them), ARCH (9.0a), STOP_AFTER (seconds: no new head shape starts past it; 400, so that a
# call stays inside the device's 10-minute limit), BUILD (a folder to build into, which a later call
# on a still-warm machine reuses: the build is skipped when it already holds cudelta). What comes
# back, in $OUT or /tmp/tables: tests.txt, mtp-H-HV.md a head shape, and numbers.tar.gz, their
# per-process numbers (mtp-H-HV.json, what mtp_bench.py writes beside its tables; one archive since
# the device returns at most 8 files). Exits 1 when the tests fail or a head shape's run does (what
# did finish still comes back).
# Two such runs side by side, targets and moved cells: benchmarks/mtp_compare.py.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/tables}; work=$(mktemp -d); mkdir -p "$out"
build=${BUILD:-$work/build}
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
if [ -d "$build/cudelta" ]; then
  echo "build reused from $build"
else
  CUDELTA_CUDA_ARCHS=${ARCH:-9.0a} FORCE_BUILD=1 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps --no-index \
    -q --target "$build" . > "$work/build.log" 2>&1 || { tail -20 "$work/build.log"; exit 1; }
  echo "build $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$build"
status=0
if [ "${TESTS:-}" != none ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths and pytest options
  python3 -P -m pytest -m gpu ${TESTS:-tests/gpu/test_mtp_gpu.py} -q -p no:cacheprovider > "$out/tests.txt" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  echo "tests rc=$rc at $(( $(date +%s) - t0 )) s: $(tail -1 "$out/tests.txt")"
fi
for heads in ${HEADS:-16/32 4/8 32/32 16/64}; do
  if [ $(( $(date +%s) - t0 )) -gt "${STOP_AFTER:-400}" ]; then echo "stopped before $heads (STOP_AFTER)"; break; fi
  tag=${heads/\//-}
  python3 -P benchmarks/mtp_bench.py --heads "$heads" --procs "${PROCS:-3}" --out "$work/mtp-$tag.md" > "$work/mtp-$tag.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  [ -f "$work/mtp-$tag.md" ] && cp "$work/mtp-$tag.md" "$out/"
  echo "mtp $heads rc=$rc at $(( $(date +%s) - t0 )) s"
  grep "^- never slower" "$out/mtp-$tag.md" 2>/dev/null | cut -c1-200 || tail -5 "$work/mtp-$tag.log"
done
(cd "$work" && find . -maxdepth 1 -name 'mtp-*.json' -printf '%f\n' | sort | tar -czf "$out/numbers.tar.gz" -T -)
exit "$status"
