"""release/make_release.py: release assets from real (tiny) wheels, checked as the installer and pip read them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional
from urllib.parse import quote, unquote, urljoin, urlsplit

import pytest
from wheel.wheelfile import WheelFile

from installer.choose.manifest import loads_manifest, parse_manifest
from release import assemble_release, make_release

ROOT = Path(__file__).resolve().parents[2]


def load_module(name: str, path: Path) -> ModuleType:
    """Import a script or test helper by path (scripts/ and tests/e2e/ are not packages), once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


ReleaseError = make_release.ReleaseError

VERSION = "0.1.0"
X86 = "manylinux_2_28_x86_64"
ARM = "manylinux_2_28_aarch64"
BUILD_INFO: Dict[str, Any] = {
    "version": VERSION,
    "variant": "cu130",
    "cuda_toolkit": "13.0",
    "archs": ["sm_80", "sm_90a", "sm_100f", "sm_120f"],
    "ptx": ["compute_120"],
    "torch_built_with": "2.14.1+cu130",
    "torch_floor": "2.10",
    "python_floor": "3.10",
    "git_revision": "0123456789ab",
    "build": "release",
    "fatbin_compression": True,
}


def wheel_name(version: str = f"{VERSION}+cu130", platform: str = X86) -> str:
    return f"cudelta-{version}-cp310-abi3-{platform}.whl"


