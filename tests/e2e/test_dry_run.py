"""`python -m release.dry_run --out DIR` end to end: the release it writes passes every check, is
manylinux_2_28 by auditwheel, and installs, served on 127.0.0.1 like GitHub Releases + Pages:
through the sdist (verified against the manifest embedded in it), and straight from the PEP 503
index with pip and with uv. A valid but different wheel in its place is refused.

One dry run per session (conftest.py: it also serves every other end-to-end test); every case
reads its output.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import TAG, VERSION, clean_env, find_uv, pip_output, run
from release_server import ReleaseServer

pytestmark = pytest.mark.e2e

from installer.compile import platform_tag
from release import wheel_parsers


@pytest.fixture
def release(dry_run):
    return dry_run[0]


@pytest.fixture
def wheel(release) -> Path:
    (path,) = release.glob(f"cudelta-{VERSION}+cu130-*.whl")
    return path


@pytest.fixture
def served(release, tmp_path):
    with ReleaseServer(tmp_path / "srv") as srv:
        srv.add_release(TAG, release)
        yield srv


def install_env(server, tmp_path, **extra):
    return clean_env(CUDELTA_WHEEL_URL=server.base_url(TAG), CUDELTA_CACHE_DIR=str(tmp_path / "cache"), **extra)


def installed(env) -> dict:
    code = ("import json, importlib.metadata as m, cudelta._native as n\n"
            "d = m.distribution('cudelta')\n"
            "s = n.status()\n"
            "print(json.dumps({'version': d.version, 'source': d.read_text('cudelta_source.json'),\n"
            "                  'loaded': s.loaded, 'reason': s.reason, 'build': s.build_info}))\n")
    return json.loads(env.py(code).stdout)


def test_the_release_folder_is_complete_and_every_check_passed(dry_run, wheel):
    release, printed, checks = dry_run
    files = sorted(str(p.relative_to(release)) for p in release.rglob("*") if p.is_file())
    assert files == sorted(["SHA256SUMS", wheel.name, f"cudelta-{VERSION}.tar.gz", "manifest.json",
                            "whl/cu130/index.html", "whl/cu130/cudelta/index.html"])
    assert checks["failed"] == []
    statuses = {c["name"]: c["status"] for c in checks["checks"]}
    names = wheel_parsers.CHECK_NAMES
    assert {name: statuses.get(name) for name in names} == {name: "PASS" for name in names}
    # SHA256SUMS covers every asset and matches it; the manifest names the wheel with its digest.
    sums = dict(reversed(line.split("  ", 1)) for line in (release / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {wheel.name, f"cudelta-{VERSION}.tar.gz", "manifest.json"}
    for name, digest in sums.items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == digest, name
    (asset,) = json.loads((release / "manifest.json").read_text())["assets"]
    assert (asset["name"], asset["sha256"], asset["size"]) == (wheel.name, sums[wheel.name], wheel.stat().st_size)
    assert f"#sha256={sums[wheel.name]}" in (release / "whl/cu130/cudelta/index.html").read_text()
    # The summary names every asset with its size and every check's verdict.
    for name in sums:
        assert re.search(rf"{re.escape(name)}\s+[\d.]+ [kM]B", printed), name
    assert f"wheel checks: {len(wheel_parsers.CHECK_NAMES)} passed, 0 failed" in printed


def test_auditwheel_and_the_symbols_say_manylinux_2_28(wheel, tmp_path):
    assert wheel.name.endswith("-cp310-abi3-manylinux_2_28_x86_64.whl")
    report = json.loads(run([sys.executable, "-m", "auditwheel", "show", "--json", wheel]).stdout)
    problems, granted = wheel_parsers.auditwheel_verdict(report, "manylinux_2_28_x86_64", wheel_parsers.TORCH_LIBS)
    assert (problems, granted) == ([], "manylinux_2_28_x86_64")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(wheel_parsers.LIBRARY, tmp_path)
    lib = tmp_path / wheel_parsers.LIBRARY
    symbols = run(["objdump", "-T", lib]).stdout
    assert max(platform_tag.glibc_versions(symbols)) <= (2, 28)
    needed = wheel_parsers.parse_needed(run(["objdump", "-p", lib]).stdout)
    assert not [n for n in needed if n.startswith(("libcudart", "libcuda."))], needed


def test_the_sdist_installs_the_verified_wheel(base_cu, fresh_venv, release, wheel, served, tmp_path):
    env = fresh_venv(base_cu)
    sdist = release / f"cudelta-{VERSION}.tar.gz"
    out = pip_output(env.pip("install", "-v", sdist, env=install_env(served, tmp_path)))

    assert "embedded" in out and wheel.name in out and "sha256 verified" in out
    assert not any(p.endswith("manifest.json") for p in served.paths())  # the sdist brought its own
    record = installed(env)
    assert record["version"] == VERSION and json.loads(record["source"])["asset"] == wheel.name
    assert record["loaded"], record["reason"]
    assert record["build"]["build"] == "release" and record["build"]["cuda_label"] == "cu130"


def test_pip_installs_the_wheel_from_the_index(base_cu, fresh_venv, wheel, served, tmp_path):
    env = fresh_venv(base_cu)
    out = pip_output(env.pip("install", "-v", "cudelta", "--index-url", served.index_url("cu130"),
                             env=install_env(served, tmp_path)))
    assert "Building wheel" not in out and "setup.py" not in out  # the release wheel itself, no sdist build
    assert "Requirement already satisfied: torch>=2.10" in out
    assert wheel.name in " ".join(served.paths()).replace("%2B", "+")
    record = installed(env)
    assert record["version"] == f"{VERSION}+cu130" and record["loaded"], record


def test_uv_installs_the_wheel_from_the_index(base_cu, fresh_venv, wheel, served, tmp_path):
    env = fresh_venv(base_cu)
    uv = find_uv()
    assert uv, "uv is in scripts/test.sh's runner venv"
    # --no-deps: this venv sees the base's torch through a .pth, which pip honours and uv does not
    # (uv would fetch torch from the index, which holds only cudelta).
    proc = subprocess.run([uv, "pip", "install", "--python", str(env.python), "--no-deps", "--no-cache",
                           "cudelta", "--index-url", served.index_url("cu130")],
                          env=install_env(served, tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"+ cudelta=={VERSION}+cu130" in proc.stderr
    record = installed(env)
    assert record["version"] == f"{VERSION}+cu130" and record["loaded"], record


def swapped_wheel(original: Path, dst_dir: Path) -> Path:
    """The same wheel re-zipped with a file changed (and top_level.txt, which nothing needs, left out):
    a valid wheel of the same name (RECORD rewritten), a little smaller than the original, so the
    download completes and the sha256 is what tells them apart."""
    from wheel.wheelfile import WheelFile

    dst = dst_dir / original.name
    with zipfile.ZipFile(original) as src, WheelFile(dst, "w") as out:
        for info in src.infolist():
            if info.filename.endswith((".dist-info/RECORD", ".dist-info/top_level.txt")):
                continue
            data = src.read(info)
            if info.filename == "cudelta/__init__.py":
                data = data.replace(b"\n", b" \n", 1)
            out.writestr(info, data)
    assert dst.stat().st_size < original.stat().st_size
    return dst


def test_a_swapped_valid_wheel_is_refused_by_the_embedded_manifest(base_cu, fresh_venv, release, wheel, tmp_path):
    # A hostile host replaces the wheel AND rewrites manifest.json and SHA256SUMS to match: only the
    # manifest inside the sdist (which PyPI served and hashed) can tell.
    hostile = tmp_path / "hostile"
    shutil.copytree(release, hostile)
    evil = swapped_wheel(wheel, tmp_path)
    assert run([sys.executable, "-m", "twine", "check", "--strict", evil]).returncode == 0  # a valid wheel
    evil_sha = hashlib.sha256(evil.read_bytes()).hexdigest()
    shutil.copyfile(evil, hostile / wheel.name)
    manifest = json.loads((hostile / "manifest.json").read_text())
    manifest["assets"][0].update(sha256=evil_sha, size=evil.stat().st_size)
    (hostile / "manifest.json").write_text(json.dumps(manifest))
    sums = (hostile / "SHA256SUMS").read_text()
    (hostile / "SHA256SUMS").write_text(sums.replace(hashlib.sha256(wheel.read_bytes()).hexdigest(), evil_sha))

    env = fresh_venv(base_cu)
    with ReleaseServer(tmp_path / "srv") as srv:
        srv.add_release(TAG, hostile)
        proc = env.pip("install", hostile / f"cudelta-{VERSION}.tar.gz", env=install_env(srv, tmp_path), check=False)
    out = pip_output(proc)
    assert proc.returncode != 0
    real_sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert "sha256" in out and wheel.name in out and real_sha in out and evil_sha in out, out[-3000:]
    assert "Traceback" not in out
    assert not env.has("cudelta")
