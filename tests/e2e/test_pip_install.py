"""`pip install cudelta-0.1.0.tar.gz` end to end: real pip, fresh venvs, real release assets built
by the release build, served by a local server that answers like GitHub Releases (302 to storage).
"""

from __future__ import annotations

import json
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


def test_cpu_torch_gets_the_release_asset_and_its_ops_run_the_reference(base_cpu, fresh_venv, sdist, server,
                                                                       release_dir, tmp_path, compiler_spy):
    # torch is not an input of the choice: a CPU torch on a machine with no driver gets the most
    # compatible build, and its ops run the PyTorch reference with a notice.
    env = fresh_venv(base_cpu)
    asset = asset_name(release_dir)
    out = pip_output(env.pip("install", "-v", sdist, env=compiler_spy.path_env(install_env(server, tmp_path / "c"))))

    assert "no NVIDIA driver visible, so the most compatible build" in out
    assert f"installing prebuilt {asset} (sha256 verified against the manifest embedded in the sdist)" in out
    assert compiler_spy.compiles() == []
    record = installed_record(env)
    assert record["build"]["build"] == "release" and record["library"].endswith("_C.abi3.so")
    result = env.py(
        "import warnings, torch, cudelta\n"
        "warnings.simplefilter('always')\n"
        "q = torch.randn(2, 1, 64); v = torch.randn(2, 2, 64); st = torch.zeros(3, 2, 64, 64)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    o = cudelta.gdn_decode(q, q, v, torch.zeros(2, 2), torch.ones(2, 2), st, torch.tensor([0, -1]))\n"
        "print(o.shape, bool(st[0].abs().sum() > 0), bool(o[1].abs().sum() == 0), any('reference' in str(x.message) for x in w))\n")
    assert result.stdout.strip() == "torch.Size([2, 2, 64]) True True True"


def test_cuda_torch_gets_the_verified_prebuilt_wheel(base_cu, fresh_venv, sdist, server, release_dir, tmp_path):
    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    out = pip_output(env.pip("install", "-v", sdist, env=install_env(server, tmp_path / "cache")))

    assert "trusting the release manifest embedded in this sdist" in out
    assert f"{asset} matches:" in out
    assert f"installing prebuilt {asset} (sha256 verified against the manifest embedded in the sdist)" in out
    tags = asset[len(ASSET_PREFIX):]  # e.g. cp310-abi3-manylinux_2_28_x86_64.whl
    assert f"cudelta-{VERSION}-{tags}" in wheel_line(out)  # pip's name: the sdist's version, the asset's tags
    assert "Requirement already satisfied: torch>=2.10" in out
    assert "Downloading torch" not in out and not (env.site_packages / "torch").exists()
    paths = server.paths()
    assert not any(p.endswith("manifest.json") for p in paths), paths  # the sdist's own manifest: one request fewer
    assert [p for p in paths if p.endswith(".whl") and "/releases/download/" in p] == [
        f"/cudelta/cudelta/releases/download/{TAG}/{asset}"]  # downloaded once
    assert any(p.startswith("/storage/") for p in paths), paths  # followed GitHub's 302

    record = installed_record(env)
    assert record["version"] == VERSION
    assert record["build"]["build"] == "release" and record["build"]["cuda_label"] == "cu130"
    source = json.loads(record["source"])
    assert source["asset"] == asset and source["manifest"] == "manifest embedded in the sdist"
    assert record["library"].endswith("_C.abi3.so")
    cached = list((tmp_path / "cache").rglob("*.whl"))
    assert [c.name for c in cached] == [asset]


def test_a_checkout_without_an_embedded_manifest_trusts_the_downloaded_one_and_says_so(
        base_cu, fresh_venv, sdist_without_manifest, server, release_dir, tmp_path):
    env = fresh_venv(base_cu)
    out = pip_output(env.pip("install", "-v", sdist_without_manifest, env=install_env(server, tmp_path / "cache")))
    assert "trusting manifest.json downloaded from the release URL (no manifest embedded in this source tree)" in out
    assert f"installing prebuilt {asset_name(release_dir)} (sha256 verified against the manifest.json downloaded" in out
    assert server.paths()[0] == f"/cudelta/cudelta/releases/download/{TAG}/manifest.json"


