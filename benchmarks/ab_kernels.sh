#!/usr/bin/env bash
# A/B of kernel trees on one GPU, in one device call: each tree built for the GPU at hand, timed by
# mtp_bench.py against vLLM's CUDA op, one process a round, rounds alternating (A B C, then C B A),
# and the GPU tests run on one of them. What the results files' "Tried" and A/B tables come from.
#
#   bash benchmarks/ab_kernels.sh NAME=KERNELS_DIR ...    # NAME=. : this checkout's kernels/
#
# KERNELS_DIR holds a copy of kernels/ (a variant, or main's from `git archive HEAD kernels`); the
# first tree is the baseline the ratios divide by. Environment: BATCHES (default 1 4 8 32 128),
# TOKENS (2 4 8), STATES (bfloat16 float32), HEADS (16/32; several, e.g. "4/8 16/32", share one set
# of builds and one table), ARCH (9.0a), TESTS (the multi-token GPU
# tests; "none" skips them), TEST_TREE (the last tree). What comes back, in $OUT or /tmp/ab: ab.md (the
# A/B table, also printed) and tests-TREE.txt, two files whatever the trees (the device returns at
# most 8); each round's mtp_bench.py tables (.md, .json) stay in a temporary folder, printed with its
# path, unless ROUNDS_OUT names a folder for them.
set -o pipefail
export PYTHONUNBUFFERED=1
[ $# -ge 2 ] || { echo "usage: $0 NAME=KERNELS_DIR NAME=KERNELS_DIR ..." >&2; exit 2; }
out=${OUT:-/tmp/ab}; work=$(mktemp -d); rounds=${ROUNDS_OUT:-$work/rounds}; mkdir -p "$out" "$rounds"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
names=()
for spec in "$@"; do
  name=${spec%%=*}; dir=${spec#*=}; names+=("$name")
  mkdir -p "$work/$name-src"
  cp -r benchmarks csrc cudelta installer kernels release scripts setup.py pyproject.toml MANIFEST.in README.md "$work/$name-src/"
  if [ "$dir" != . ]; then rm -rf "$work/$name-src/kernels" && cp -r "$dir" "$work/$name-src/kernels"; fi
  (cd "$work/$name-src" && CUDELTA_CUDA_ARCHS=${ARCH:-9.0a} FORCE_BUILD=1 MAX_JOBS=$((16 / $#)) python3 -m pip install \
    --no-build-isolation --no-deps --no-index -q --target "$work/$name" . > "$work/build-$name.log" 2>&1) &
done
wait
for name in "${names[@]}"; do
  [ -d "$work/$name/cudelta" ] || { echo "build of $name failed:"; tail -20 "$work/build-$name.log"; exit 1; }
done
echo "builds $(( $(date +%s) - t0 )) s"
bench() {  # name round: one mtp_bench.py process a head shape
  local heads
  for heads in ${HEADS:-16/32}; do
    # shellcheck disable=SC2086  # STATES, BATCHES and TOKENS are lists, split into arguments
    PYTHONPATH="$work/$1" python3 -P benchmarks/mtp_bench.py --impls cudelta vllm-cuda --heads "$heads" \
      --states ${STATES:-bfloat16 float32} --batches ${BATCHES:-1 4 8 32 128} --tokens ${TOKENS:-2 4 8} --procs 1 \
      --out "$rounds/$1-$2-${heads/\//-}.md" > "$work/$1-$2.log" 2>&1 || { echo "$1 round $2 failed:"; tail -20 "$work/$1-$2.log"; exit 1; }
  done
  echo "$1 round $2 done at $(( $(date +%s) - t0 )) s"
}
for name in "${names[@]}"; do bench "$name" 1; done
if [ "${TESTS:-}" != none ]; then
  test_tree=${TEST_TREE:-${names[-1]}}
  # shellcheck disable=SC2086  # TESTS is a list of paths and pytest options
  PYTHONPATH="$work/$test_tree" python3 -P -m pytest -m gpu ${TESTS:-tests/gpu/test_mtp_gpu.py tests/gpu/test_multi_token_gpu.py tests/gpu/test_strided_pool_gpu.py tests/gpu/test_fp8_output_gpu.py} \
    -q -p no:cacheprovider > "$out/tests-$test_tree.txt" 2>&1
  echo "tests on $test_tree: rc=$? at $(( $(date +%s) - t0 )) s: $(tail -1 "$out/tests-$test_tree.txt")"
fi
for (( i=${#names[@]}-1; i>=0; i-- )); do bench "${names[$i]}" 2; done
echo "rounds' tables in $rounds"
HEADS_LIST="${HEADS:-16/32}" python3 - "$rounds" "${names[@]}" <<'PY' | tee "$out/ab.md"
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
heads = os.environ["HEADS_LIST"].split()
def load(name, r):
    cells = {}
    for h in heads:
        d = json.load(open(f"{out}/{name}-{r}-{h.replace('/', '-')}.json"))
        cells.update({(h, x["state"], x["B"], x["T"], x["impl"]): x["us"] for x in d["median"]})
    return cells
runs = {(n, r): load(n, r) for n in names for r in (1, 2)}
base = names[0]
cells = sorted((k[:4] for k in runs[(base, 1)] if k[4] == "cudelta"), key=lambda c: (heads.index(c[0]),) + c[1:])
print("| cell | " + " | ".join(f"{n} µs, rounds 1 / 2" for n in names) + " | "
      + " | ".join(f"{n} ÷ {base}" for n in names[1:]) + " | vLLM's op, rounds 1 / 2 |")
print("|---" * (2 * len(names) + 1) + "|")
for c in cells:
    us = {n: (runs[(n, 1)][c + ("cudelta",)], runs[(n, 2)][c + ("cudelta",)]) for n in names}
    vllm = [runs[(base, r)].get(c + ("vllm-cuda",)) for r in (1, 2)]
    print(f"| {c[0]} {c[1]} B={c[2]} T={c[3]} | " + " | ".join(f"{a:.1f} / {b:.1f}" for a, b in us.values()) + " | "
          + " | ".join(f"{sum(us[n]) / sum(us[base]):.3f}" for n in names[1:]) + " | "
          + " / ".join("-" if v is None else f"{v:.1f}" for v in vllm) + " |")
PY
