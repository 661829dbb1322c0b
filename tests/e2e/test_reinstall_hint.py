"""The reinstall command every message gives replaces cudelta and nothing else.

Without --no-deps a forced reinstall reinstalls torch too: gigabytes, and PyPI's default build in
place of the user's +cuXYZ one. Here torch is really installed in the venv (not seen through a
.pth), the hint's exact text is run by a shell, as a user pastes it, with pip or with uv, and
torch's version and every one of its files are compared before and after.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import VERSION, clean_env, find_uv, run

from installer.compile.build_record import reader as build_record

pytestmark = pytest.mark.e2e

TORCH_PIN = "torch==2.13.0+cpu"  # /opt/wheels (PIP_FIND_LINKS) on this machine, else the CPU index
BUILD_ENV = "CUDELTA_DRIVER_CUDA=cpu"  # the hint's build variables: the pure wheel keeps the rebuild quick


def files_of(venv, dist: str) -> dict[str, tuple]:
    """Every file the distribution installed (its RECORD), with what a rewrite would change."""
    code = ("import json, importlib.metadata as m\n"
            f"d = m.distribution({dist!r})\n"
            "print(json.dumps([str(d.locate_file(f)) for f in d.files]))\n")
    import json

    paths = json.loads(venv.py(code).stdout)
    assert paths, f"{dist} lists no files"
    out = {}
    for path in paths:
        st = os.stat(path)
        out[path] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def local_index(tmp_path: Path, sdist: Path, wheelhouse: Path) -> Path:
    """One folder with the sdist and the build requirements: all the hint may install from."""
    out = tmp_path / "index"
    out.mkdir()
    for item in [sdist, *wheelhouse.iterdir()]:
        shutil.copy2(item, out / item.name)
    return out


@pytest.mark.parametrize("tool", ["pip", "uv"])
def test_the_reinstall_hint_rebuilds_cudelta_and_leaves_torch_untouched(tool, fresh_venv, sdist_without_manifest,
                                                                       build_wheelhouse, tmp_path):
    uv = find_uv()
    if tool == "uv" and uv is None:
        pytest.skip("uv not installed")
    venv = fresh_venv()
    venv.pip("install", "-q", TORCH_PIN)
    venv.pip("install", "-q", sdist_without_manifest, env=clean_env(CUDELTA_DRIVER_CUDA="cpu"))
    torch_before = files_of(venv, "torch")
    torch_version = venv.py("import importlib.metadata as m; print(m.version('torch'))").stdout.strip()
    cudelta_before = files_of(venv, "cudelta")

    pip_hint, uv_hint = build_record.reinstall_commands(BUILD_ENV)
    hint = pip_hint if tool == "pip" else uv_hint
    index = local_index(tmp_path, sdist_without_manifest, build_wheelhouse)
    env = clean_env(
        PATH=os.pathsep.join([str(venv.python.parent), str(Path(uv).parent) if uv else "", os.environ["PATH"]]),
        VIRTUAL_ENV=str(venv.path),
        # Where `cudelta` is found: the local folder only (pip's and uv's own settings, not the hint's text).
        PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index), PIP_CONFIG_FILE="/dev/null",
        UV_OFFLINE="1", UV_FIND_LINKS=str(index), UV_NO_CONFIG="1",
    )
    proc = subprocess.run(["sh", "-c", hint], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    print(f"$ {hint}\n{out[-3000:]}")
    assert proc.returncode == 0, out
    assert ("Created wheel for cudelta" if tool == "pip" else "Built cudelta") in out  # built anew, not a cached wheel

    assert venv.py("import importlib.metadata as m; print(m.version('torch'))").stdout.strip() == torch_version
    assert files_of(venv, "torch") == torch_before  # not one file rewritten, added or removed
    cudelta_after = files_of(venv, "cudelta")
    init = next(p for p in cudelta_after if p.endswith(os.path.join("cudelta", "__init__.py")))
    assert cudelta_after[init][:2] != cudelta_before[init][:2]  # rewritten: cudelta was reinstalled
    assert venv.py("import importlib.metadata as m; print(m.version('cudelta'))").stdout.strip() == VERSION