def swapped_wheel(original: Path, out: Path) -> Path:
    """Another valid wheel under the same name and of the same size: the release wheel with one
    file changed, recompressed, and padded with a zip comment, so only its sha256 differs."""
    dst = out / original.name

    def write(comment: bytes) -> int:
        with zipfile.ZipFile(original) as src, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for item in src.infolist():
                data = src.read(item.filename)
                if item.filename == "cudelta/__init__.py":
                    data = b"HIJACKED = True\n"  # shorter than the original, so padding can even it out
                zout.writestr(item, data)
            zout.comment = comment
        return dst.stat().st_size

    short = original.stat().st_size - write(b"")
    assert 0 <= short <= 65535, f"cannot pad the swapped wheel to size ({short})"
    assert write(b" " * short) == original.stat().st_size
    return dst


def test_a_hostile_mirror_serving_a_consistent_manifest_cannot_pass_the_embedded_one(
        base_cu, fresh_venv, sdist, server, release_dir, tmp_path):
    # The host swaps the wheel AND rewrites manifest.json to match it: only the manifest that came
    # inside the sdist (hashed by PyPI) can tell.
    import hashlib

    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    evil = swapped_wheel(release_dir / asset, tmp_path).read_bytes()
    manifest = json.loads((release_dir / "manifest.json").read_text())
    for entry in manifest["assets"]:
        if entry["name"] == asset:
            entry["sha256"] = hashlib.sha256(evil).hexdigest()
    server.replace_bytes(asset, evil)
    server.replace_bytes("manifest.json", json.dumps(manifest).encode())
    proc = env.pip("install", sdist, env=install_env(server, tmp_path / "cache"), check=False)
    out = pip_output(proc)

    assert proc.returncode != 0
    assert "sha256" in out and asset in out and "not installed" in out
    assert "Traceback" not in out
    assert not env.has("cudelta")


def test_no_build_isolation_takes_the_same_path(base_cu, fresh_venv, sdist, server, release_dir, tmp_path):
    from conftest import BUILD_REQS

    env = fresh_venv(base_cu)
    env.pip("install", "-q", *BUILD_REQS)
    out = pip_output(env.pip("install", "-v", "--no-build-isolation", sdist,
                             env=install_env(server, tmp_path / "cache")))
    assert f"installing prebuilt {asset_name(release_dir)} (sha256 verified against the manifest embedded in the sdist)" in out
    assert installed_record(env)["build"]["build"] == "release"


def test_force_build_compiles_locally_installs_and_loads_and_never_calls_the_server(
        base_cu, fresh_venv, sdist, server, tmp_path, installed_library):
    env = fresh_venv(base_cu)
    e = install_env(server, tmp_path / "cache", FORCE_BUILD="1", TORCH_CUDA_ARCH_LIST="9.0a", MAX_JOBS="2")
    out = pip_output(env.pip("install", "-v", sdist, env=e))

    assert "FORCE_BUILD=1: compiling locally, no download" in out
    assert "compiling for sm_90a" in out
    assert "cp310-abi3-linux_x86_64" in wheel_line(out)
    assert server.paths() == []
    source = json.loads(installed_record(env)["source"])  # a compile records what it was made for, like a prebuilt
    assert source["kind"] == "local" and source["reason"] == "FORCE_BUILD=1: compiling locally, no download"
    assert source["chosen"]["archs"] == ["sm_90a"] and source["machine"]["driver_cuda"] is None
    # The compile is proven by what it made, not by a PATH spy (nvcc is reached through CUDA_HOME):
    # the package's record says local, and the installed library holds the one cubin asked for.
    assert installed_library(env).local_build_problems(env, ["sm_90a"]) == []


