"""Installs that cannot succeed end fast, in one line that names every way out that applies.

Real pip, the release's sdist, no network for anyone: GitHub is "out of reach" through a proxy on a
closed port (as behind a firewall), and pip takes the build requirements from a local wheelhouse.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import clean_env, pip_output

pytestmark = pytest.mark.e2e

CLOSED = "http://127.0.0.1:9"  # nothing listens: every connection is refused at once
LIMIT_S = 90


def no_network(tmp_path: Path, **extra: str) -> dict:
    env = clean_env(CUDELTA_CACHE_DIR=str(tmp_path / "cache"), PIP_CONFIG_FILE="/dev/null",
                    http_proxy=CLOSED, https_proxy=CLOSED, HTTP_PROXY=CLOSED, HTTPS_PROXY=CLOSED, **extra)
    for name in ("PIP_FIND_LINKS", "no_proxy", "NO_PROXY"):
        env.pop(name, None)
    return env


def install(venv, sdist, wheelhouse, env) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = venv.pip("install", "--no-index", "--find-links", wheelhouse, sdist, env=env, check=False)
    elapsed = time.monotonic() - started
    out = pip_output(proc)
    print(f"pip install: exit {proc.returncode} after {elapsed:.1f} s\n{last_line(out)}")
    return proc.returncode, out, elapsed


def last_line(out: str) -> str:
    """The build's last `cudelta:` line, as pip relays it (indented) when a build fails."""
    return [line.strip() for line in out.splitlines() if line.strip().startswith("cudelta: ")][-1]


def test_offline_with_a_cpu_torch_fails_fast_naming_every_way_out(base_cpu, fresh_venv, sdist, build_wheelhouse,
                                                                  tmp_path, compiler_spy):
    # The laptop or CI runner: GitHub unreachable, no override, a CPU torch.
    venv = fresh_venv(base_cpu)
    code, out, elapsed = install(venv, sdist, build_wheelhouse, compiler_spy.path_env(no_network(tmp_path)))

    assert code != 0 and elapsed < LIMIT_S
    final = last_line(out)
    assert final.startswith("cudelta: error: cannot install cudelta: the prebuilt wheel could not be downloaded, "
                            "and this machine cannot compile (torch 2.13.0+cpu has no CUDA)")
    ways = final.split("Ways out: ", 1)[1]
    assert ways.startswith("CUDELTA_DRIVER_CUDA=cpu installs the pure-Python wheel")
    assert "; CUDELTA_WHEEL_URL=<an http(s) mirror or a file:// folder" in ways
    assert "; FORCE_BUILD=1 with a CUDA build of torch (not 2.13.0+cpu) and nvcc 13.0 compiles here" in ways
    assert "; or fix what stopped the download (download failed: could not download https://github.com/" in ways
    assert "building from source" not in out and compiler_spy.compiles() == []  # no compile was started
    assert "Traceback" not in out
    assert not venv.has("cudelta")


def test_force_build_with_a_cpu_torch_fails_at_once_offering_the_prebuilt_wheel(base_cpu, fresh_venv, sdist,
                                                                                build_wheelhouse, tmp_path,
                                                                                compiler_spy):
    venv = fresh_venv(base_cpu)
    env = compiler_spy.path_env(no_network(tmp_path, FORCE_BUILD="1"))
    code, out, elapsed = install(venv, sdist, build_wheelhouse, env)

    assert code != 0 and elapsed < LIMIT_S
    final = last_line(out)
    assert final.startswith("cudelta: error: cannot install cudelta: FORCE_BUILD=1 skips the prebuilt wheel, and "
                            "this machine cannot compile (torch 2.13.0+cpu has no CUDA)")
    assert "unset FORCE_BUILD to install the verified prebuilt wheel" in final
    assert "install a CUDA build of torch (not 2.13.0+cpu) and nvcc 13.0 for FORCE_BUILD's compile" in final
    assert compiler_spy.compiles() == [] and "Traceback" not in out


def test_offline_setting_with_the_manifest_out_of_reach_asks_for_a_folder(base_cpu, fresh_venv,
                                                                         sdist_without_manifest, build_wheelhouse,
                                                                         tmp_path, compiler_spy):
    # A checkout's sdist has no embedded manifest: under CUDELTA_OFFLINE it cannot even choose.
    venv = fresh_venv(base_cpu)
    env = compiler_spy.path_env(no_network(tmp_path, CUDELTA_OFFLINE="1"))
    code, out, elapsed = install(venv, sdist_without_manifest, build_wheelhouse, env)

    assert code != 0 and elapsed < LIMIT_S
    final = last_line(out)
    assert final.startswith("cudelta: error: cannot install cudelta: CUDELTA_OFFLINE=1 forbids downloading the "
                            "prebuilt wheel, and this machine cannot compile")
    assert "CUDELTA_WHEEL_URL=file://<a folder holding this release's manifest.json and wheels>" in final
    assert final.endswith("or unset CUDELTA_OFFLINE to download.")
    assert compiler_spy.compiles() == []


def failing_toolchain(tmp_path: Path) -> dict:
    """A CUDA toolkit and host compiler that answer `--version` like the real ones (so the toolchain
    checks pass and the compile starts) but refuse to compile anything."""
    import shutil

    home = tmp_path / "broken-cuda"
    (home / "bin").mkdir(parents=True)
    nvcc, cxx = shutil.which("nvcc"), shutil.which("c++")
    (home / "bin" / "nvcc").write_text(
        f'#!/bin/sh\ncase " $* " in *" --version "*) exec {nvcc} "$@";; esac\n'
        'echo "broken nvcc: refusing to compile" >&2; exit 1\n')
    (home / "bin" / "c++").write_text(
        f'#!/bin/sh\ncase " $* " in *" -c "*) echo "broken c++: refusing to compile" >&2; exit 1;; esac\n'
        f'exec {cxx} "$@"\n')
    for tool in ("nvcc", "c++"):
        (home / "bin" / tool).chmod(0o755)
    return {"CUDA_HOME": str(home), "CXX": str(home / "bin" / "c++")}


def test_a_compile_that_starts_and_fails_still_ends_with_the_ways_out(base_cu, fresh_venv, sdist, build_wheelhouse,
                                                                      tmp_path):
    # A CUDA torch and nvcc: the fallback compile may start, so it does, and fails.
    venv = fresh_venv(base_cu)
    env = no_network(tmp_path, TORCH_CUDA_ARCH_LIST="9.0a", MAX_JOBS="1", **failing_toolchain(tmp_path))
    code, out, elapsed = install(venv, sdist, build_wheelhouse, env)

    assert code != 0
    assert "building from source" in out and "refusing to compile" in out  # it really started
    final = last_line(out)
    assert final.startswith("cudelta: error: the local compile failed (exit 1); its output is above. "
                            "Other ways out: CUDELTA_DRIVER_CUDA=cpu installs the pure-Python wheel")
    assert "; CUDELTA_WHEEL_URL=<an http(s) mirror or a file:// folder" in final
    assert "; or fix what stopped the download (download failed: could not download https://github.com/" in final
    assert "Traceback" not in out and not venv.has("cudelta")