def make_wheel(folder: Path, version: str = f"{VERSION}+cu130", platform: str = X86, *,
               metadata_version: Optional[str] = None, build_info: Optional[Dict[str, Any]] = None,
               with_build_info: bool = True, payload: bytes = b"") -> Path:
    """A real, installable wheel: package cudelta with a build record, METADATA, WHEEL, RECORD."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / wheel_name(version, platform)
    info = f"cudelta-{version}.dist-info"
    with WheelFile(path, "w") as wf:
        wf.writestr("cudelta/__init__.py", "__version__ = %r\n" % VERSION)
        wf.writestr("cudelta/_C.abi3.so", payload or platform.encode() * 64)
        if with_build_info:
            wf.writestr("cudelta/_build_info.json", json.dumps(build_info or BUILD_INFO, indent=1))
        wf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: cudelta\nVersion: {metadata_version or version}\n"
                    "Requires-Python: >=3.10\n")
        wf.writestr(f"{info}/WHEEL",
                    f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: cp310-abi3-{platform}\n")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: List[Dict[str, Optional[str]]] = []

    def handle_starttag(self, tag: str, attrs) -> None:  # noqa: ANN001
        if tag == "a":
            self.links.append(dict(attrs))


def link_text(release: Path, href: str) -> str:
    """The file name a relative index link points at, checked to be a file of the release folder."""
    target = (release / "whl" / "cu130" / "cudelta" / unquote(href.split("#")[0])).resolve()
    assert target.parent == release.resolve() and target.is_file(), href
    return target.name


def links_of(page: Path) -> List[Dict[str, Optional[str]]]:
    parser = _Links()
    parser.feed(page.read_text())
    return parser.links


@pytest.fixture
def wheels(tmp_path) -> List[Path]:
    return [make_wheel(tmp_path / "in", platform=X86), make_wheel(tmp_path / "in", platform=ARM)]


@pytest.fixture
def release(tmp_path, wheels) -> Path:
    out = tmp_path / "release"
    assert make_release.main(["--version", VERSION, "--out", str(out), *map(str, wheels)]) == 0
    return out


# -- the assets ---------------------------------------------------------------------------------


def test_release_folder_holds_wheels_manifest_sums_and_index(release, wheels):
    files = sorted(str(p.relative_to(release)) for p in release.rglob("*") if p.is_file())
    assert files == sorted([w.name for w in wheels] + [
        "SHA256SUMS", "manifest.json", "whl/cu130/index.html", "whl/cu130/cudelta/index.html"])
    for w in wheels:
        assert (release / w.name).read_bytes() == w.read_bytes()


def test_manifest_parses_as_the_installer_reads_it(release, wheels):
    manifest = loads_manifest((release / "manifest.json").read_text())
    assert manifest == parse_manifest(json.loads((release / "manifest.json").read_text()))
    assert manifest.version == VERSION and manifest.schema == 1
    assert sorted(a.name for a in manifest.assets) == sorted(w.name for w in wheels)
    for w in wheels:
        asset = manifest.find(w.name)
        assert asset is not None
        assert asset.size == w.stat().st_size
        assert asset.sha256 == sha256(w)
        assert asset.cuda == "13.0" and asset.driver_floor == "13.0"
        assert asset.archs == tuple(BUILD_INFO["archs"]) and asset.ptx == ("compute_120",)
        assert asset.torch_floor == "2.10" and asset.python_floor == "3.10"
    assert manifest.find(wheel_name(platform=ARM)).platform == ARM
    assert manifest.find(wheel_name(platform=X86)).platform == X86


def test_sha256sums_cover_wheels_and_manifest(release, wheels):
    lines = (release / "SHA256SUMS").read_text().splitlines()
    entries = {}
    for line in lines:
        digest, name = line.split("  ", 1)  # sha256sum's text-mode format
        entries[name] = digest
    assert set(entries) == {w.name for w in wheels} | {"manifest.json"}
    for name, digest in entries.items():
        assert sha256(release / name) == digest


def test_index_links_resolve_to_the_wheels_with_their_digest(release, wheels):
    root = links_of(release / "whl" / "cu130" / "index.html")
    assert [link["href"] for link in root] == ["cudelta/"]
    page_url = "http://host:1/whl/cu130/cudelta/"  # what pip fetches for --index-url …/whl/cu130
    links = links_of(release / "whl" / "cu130" / "cudelta" / "index.html")
    assert len(links) == len(wheels)
    for link in links:
        href = link["href"]
        assert href is not None and not urlsplit(href).scheme  # relative: DIR works wherever it is served
        url, _, fragment = urljoin(page_url, href).partition("#")
        name = link_text(release, href)
        # Served from DIR's root, the link is DIR/<wheel>, with '+' escaped.
        assert url == "http://host:1/" + quote(name, safe="")
        assert name in {w.name for w in wheels}
        assert fragment == f"sha256={sha256(release / name)}"
        assert link["data-requires-python"] == ">=3.10"


def test_link_base_makes_absolute_links(tmp_path, wheels):
    out = tmp_path / "abs"
    base = "https://github.com/cudelta/cudelta/releases/download/v0.1.0"
    make_release.make_release(VERSION, out, wheels, link_base=base + "/")
    hrefs = [link["href"] for link in links_of(out / "whl" / "cu130" / "cudelta" / "index.html")]
    assert sorted(hrefs) == sorted(
        f"{base}/{w.name.replace('+', '%2B')}#sha256={sha256(w)}" for w in wheels)


def test_each_cuda_flavour_gets_its_own_index(tmp_path):
    cu129 = make_wheel(tmp_path / "in", f"{VERSION}+cu129",
                       build_info={**BUILD_INFO, "cuda_toolkit": "12.9", "variant": "cu129"})
    cu130 = make_wheel(tmp_path / "in")
    manifest = make_release.make_release(VERSION, tmp_path / "out", [cu129, cu130])
    assert sorted(a.cuda for a in manifest.assets) == ["12.9", "13.0"]
    assert manifest.find(cu129.name).driver_floor == "12.0"
    for flav, wheel in (("cu129", cu129), ("cu130", cu130)):
        (link,) = links_of(tmp_path / "out" / "whl" / flav / "cudelta" / "index.html")
        assert unquote(link["href"].split("#")[0]).endswith("/" + wheel.name)


def test_make_asset_is_a_pure_function_of_its_inputs():
    name = wheel_name()
    info = {**BUILD_INFO, "cuda_toolkit": "13.0.88"}
    asset = make_release.make_asset(name, 123, "ab" * 32, info)
    assert asset == make_release.make_asset(name, 123, "ab" * 32, info)
    assert (asset.name, asset.size, asset.sha256) == (name, 123, "ab" * 32)
    assert (asset.cuda, asset.platform, asset.driver_floor) == ("13.0", X86, "13.0")


def test_script_runs_as_the_workflow_calls_it(tmp_path, wheels):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "release.make_release", "--version", VERSION,
                           "--out", str(out), *map(str, wheels)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "cu130" in proc.stdout
    assert loads_manifest((out / "manifest.json").read_text()).version == VERSION


# -- refused inputs -------------------------------------------------------------------------------


def refused(tmp_path, *wheels: Path, version: str = VERSION) -> str:
    out = tmp_path / "refused"
    with pytest.raises(ReleaseError) as info:
        make_release.make_release(version, out, list(wheels))
    assert not out.exists(), "nothing may be written for refused inputs"
    return str(info.value)


def test_the_same_wheel_twice_is_an_error(tmp_path, wheels):
    assert "given twice" in refused(tmp_path, wheels[0], wheels[1], wheels[0])


def test_a_wheel_of_another_version_is_an_error(tmp_path):
    other = make_wheel(tmp_path / "in", "0.2.0+cu130")
    message = refused(tmp_path, other)
    assert "0.2.0" in message and "--version 0.1.0" in message


def test_a_label_only_in_the_file_name_is_an_error(tmp_path):
    message = refused(tmp_path, make_wheel(tmp_path / "in", metadata_version=VERSION))
    assert "METADATA" in message and "0.1.0+cu130" in message


def test_a_wheel_without_build_record_is_an_error(tmp_path):
    assert "_build_info.json" in refused(tmp_path, make_wheel(tmp_path / "in", with_build_info=False))


def test_a_build_record_the_manifest_would_refuse_is_an_error(tmp_path):
    bad = make_wheel(tmp_path / "in", build_info={**BUILD_INFO, "archs": ["sm90"]})
    assert "archs" in refused(tmp_path, bad)


def test_two_wheels_for_one_toolkit_and_platform_are_an_error(tmp_path):
    a = make_wheel(tmp_path / "a")
    b = tmp_path / "b" / wheel_name().replace("cp310", "cp311")
    b.parent.mkdir()
    make_wheel(tmp_path / "tmp").rename(b)
    assert "both CUDA 13.0 wheels" in refused(tmp_path, a, b)


def test_a_non_empty_out_dir_is_refused(tmp_path, wheels):
    out = tmp_path / "used"
    out.mkdir()
    (out / "stale.whl").write_bytes(b"old")
    with pytest.raises(ReleaseError, match="new or empty folder"):
        make_release.make_release(VERSION, out, wheels)


def test_main_reports_errors_in_one_line(tmp_path, wheels, capsys):
    rc = make_release.main(["--version", "0.2.0", "--out", str(tmp_path / "x"), str(wheels[0])])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.startswith("make_release: error: ") and "Traceback" not in err


# -- the fan-in around it (release/assemble_release.py) -----------------------------------------

def fake_sdist(folder: Path, manifest_text: Optional[str], version: str = VERSION, extra: tuple = ()) -> Path:
    import io
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cudelta-{version}.tar.gz"
    members = {f"cudelta-{version}/PKG-INFO": f"Metadata-Version: 2.4\nName: cudelta\nVersion: {version}\n"}
    members.update({f"cudelta-{version}/{name}": "" for name in extra})
    if manifest_text is not None:
        members[f"cudelta-{version}/{assemble_release.EMBEDDED}"] = manifest_text
    with tarfile.open(path, "w:gz") as tf:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_the_sdist_joins_sha256sums_in_order(release):
    sdist = fake_sdist(release, None)
    assemble_release.add_to_sums(release, [sdist])
    lines = (release / "SHA256SUMS").read_text().splitlines()
    names = [line.split("  ", 1)[1] for line in lines]
    assert names == sorted(names) and sdist.name in names
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=release).returncode == 0


def test_an_sdist_without_the_manifest_or_with_another_is_refused(release, tmp_path):
    manifest = release / "manifest.json"
    missing = assemble_release.check_sdist(fake_sdist(tmp_path / "a", None), manifest, VERSION)
    assert any("no installer/release_manifest.json inside" in p for p in missing)
    other = json.loads(manifest.read_text())
    other["assets"] = other["assets"][:1]
    differs = assemble_release.check_sdist(fake_sdist(tmp_path / "b", json.dumps(other)), manifest, VERSION)
    assert any("differs from" in p for p in differs)
    same = assemble_release.check_sdist(fake_sdist(tmp_path / "c", manifest.read_text()), manifest, VERSION)
    assert not any("manifest" in p for p in same), same
    wrong_version = assemble_release.check_sdist(fake_sdist(tmp_path / "d", None, "0.2.0"), manifest, VERSION)
    assert any("is not cudelta-0.1.0.tar.gz" in p for p in wrong_version)


def test_an_sdist_carrying_the_release_tooling_is_refused(release, tmp_path):
    manifest = release / "manifest.json"
    policy = ("cudelta/_release_policy.py",)  # the policy ships: the loader's driver guard reads it
    assert not any("inside" in p for p in assemble_release.check_sdist(
        fake_sdist(tmp_path / "a", manifest.read_text(), extra=policy), manifest, VERSION))
    for tool in ("release/check_wheel.py", "scripts/test.sh"):
        problems = assemble_release.check_sdist(fake_sdist(tmp_path / tool.split("/")[0], manifest.read_text(),
                                                           extra=policy + (tool,)), manifest, VERSION)
        assert any(f"release tooling inside: cudelta-{VERSION}/{tool}" in p for p in problems), problems
