"""The automatic fallback, end to end: the release asset cannot be downloaded, nvcc and a CUDA torch
are present, so `pip install cudelta` says why there is no prebuilt wheel, compiles the library
here, installs it, and the installed package loads it.
"""

from __future__ import annotations

import pytest
from conftest import TAG, clean_env, pip_output

pytestmark = pytest.mark.e2e

# One arch and two jobs keep the compile to about a minute on 2 cores: what is under test is that
# the fallback compiles and installs, not the release's arch list.
COMPILE = {"CUDELTA_CUDA_ARCHS": "9.0a", "MAX_JOBS": "2"}


def test_a_failed_download_falls_back_to_a_local_compile_that_installs_and_loads(
        base_cu, fresh_venv, sdist, server, release_dir, tmp_path, installed_library):
    env = fresh_venv(base_cu)
    (wheel,) = release_dir.glob("cudelta-*+cu130-*.whl")
    asset = wheel.name
    server.truncate(asset)  # every attempt gets half the bytes, then the connection closes
    e = clean_env(CUDELTA_WHEEL_URL=server.base_url(TAG), CUDELTA_CACHE_DIR=str(tmp_path / "cache"), **COMPILE)
    out = pip_output(env.pip("install", "-v", sdist, env=e))

    said = [line.strip() for line in out.splitlines() if line.strip().startswith("cudelta: ")]
    print("\n".join(said))  # shown by pytest -rP: what the user sees
    url = f"{server.base_url(TAG)}/{asset.replace('+', '%2B')}"
    (announced,) = [line for line in said if line.startswith("cudelta: no prebuilt wheel (")]
    assert announced.startswith(f"cudelta: no prebuilt wheel (download failed: could not download {url}: ")
    assert announced.endswith(" (5 attempts)): building from source")
    assert "compiling for sm_90a (from CUDELTA_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST) with 2 job(s)" in out
    assert "installing prebuilt" not in out
    downloads = [p for p in server.paths() if p == f"/cudelta/cudelta/releases/download/{TAG}/{asset}"]
    assert len(downloads) == 5  # the first attempt and CUDELTA_HTTP_RETRIES' default 4
    assert server.bytes_sent(asset) == 5 * (wheel.stat().st_size // 2)  # never the whole file

    # Compiled (the record says local; nvcc made the one cubin asked for), installed by pip into
    # this venv, and loaded by the package's own loader.
    assert installed_library(env).local_build_problems(env, ["sm_90a"]) == []


def test_the_local_build_check_names_what_is_not_a_local_build(tmp_path):
    # The check both cases above rely on fails on a release library, a missing one, a foreign
    # cubin, a library outside the venv and one that did not load.
    from conftest import InstalledLibrary, Venv

    env = Venv(tmp_path / "venv")
    so = env.site_packages / "cudelta" / "_C.abi3.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(b"\x7fELF" + bytes(60))
    good = dict(record={"build": "local", "archs": ["sm_90a"], "ptx": []}, library=so, in_pip_record=True,
                loaded=True, reason="loaded", variants=["generic", "warp"], cubins=["sm_90a", "sm_90a"], ptx=[])
    assert InstalledLibrary(**good).local_build_problems(env, ["sm_90a"]) == []
    outside = tmp_path / "elsewhere" / "_C.abi3.so"
    outside.parent.mkdir()
    outside.write_bytes(so.read_bytes())
    for change, named in [({"record": {"build": "release", "archs": ["sm_90a"], "ptx": []}}, "build record"),
                          ({"record": None}, "build record"),
                          ({"library": None}, "library None"),
                          ({"library": outside}, "not installed by pip"),
                          ({"in_pip_record": False}, "not installed by pip"),
                          ({"cubins": ["sm_80"]}, "cuobjdump lists"),
                          ({"ptx": ["sm_90"]}, "cuobjdump lists"),
                          ({"loaded": False, "reason": "loading failed"}, "loading failed")]:
        problems = InstalledLibrary(**{**good, **change}).local_build_problems(env, ["sm_90a"])
        assert any(named in p for p in problems), (change, problems)
