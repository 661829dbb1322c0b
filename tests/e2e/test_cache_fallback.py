"""A download cache that cannot be created costs one line, not the prebuilt wheel: real pip installs
the sdist against the local release server with CUDELTA_CACHE_DIR under a regular file (a typo'd
path, a CI variable pointing into a file), and gets the verified release wheel without compiling.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from conftest import TAG, VERSION, clean_env, pip_output

pytestmark = pytest.mark.e2e


def test_a_cache_dir_under_a_regular_file_still_installs_the_prebuilt_wheel(
        base_cu, fresh_venv, sdist, server, release_dir, tmp_path, compiler_spy):
    (asset,) = release_dir.glob(f"cudelta-{VERSION}+cu130-*.whl")
    blocker = tmp_path / "settings.conf"
    blocker.write_text("not a folder\n")
    cache_dir = blocker / "cudelta-cache"
    env = fresh_venv(base_cu)
    install_env = clean_env(CUDELTA_WHEEL_URL=server.base_url(TAG), CUDELTA_CACHE_DIR=str(cache_dir))

    proc = env.pip("install", "-v", sdist, env=compiler_spy.path_env(install_env))
    out = pip_output(proc)

    line = next((line for line in out.splitlines() if f"cudelta: not caching {asset.name}: " in line), None)
    assert line is not None, out[-4000:]
    assert line.strip().endswith(
        f"cudelta: not caching {asset.name}: {blocker} is a file, not a folder, so the download cache {cache_dir} "
        "cannot be created (ENOTDIR); set CUDELTA_CACHE_DIR to a folder; downloading it into a private temporary "
        "folder instead")
    assert f"installing prebuilt {asset.name} (sha256 verified against the manifest embedded in the sdist)" in out
    assert compiler_spy.compiles() == []  # the prebuilt wheel, not a compile
    assert blocker.read_text() == "not a folder\n"
    wheel_requests = [p for p in server.paths() if p.endswith(".whl") and "/releases/download/" in p]
    assert wheel_requests == [f"/cudelta/cudelta/releases/download/{TAG}/{asset.name}"]  # downloaded once

    installed = json.loads(env.py(
        "import json, importlib.metadata as m, cudelta._native as n\n"
        "d = m.distribution('cudelta')\n"
        "print(json.dumps({'source': json.loads(d.read_text('cudelta_source.json')),\n"
        "  'build': n.read_build_info(), 'library': str(n.library_path())}))\n").stdout)
    assert installed["source"]["asset"] == asset.name
    assert installed["source"]["sha256"] == hashlib.sha256(asset.read_bytes()).hexdigest()
    assert installed["build"]["build"] == "release" and installed["build"]["cuda_label"] == "cu130"
    assert installed["library"].endswith("_C.abi3.so")