def test_no_build_without_a_matching_asset_fails_clearly_and_installs_nothing(base_cu, fresh_venv, sdist, server,
                                                                              tmp_path, compiler_spy):
    env = fresh_venv(base_cu)
    e = install_env(server, tmp_path / "cache", CUDELTA_NO_BUILD="1", CUDELTA_DRIVER_CUDA="12.8")
    proc = env.pip("install", sdist, env=compiler_spy.path_env(e), check=False)
    out = pip_output(proc)

    assert proc.returncode != 0
    assert "the NVIDIA driver supports CUDA 12.8, older than the 13.0" in out
    assert "CUDELTA_NO_BUILD=1 forbids compiling" in out
    # torch 2.14.1+cu130 and nvcc are here: the compile it forbade is a way out, beside the pure wheel.
    final = [line.strip() for line in out.splitlines() if "cudelta: " in line][-1]
    assert "Ways out: CUDELTA_DRIVER_CUDA=cpu installs the pure-Python wheel" in final
    assert final.endswith("; unset CUDELTA_NO_BUILD to compile here.")
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
    assert f"installing prebuilt {asset_name(release_dir)} (sha256 verified against the manifest embedded in the sdist)" in out
    assert installed_record(env)["build"]["cuda_label"] == "cu130"


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


def test_a_cpu_arch_the_release_has_no_cuda_build_for_gets_the_pure_python_wheel(
        base_cu, fresh_venv, sdist_without_manifest, server, release_dir, tmp_path, compiler_spy):
    # As on aarch64 while a release has x86_64 builds only: nothing to download, nothing to
    # compile for the first time on a user's machine; the ops run the PyTorch reference.
    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    manifest = json.loads((release_dir / "manifest.json").read_text())
    for entry in manifest["assets"]:
        entry["name"] = entry["name"].replace("x86_64", "riscv64")
        entry["platform"] = entry["platform"].replace("x86_64", "riscv64")
    server.replace_bytes("manifest.json", json.dumps(manifest).encode())
    out = pip_output(env.pip("install", "-v", sdist_without_manifest,
                             env=compiler_spy.path_env(install_env(server, tmp_path / "cache"))))

    assert "release 0.1.0 has no CUDA build for x86_64: installing the pure-Python wheel" in out
    assert "py3-none-any" in wheel_line(out)
    assert compiler_spy.compiles() == []
    assert not any(p.endswith(".whl") for p in server.paths()) and asset not in out
    record = installed_record(env)
    assert record["library"] is None and record["build"] is None
    source = json.loads(record["source"])
    assert source["kind"] == "pure" and source["pure_because"] == "platform"


@pytest.mark.parametrize("bad,line", [
    ({"CUDELTA_HTTP_TIMEOUT": "inf", "CUDELTA_HTTP_DEADLINE": "inf"},
     "cudelta: error: CUDELTA_HTTP_TIMEOUT='inf' is not accepted; expected a number of seconds from 0.1 to 3600"),
    ({"CUDELTA_WHEEL_URL": "https://mirror .example/releases"},
     "cudelta: error: CUDELTA_WHEEL_URL='https://mirror .example/releases' is not accepted (it holds a space "
     "(U+0020) at position 15); expected an http://, https:// or file:// URL of the folder that holds the release "
     "assets"),
])
def test_a_setting_no_one_can_mean_stops_the_install_in_one_line_before_any_work(
        base_cu, fresh_venv, sdist_without_manifest, tmp_path, compiler_spy, bad, line):
    # Before: inf ended in urllib3's OverflowError traceback; the space in the host failed later as
    # "invalid URL" without naming the variable, and then compiled.
    env = fresh_venv(base_cu)
    e = clean_env(CUDELTA_CACHE_DIR=str(tmp_path / "cache"), **bad)
    proc = env.pip("install", sdist_without_manifest, env=compiler_spy.path_env(e), check=False)
    out = pip_output(proc)

    assert proc.returncode != 0
    assert [x.strip() for x in out.splitlines() if "cudelta:" in x] == [line]  # no target line: nothing ran
    assert "Traceback" not in out
    assert compiler_spy.compiles() == []
    assert not (tmp_path / "cache").exists()
    assert not env.has("cudelta")
