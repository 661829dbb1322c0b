#!/usr/bin/env bash
# The GPU tests (marker gpu) against what a user installs, as .github/workflows/gpu-tests.yml runs
# them on a self-hosted GPU runner:
#   1. the release: release/dry_run.py builds it (the fat binary, its checks, manifest.json, the
#      sdist that embeds it), or --release DIR names one already built;
#   2. a fresh venv, and cudelta installed as a user does: `pip install cudelta-X.tar.gz` with
#      CUDELTA_WHEEL_URL=file://DIR, which must fetch, verify and install the release wheel (a
#      fallback compile fails the job: it would test a local build instead of the release);
#   3. the local builds only tests/gpu/test_foreign_images.py needs, made here: a cubin for an arch
#      this GPU lacks (8.0) and that arch's PTX (8.0+PTX), each unpacked for CUDELTA_TEST_ALT_BUILDS;
#   4. pytest -m gpu tests/gpu against the install (the foreign-image cases fail, not skip, without 3).
#
# usage: scripts/gpu_tests.sh [--release DIR] [--base-python PY] [--work DIR] [pytest args...]
#   --release DIR      a folder written by `release/dry_run.py --out DIR`: no release compile here
#                      (a GPU machine without the release tools or a network)
#   --base-python PY   offline: the fresh venv sees PY's packages (torch, pytest, pip, ninja) through
#                      a .pth instead of pip-installing torch and pytest. The sdist's isolated build
#                      and the tools of step 3 then come from pip's own settings, e.g.
#                      PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR (a folder of wheels)
#   --work DIR         venv, logs, builds (default .ci-cache/gpu-job; emptied first)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
release="" base="" work="$root/.ci-cache/gpu-job"
while [ $# -gt 0 ]; do
  case "$1" in
    --release) release=$(cd "${2:?--release needs a folder}" && pwd); shift 2 ;;
    --base-python) base=${2:?--base-python needs an interpreter}; shift 2 ;;
    --work) work=${2:?--work needs a folder}; shift 2 ;;
    *) break ;;
  esac
done
mkdir -p "$work"
work=$(cd "$work" && pwd)
say() { printf 'gpu_tests: %s\n' "$*"; }
die() { printf 'gpu_tests: error: %s\n' "$*" >&2; exit 1; }

# 1. The release.
if [ -z "$release" ]; then
  rvenv="$root/.ci-cache/venvs/gpu-release"
  [ -x "$rvenv/bin/python" ] || python3 -m venv "$rvenv"
  "$rvenv/bin/pip" install -q torch==2.14.1 -r scripts/release-tools.txt
  release="$work/release"
  rm -rf "$release"
  say "building the release (release/dry_run.py) into $release"
  "$rvenv/bin/python" -m release.dry_run --python "$rvenv/bin/python" --out "$release"
fi
sdists=("$release"/cudelta-*.tar.gz)
[ "${#sdists[@]}" = 1 ] && [ -f "${sdists[0]}" ] || die "$release holds no single cudelta-*.tar.gz; give a folder written by release/dry_run.py --out"
[ -f "$release/manifest.json" ] || die "$release has no manifest.json; give a folder written by release/dry_run.py --out"
sdist=${sdists[0]}

# 2. A fresh venv and the install a user runs.
venv="$work/venv"
rm -rf "$venv"
if [ -n "$base" ]; then
  # Its pip, torch and pytest come from PY: nothing to download on a machine without a network.
  "$base" -m venv --without-pip "$venv"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$base" -c 'import sysconfig; p = sysconfig.get_paths(); print("\n".join(dict.fromkeys((p["purelib"], p["platlib"]))))' \
    >"$site/gpu-tests-base.pth"
else
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "torch>=2.10" "pytest>=8"
fi
py="$venv/bin/python"
say "installing $(basename "$sdist") from file://$release"
CUDELTA_WHEEL_URL="file://$release" "$py" -m pip install -v --no-cache-dir "$sdist" >"$work/install.log" 2>&1 \
  || { tail -n 40 "$work/install.log" >&2; die "pip install of the sdist failed (log: $work/install.log)"; }
grep 'cudelta: ' "$work/install.log" | sed 's/^ *//'
grep -q 'cudelta: installing prebuilt ' "$work/install.log" \
  || die "the sdist did not install the release wheel (log: $work/install.log): the tests would not test the release"
build=$("$py" -I -c 'from cudelta import _native; print((_native.read_build_info() or {}).get("build"))')
[ "$build" = release ] || die "the installed cudelta's build record says build=$build, not release"
"$py" -I -m cudelta

# 3. The foreign-image builds, local compiles of this tree. Without build isolation: their tools
# come from the venv (so an offline machine needs no index), each in a copy of the tree (setuptools'
# build/ folders would collide).
say "local builds for tests/gpu/test_foreign_images.py: 8.0 (cubin only) and 8.0+PTX"
"$py" -m pip install -q "setuptools>=77" "wheel>=0.43" "packaging>=24" "requests>=2.31" "urllib3>=2" \
  "filelock>=3.12" "platformdirs>=3" ninja
alt="$work/alt"
rm -rf "$alt" "$work/src" "$work/wheels"
build_alt() {  # name archs
  local src="$work/src/$1"
  mkdir -p "$src" "$alt/$1"
  tar -C "$root" --exclude=./.git --exclude=./.ci-cache --exclude=./build --exclude=./dist --exclude="./${work#"$root"/}" \
    --exclude="./${release#"$root"/}" -cf - . | tar -C "$src" -xf -
  FORCE_BUILD=1 CUDELTA_CUDA_ARCHS="$2" "$py" -m pip wheel -v --no-build-isolation --no-deps --no-cache-dir \
    -w "$work/wheels/$1" "$src" >"$work/build-$1.log" 2>&1 \
    || { tail -n 40 "$work/build-$1.log" >&2; return 1; }
  "$py" -m zipfile -e "$work/wheels/$1"/cudelta-*.whl "$alt/$1"
}
build_alt sm80 8.0 & sm80=$!
build_alt sm80ptx 8.0+PTX & sm80ptx=$!
wait "$sm80" || die "the 8.0 build failed (log: $work/build-sm80.log)"
wait "$sm80ptx" || die "the 8.0+PTX build failed (log: $work/build-sm80ptx.log)"
for name in sm80 sm80ptx; do
  say "$name: $("$py" -c 'import json, sys; b = json.load(open(sys.argv[1])); print(b["build"], "cubins", b["archs"], "PTX", b["ptx"])' "$alt/$name/cudelta/_build_info.json")"
done

# 4. The tests, against the install: -P keeps the source tree's cudelta/ off sys.path.
CUDELTA_TEST_ALT_BUILDS="$alt" exec "$py" -P -m pytest -m gpu tests/gpu -p no:cacheprovider -rs \
  --junitxml "$work/gpu-tests.xml" "$@"
