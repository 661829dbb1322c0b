"""README's air-gapped recipe, run as written: mirror a release, then install with no network.

The two bash blocks are read from README.md (so the recipe and this test cannot drift) and run by
bash. Only where they reach out is changed: GitHub is the local release server (its base URL
substituted), and "PyPI" is a local folder (pip's own PIP_NO_INDEX / PIP_FIND_LINKS, not the
recipe's text). The install block then runs with every connection refused.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, TAG, VERSION, clean_env

pytestmark = pytest.mark.e2e

GITHUB_RELEASES = "https://github.com/cudelta/cudelta/releases/download"
CLOSED = "http://127.0.0.1:9"


def readme_block(name: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- air-gapped: {name} [^\n]*-->\n```bash\n(.*?)```", text, re.S)
    assert match, f"README.md has no air-gapped {name} block"
    return match.group(1)


def bash(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{script}\nexited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_the_mirror_block_fetches_what_pip_needs_to_build_the_sdist():
    # The recipe lists the build requirements by hand: they must be pyproject's.
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    block = readme_block("mirror")
    assert all(f'"{req}"' in block for req in requires), (requires, block)
    assert f"V={VERSION}" in block and f'"cudelta=={VERSION}"' in readme_block("install")


def test_the_readme_recipe_mirrors_a_release_and_installs_it_with_no_network(
        base_cu, fresh_venv, server, sdist_index, build_wheelhouse, release_dir, tmp_path):
    venv = fresh_venv(base_cu)  # torch is there already, as the recipe asks
    path = f"{venv.python.parent}:{clean_env()['PATH']}"
    mirror_env = clean_env(PATH=path, PIP_NO_INDEX="1", PIP_FIND_LINKS=f"{sdist_index} {build_wheelhouse}",
                           PIP_CONFIG_FILE="/dev/null")
    mirror = readme_block("mirror").replace(GITHUB_RELEASES, server.base_url(TAG).rsplit("/", 1)[0])
    bash(mirror, tmp_path, mirror_env)

    release = tmp_path / "mirror" / "release"
    manifest = json.loads((release / "manifest.json").read_text())
    for asset in manifest["assets"]:
        assert (release / asset["name"]).read_bytes() == (release_dir / asset["name"]).read_bytes()
    assert (tmp_path / "mirror" / "pypi" / f"cudelta-{VERSION}.tar.gz").is_file()
    requests_seen = len(server.paths())

    offline_env = clean_env(PATH=path, PIP_CONFIG_FILE="/dev/null", CUDELTA_CACHE_DIR=str(tmp_path / "cache"),
                            http_proxy=CLOSED, https_proxy=CLOSED, HTTP_PROXY=CLOSED, HTTPS_PROXY=CLOSED)
    for name in ("PIP_FIND_LINKS", "no_proxy", "NO_PROXY"):
        offline_env.pop(name, None)
    out = bash(readme_block("install"), tmp_path, offline_env)
    print(out.stdout[-2000:], out.stderr[-2000:])

    assert len(server.paths()) == requests_seen  # the install asked the "network" for nothing
    code = ("import json, importlib.metadata as m, cudelta._native as n\n"
            "d = m.distribution('cudelta')\n"
            "print(json.dumps({'source': json.loads(d.read_text('cudelta_source.json')), 'build': n.read_build_info()}))\n")
    record = json.loads(venv.py(code).stdout)
    (asset,) = [a["name"] for a in manifest["assets"]]
    assert record["source"]["asset"] == asset
    assert record["source"]["url"] == f"{release.as_uri()}/{asset.replace('+', '%2B')}"
    assert record["source"]["manifest"] == "manifest embedded in the sdist"
    assert record["build"]["build"] == "release"
