"""`pip install cudelta-0.1.0.tar.gz` end to end: real pip, fresh venvs, real release assets built
by the release build, served by a local server that answers like GitHub Releases (302 to storage).
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import TAG, VERSION, clean_env, pip_output, run

pytestmark = pytest.mark.e2e

ASSET_PREFIX = f"cudelta-{VERSION}+cu130-"


def asset_name(release_dir) -> str:
    (wheel,) = release_dir.glob(f"{ASSET_PREFIX}*.whl")
    return wheel.name


def installed_record(env) -> dict:
    """What the installed package says about itself, read in a separate interpreter."""
    code = (
        "import json, importlib.metadata as m, cudelta._native as n\n"
        "d = m.distribution('cudelta')\n"
        "print(json.dumps({'version': d.version, 'source': d.read_text('cudelta_source.json'),\n"
        "  'build': n.read_build_info(), 'library': str(n.library_path()) if n.library_path() else None}))\n"
    )
    return json.loads(env.py(code).stdout)


def wheel_line(output: str) -> str:
    return next(line for line in output.splitlines() if "Created wheel for cudelta" in line)


def install_env(server, cache, **extra):
    return clean_env(CUDELTA_WHEEL_URL=server.base_url(TAG), CUDELTA_CACHE_DIR=str(cache), **extra)


def requested_paths(server) -> list[str]:
    return [path for _method, path, _headers in server.requests]


def test_cpu_torch_gets_the_pure_python_wheel_without_a_compiler(base_cpu, fresh_venv, sdist, server, tmp_path,
                                                                  compiler_spy):
    env = fresh_venv(base_cpu)
    out = pip_output(env.pip("install", "-v", sdist, env=compiler_spy.path_env(install_env(server, tmp_path / "c"))))

    assert "py3-none-any" in wheel_line(out)
    assert "torch 2.13.0+cpu is a CPU build: pure-Python wheel" in out
    assert compiler_spy.compiles() == []
    assert requested_paths(server) == []  # nothing to download for a CPU torch
    record = installed_record(env)
    assert record["library"] is None and record["build"] is None
    result = env.py(
        "import torch, cudelta\n"
        "q = torch.randn(2, 1, 64); v = torch.randn(2, 2, 64); st = torch.zeros(3, 2, 64, 64)\n"
        "o = cudelta.gdn_decode(q, q, v, torch.zeros(2, 2), torch.ones(2, 2), st, torch.tensor([0, -1]))\n"
        "print(o.shape, bool(st[0].abs().sum() > 0), bool(o[1].abs().sum() == 0))\n")
    assert result.stdout.strip() == "torch.Size([2, 2, 64]) True True"


def test_cuda_torch_gets_the_verified_prebuilt_wheel(base_cu, fresh_venv, sdist, server, release_dir, tmp_path):
    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    out = pip_output(env.pip("install", "-v", sdist, env=install_env(server, tmp_path / "cache")))

    assert f"{asset} matches: torch 2.14.1+cu130 (CUDA 13.0)" in out
    assert f"installing prebuilt {asset} (sha256 verified)" in out
    tags = asset[len(ASSET_PREFIX):]  # e.g. cp310-abi3-manylinux_2_28_x86_64.whl
    assert f"cudelta-{VERSION}-{tags}" in wheel_line(out)  # pip's name: the sdist's version, the asset's tags
    assert "Requirement already satisfied: torch>=2.10" in out
    assert "Downloading torch" not in out and not (env.site_packages / "torch").exists()
    paths = requested_paths(server)
    assert f"/cudelta/cudelta/releases/download/{TAG}/manifest.json" in paths[0]
    assert any(p.startswith("/storage/") for p in paths), paths  # followed GitHub's 302

    record = installed_record(env)
    assert record["version"] == VERSION
    assert record["build"]["build"] == "release" and record["build"]["variant"] == "cu130"
    assert json.loads(record["source"])["asset"] == asset
    assert record["library"].endswith("_C.abi3.so")
    cached = list((tmp_path / "cache").rglob("*.whl"))
    assert [c.name for c in cached] == [asset]


def test_no_build_isolation_takes_the_same_path(base_cu, fresh_venv, sdist, server, release_dir, tmp_path):
    from conftest import BUILD_REQS

    env = fresh_venv(base_cu)
    env.pip("install", "-q", *BUILD_REQS)
    out = pip_output(env.pip("install", "-v", "--no-build-isolation", sdist,
                             env=install_env(server, tmp_path / "cache")))
    assert f"installing prebuilt {asset_name(release_dir)} (sha256 verified)" in out
    assert installed_record(env)["build"]["build"] == "release"


def test_force_build_compiles_locally_and_never_calls_the_server(base_cu, fresh_venv, sdist, server, tmp_path,
                                                                 compiler_spy):
    env = fresh_venv(base_cu)
    e = install_env(server, tmp_path / "cache", FORCE_BUILD="1", TORCH_CUDA_ARCH_LIST="9.0a")
    out = pip_output(env.pip("install", "-v", sdist, env=compiler_spy.path_env(e)))

    assert "FORCE_BUILD=1: compiling locally, no download" in out
    assert "compiling for sm_90a" in out
    assert any("ops.cpp" in line for line in compiler_spy.compiles())  # the host compiler really ran
    assert "cp310-abi3-linux_x86_64" in wheel_line(out)
    assert requested_paths(server) == []
    record = installed_record(env)
    assert record["build"]["build"] == "local" and record["build"]["archs"] == ["sm_90a"]
    assert record["source"] is None


def test_no_build_without_a_matching_asset_fails_clearly_and_installs_nothing(base_cu, fresh_venv, sdist, server,
                                                                              tmp_path, compiler_spy):
    env = fresh_venv(base_cu)
    e = install_env(server, tmp_path / "cache", CUDELTA_NO_BUILD="1", CUDELTA_CUDA_VERSION="12.8")
    proc = env.pip("install", sdist, env=compiler_spy.path_env(e), check=False)
    out = pip_output(proc)

    assert proc.returncode != 0
    assert "CUDA 12.8" in out and "CUDELTA_NO_BUILD=1 forbids compiling" in out
    assert "Traceback" not in out
    assert compiler_spy.compiles() == []
    assert not env.has("cudelta")


def test_an_asset_that_does_not_match_its_checksum_is_not_installed(base_cu, fresh_venv, sdist, server,
                                                                    release_dir, tmp_path):
    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    good = (release_dir / asset).read_bytes()
    server.replace_bytes(asset, good[:-1] + bytes([good[-1] ^ 0xFF]))  # same size, one byte off
    cache = tmp_path / "cache"
    proc = env.pip("install", sdist, env=install_env(server, cache), check=False)
    out = pip_output(proc)

    assert proc.returncode != 0
    assert "sha256" in out and asset in out and "not installed" in out
    assert "Traceback" not in out
    assert not env.has("cudelta")
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix == ".whl"]
    assert not [p for p in cache.rglob(".partial-*")]


def test_offline_with_a_file_wheelhouse_installs_without_any_network(base_cu, fresh_venv, sdist, release_dir,
                                                                     build_wheelhouse, tmp_path):
    env = fresh_venv(base_cu)
    e = clean_env(CUDELTA_OFFLINE="1", CUDELTA_WHEEL_URL=release_dir.as_uri(), CUDELTA_CACHE_DIR=str(tmp_path / "c"),
                  # any HTTP attempt, by pip or by us, goes to a closed port and fails
                  http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
                  HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", PIP_CONFIG_FILE="/dev/null")
    e.pop("PIP_FIND_LINKS", None)
    out = pip_output(env.pip("install", "-v", "--no-index", "--find-links", build_wheelhouse, sdist, env=e))
    assert f"installing prebuilt {asset_name(release_dir)} (sha256 verified)" in out
    assert installed_record(env)["build"]["variant"] == "cu130"


def test_the_asset_installs_directly_by_url(base_cu, fresh_venv, server, release_dir):
    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    url = f"{server.base_url(TAG)}/{asset.replace('+', '%2B')}"
    env.pip("install", url)
    assert installed_record(env)["version"] == f"{VERSION}+cu130"


def test_the_asset_installs_with_find_links(base_cu, fresh_venv, release_dir):
    env = fresh_venv(base_cu)
    env.pip("install", "--no-index", "--find-links", release_dir, f"cudelta=={VERSION}+cu130")
    record = installed_record(env)
    assert record["version"] == f"{VERSION}+cu130" and record["library"].endswith("_C.abi3.so")


def test_release_asset_is_a_real_release_build(release_dir):
    asset = release_dir / asset_name(release_dir)
    with zipfile.ZipFile(asset) as zf:
        names = zf.namelist()
        info = json.loads(zf.read("cudelta/_build_info.json"))
        metadata = zf.read(f"cudelta-{VERSION}+cu130.dist-info/METADATA").decode()
    assert "cudelta/_C.abi3.so" in names
    assert f"Version: {VERSION}+cu130" in metadata
    assert info["build"] == "release" and info["archs"] == ["sm_80", "sm_90a", "sm_100f", "sm_120f"]


def uv_install(env, sdist, environ):
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not installed next to the test interpreter (scripts/test.sh installs it)")
    # --no-deps: uv does not see the base's torch through the .pth and would fetch a 3 GB torch.
    return run([uv, "pip", "install", "--python", env.python, "--no-deps", "--no-cache", "-v", sdist],
               env=environ, check=False)


def test_uv_builds_where_torch_is_invisible_and_says_what_it_used(base_cu, fresh_venv, sdist, server, tmp_path):
    env = fresh_venv(base_cu)
    proc = uv_install(env, sdist, install_env(server, tmp_path / "cache"))
    out = pip_output(proc)
    assert "torch is not visible to this build" in out
    assert "CUDELTA_TARGET_PYTHON" in out and "CUDELTA_CUDA_VERSION" in out
    assert proc.returncode != 0 and "Traceback" not in out.split("cudelta: error:")[-1]
    assert not env.has("cudelta")


def test_uv_with_the_cuda_flavour_named_installs_the_prebuilt_wheel(base_cu, fresh_venv, sdist, server, release_dir,
                                                                    tmp_path):
    env = fresh_venv(base_cu)
    proc = uv_install(env, sdist, install_env(server, tmp_path / "cache", CUDELTA_CUDA_VERSION="13.0"))
    out = pip_output(proc)
    assert proc.returncode == 0, out
    assert f"installing prebuilt {asset_name(release_dir)} (sha256 verified)" in out
    assert installed_record(env)["build"]["variant"] == "cu130"
