"""tests/e2e/release_server.py: a GitHub-like release server, and the installer's fetcher and pip against it."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import urllib3

from installer.choose.manifest import parse_manifest
from installer.core.errors import FetchError, VerificationError
from installer.core.settings import Settings
from installer.fetch.cache import PARTIAL_PREFIX
from installer.fetch.fetch import Fetcher

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_make_release beside this file
from test_make_release import ARM, VERSION, X86, load_module, make_release, make_wheel  # noqa: E402

release_server = load_module("release_server", ROOT / "tests" / "e2e" / "release_server.py")
ReleaseServer = release_server.ReleaseServer

TAG = f"v{VERSION}"
NAME = f"cudelta-{VERSION}+cu130-cp310-abi3-{X86}.whl"
QUOTED = NAME.replace("+", "%2B")


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("release-server")
    wheels = [make_wheel(base / "in", platform=X86, payload=b"x86 payload " * 5000),
              make_wheel(base / "in", platform=ARM)]
    out = base / "release"
    make_release.make_release(VERSION, out, wheels)
    return out


@pytest.fixture
def server(tmp_path, release_dir):
    with ReleaseServer(tmp_path / "srv-root") as srv:
        srv.add_release(TAG, release_dir)
        yield srv


@pytest.fixture
def http():
    """A plain session that ignores proxy variables (the server is on 127.0.0.1)."""
    with requests.Session() as session:
        session.trust_env = False
        yield session


def fetcher(tmp_path, server, **settings) -> Fetcher:
    settings.setdefault("http_retries", 2)
    session = requests.Session()
    session.trust_env = False
    return Fetcher(Settings(wheel_url=server.base_url(TAG), cache_dir=tmp_path / "c", **settings),
                   session=session, backoff_factor=0, log=lambda line: None)


def cache_files(tmp_path) -> list:
    folder = tmp_path / "c"
    return sorted(p.name for p in folder.rglob("*") if p.is_file() and p.name != ".lock") if folder.exists() else []


# -- the server, as a plain HTTP client sees it ---------------------------------------------------


def test_download_url_redirects_to_storage_and_serves_the_bytes(server, release_dir, http):
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=5)
    assert response.status_code == 200
    assert response.content == (release_dir / NAME).read_bytes()
    assert response.headers["Content-Type"] == "application/octet-stream"
    assert int(response.headers["Content-Length"]) == len(response.content)
    (hop,) = response.history
    assert hop.status_code == 302
    assert response.url.startswith(f"{server.url}/storage/{TAG}/") and "sig=" in response.url
    assert server.paths() == [f"/cudelta/cudelta/releases/download/{TAG}/{NAME}", f"/storage/{TAG}/{NAME}"]


def test_the_302_is_observable(server, http):
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", allow_redirects=False, timeout=5)
    assert response.status_code == 302
    location = response.headers["Location"]
    assert location.startswith(f"http://127.0.0.1:{server.port}/storage/{TAG}/{QUOTED}?sig=")
    method, path, headers = server.requests[-1]
    assert method == "GET" and path.endswith(QUOTED) and "User-Agent" in headers


def test_unknown_files_tags_and_unsigned_storage_urls_are_refused(server, http):
    assert http.get(f"{server.base_url(TAG)}/nope.whl", timeout=5).status_code == 404
    assert http.get(f"{server.base_url('v9.9.9')}/{QUOTED}", timeout=5).status_code == 404
    assert http.get(f"{server.url}/storage/{TAG}/nope.whl?sig=1", timeout=5).status_code == 404
    assert http.get(f"{server.url}/storage/{TAG}/{QUOTED}", timeout=5).status_code == 403
    assert http.get(f"{server.url}/other/repo/releases/download/{TAG}/{QUOTED}", timeout=5).status_code == 404


def test_releases_under_the_root_folder_are_served_without_add_release(tmp_path, release_dir, http):
    root = tmp_path / "root"
    (root / "v0.0.9").mkdir(parents=True)
    (root / "v0.0.9" / "manifest.json").write_text("{}")
    with ReleaseServer(root) as srv:
        assert http.get(f"{srv.base_url('v0.0.9')}/manifest.json", timeout=5).content == b"{}"


def test_fail_next_then_ok(server, http):
    server.fail_next("manifest.json", 503)
    url = f"{server.base_url(TAG)}/manifest.json"
    assert http.get(url, timeout=5).status_code == 503
    assert http.get(url, timeout=5).status_code == 200


def test_fail_next_matches_quoted_and_plain_names_and_sends_headers(server, http):
    server.fail_next(NAME, 403, {"Retry-After": "0"}, times=2)
    url = f"{server.base_url(TAG)}/{QUOTED}"
    for _ in range(2):
        response = http.get(url, timeout=5)
        assert response.status_code == 403 and response.headers["Retry-After"] == "0"
    assert http.get(url, timeout=5).status_code == 200


def test_truncated_body_raises(server, http):
    server.truncate(NAME)
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=5)


def test_static_index_and_root_files(server, release_dir, http):
    page = http.get(f"{server.index_url('cu130')}/cudelta/", timeout=5)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "#sha256=" in page.text
    # A folder without its slash is redirected, as http.server does; pip then reads the page.
    assert http.get(server.index_url("cu130"), allow_redirects=False, timeout=5).status_code == 301
    assert http.get(server.index_url("cu130"), timeout=5).text == (release_dir / "whl/cu130/index.html").read_text()
    assert http.get(f"{server.index_url('cu130', tag=TAG)}/cudelta/", timeout=5).text == page.text
    assert http.get(f"{server.url}/{QUOTED}", timeout=5).content == (release_dir / NAME).read_bytes()
    assert http.get(f"{server.url}/whl/cu999/", timeout=5).status_code == 404


def test_head_and_other_methods(server, release_dir, http):
    head = http.head(f"{server.url}/storage/{TAG}/{QUOTED}?sig=1", timeout=5)
    assert head.status_code == 200 and int(head.headers["Content-Length"]) == (release_dir / NAME).stat().st_size
    assert http.post(f"{server.base_url(TAG)}/manifest.json", data=b"x", timeout=5).status_code == 405


def test_close_frees_the_port_and_is_idempotent(tmp_path, release_dir, http):
    srv = ReleaseServer(tmp_path)
    srv.add_release(TAG, release_dir)
    # An open keep-alive connection must not keep close() waiting.
    assert http.get(f"{srv.base_url(TAG)}/manifest.json", timeout=5).status_code == 200
    srv.close()
    srv.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
    assert not srv._thread.is_alive()


# -- the installer's fetcher through the 302 -------------------------------------------------------


def test_fetcher_gets_manifest_and_verified_asset_through_the_redirect(tmp_path, server, release_dir):
    f = fetcher(tmp_path, server)
    manifest = parse_manifest(f.fetch_json(server.base_url(TAG), "manifest.json"))
    asset = manifest.find(NAME)
    assert asset is not None
    path = f.fetch_asset(server.base_url(TAG), asset.name, asset.sha256, asset.size)
    assert path == tmp_path / "c" / asset.sha256 / NAME
    assert path.read_bytes() == (release_dir / NAME).read_bytes()
    paths = server.paths()
    assert f"/storage/{TAG}/{NAME}" in paths and f"/storage/{TAG}/manifest.json" in paths
    # The name travels escaped: a '+' would be a space to an S3-style storage host.
    assert any(r.path.endswith(QUOTED) for r in server.requests)


def test_fetcher_retries_503_and_403_with_retry_after(tmp_path, server):
    server.fail_next("manifest.json", 503)
    server.fail_next(NAME, 403, {"Retry-After": "0"})
    f = fetcher(tmp_path, server)
    manifest = parse_manifest(f.fetch_json(server.base_url(TAG), "manifest.json"))
    asset = manifest.find(NAME)
    f.fetch_asset(server.base_url(TAG), asset.name, asset.sha256, asset.size)
    assert server.paths().count(f"/cudelta/cudelta/releases/download/{TAG}/manifest.json") == 2
    assert server.paths().count(f"/cudelta/cudelta/releases/download/{TAG}/{NAME}") == 2


def test_fetcher_refuses_replaced_bytes_and_caches_nothing(tmp_path, server):
    manifest = parse_manifest(fetcher(tmp_path, server).fetch_json(server.base_url(TAG), "manifest.json"))
    asset = manifest.find(NAME)
    server.replace_bytes(NAME, b"PK\x03\x04 something else entirely")
    with pytest.raises(VerificationError, match="checksum mismatch"):
        fetcher(tmp_path, server).fetch_asset(server.base_url(TAG), asset.name, asset.sha256, asset.size)
    assert cache_files(tmp_path) == []
    assert not list((tmp_path / "c").rglob(PARTIAL_PREFIX + "*"))


def test_fetcher_gives_up_on_a_body_that_keeps_breaking_off(tmp_path, server):
    manifest = parse_manifest(fetcher(tmp_path, server).fetch_json(server.base_url(TAG), "manifest.json"))
    asset = manifest.find(NAME)
    server.truncate(NAME)
    with pytest.raises(FetchError, match="connection broken"):
        fetcher(tmp_path, server, http_retries=1).fetch_asset(server.base_url(TAG), asset.name, asset.sha256, asset.size)
    assert cache_files(tmp_path) == []


def test_offline_fetcher_sends_no_request(tmp_path, server):
    with pytest.raises(FetchError, match="CUDELTA_OFFLINE"):
        fetcher(tmp_path, server, offline=True).fetch_json(server.base_url(TAG), "manifest.json")
    assert server.requests == []


# -- pip against the PEP 503 index ---------------------------------------------------------------


def pip_download(index_url: str, dest: Path, spec: str = f"cudelta=={VERSION}+cu130") -> subprocess.CompletedProcess:
    try:  # not find_spec("pip"): setuptools' distutils hack hooks that name and warns
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{sys.executable} has no pip")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--isolated",
           "--disable-pip-version-check",
           # The tiny wheels are manylinux cp310-abi3 whatever runs the tests.
           "--only-binary=:all:", "--platform", X86, "--python-version", "3.10", "--implementation", "cp",
           "--abi", "abi3", "--index-url", index_url, "-d", str(dest), spec]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("through", ["root", "release download URL"])
def test_pip_downloads_from_the_index(tmp_path, server, release_dir, through):
    index = server.index_url("cu130") if through == "root" else server.index_url("cu130", tag=TAG)
    proc = pip_download(index, tmp_path / "dl", spec=f"cudelta=={VERSION}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == [NAME]
    assert (tmp_path / "dl" / NAME).read_bytes() == (release_dir / NAME).read_bytes()
    assert "/whl/cu130/cudelta/" in " ".join(server.paths())
    if through != "root":
        assert f"/storage/{TAG}/{NAME}" in server.paths()  # pip followed the 302


def test_pip_checks_the_index_digest(tmp_path, server):
    server.replace_bytes(NAME, b"PK\x03\x04 not the released wheel")
    proc = pip_download(server.index_url("cu130"), tmp_path / "dl")
    assert proc.returncode != 0
    assert "DO NOT MATCH THE HASHES" in proc.stdout + proc.stderr
    assert not (tmp_path / "dl" / NAME).exists()


# -- fault modes: trickle, overlong bodies, redirects elsewhere -------------------------------------


def test_trickle_sends_at_the_rate_then_the_whole_file(server, release_dir, http):
    data = (release_dir / NAME).read_bytes()[:2000]
    server.replace_bytes(NAME, data)
    server.trickle(NAME, 4000, times=1)
    started = time.monotonic()
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=5)
    took = time.monotonic() - started
    assert response.content == data and 0.4 < took < 2.0  # 2000 bytes at 4000 B/s
    started = time.monotonic()
    assert http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=5).content == data  # times=1: back to normal
    assert time.monotonic() - started < 0.4
    assert server.bytes_sent(NAME) == 2 * len(data)


def test_trickle_at_zero_sends_headers_then_nothing(server, http):
    server.trickle(NAME, 0)
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=(5, 0.3), stream=True)
    assert response.status_code == 200 and int(response.headers["Content-Length"]) > 0
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        response.raw.read(1)
    response.close()
    assert server.bytes_sent(NAME) == 0


def test_overlong_announced_and_close_delimited(server, release_dir, http):
    data = (release_dir / NAME).read_bytes()
    server.overlong(NAME, 1000, announce=True)
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=5)
    assert int(response.headers["Content-Length"]) == len(data) + 1000
    assert response.content[: len(data)] == data and len(response.content) == len(data) + 1000
    server.overlong(NAME, 500)
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", timeout=5)
    assert "Content-Length" not in response.headers and response.headers["Connection"] == "close"
    assert len(response.content) == len(data) + 500


def test_redirect_elsewhere_is_what_the_302_says(server, http):
    server.redirect(NAME, "http://example.invalid/asset.whl")
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", allow_redirects=False, timeout=5)
    assert response.status_code == 302 and response.headers["Location"] == "http://example.invalid/asset.whl"
    server.reset_faults()
    response = http.get(f"{server.base_url(TAG)}/{QUOTED}", allow_redirects=False, timeout=5)
    assert response.headers["Location"].startswith(f"{server.url}/storage/")
