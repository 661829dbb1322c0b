import hashlib
import os
import socket
import threading
import time
from collections import Counter
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from urllib3.exceptions import MaxRetryError
import requests
import responses
from urllib3.response import HTTPResponse

from installer.core.errors import FetchError, VerificationError
from installer.core.settings import Settings
from installer.fetch import fetch
from installer.fetch.cache import LOCK_NAME, LOCK_OWNER_NAME
from installer.fetch.transfer import RATE_WINDOW_S, CappedRetry, Transfer, TransferStopped
from installer.fetch.urls import auth_headers, check_redirect, display_url

NAME = "cudelta-0.1.0-cp310-abi3-manylinux_2_28_x86_64.whl"
BODY = b"PK\x03\x04 not really a wheel " * 1000
SHA = hashlib.sha256(BODY).hexdigest()
GH_BASE = "https://github.com/cudelta/cudelta/releases/download/v0.1.0"
GH_URL = f"{GH_BASE}/{NAME}"
STORAGE_URL = "https://release-assets.githubusercontent.com/github-production-release-asset/42/abc"
MIRROR_BASE = "https://mirror.example/cudelta/v0.1.0"
MIRROR_URL = f"{MIRROR_BASE}/{NAME}"
TOKEN = "ghp_s3cr3tT0kenValue"
RETRIES = 2


def make_fetcher(tmp_path, logs=None, session=None, lock_wait=fetch.LOCK_WAIT_S, **settings):
    settings.setdefault("http_retries", RETRIES)
    return fetch.Fetcher(
        Settings(cache_dir=tmp_path / "cache", **settings),
        session=session,
        backoff_factor=0,
        log=(logs.append if logs is not None else lambda line: None),
        lock_wait=lock_wait,
    )


def cache_entries(tmp_path, sha=SHA):
    """Files in the asset's cache folder other than the lock."""
    folder = tmp_path / "cache" / sha
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


@pytest.fixture
def mocked():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as r:
        yield r


# -- downloads ------------------------------------------------------------------------------------


def test_download_lands_verified_in_content_addressed_cache(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    logs = []
    path = make_fetcher(tmp_path, logs).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert path == tmp_path / "cache" / SHA / NAME
    assert path.read_bytes() == BODY
    assert cache_entries(tmp_path) == [NAME]
    assert any(line.startswith(f"downloading {NAME} (0.0 MB) from mirror.example") for line in logs)
    assert any(line.startswith(f"downloaded {NAME} in ") for line in logs)


def test_asset_name_with_local_version_label_is_escaped(tmp_path, mocked):
    name = "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
    mocked.add(responses.GET, f"{MIRROR_BASE}/cudelta-0.1.0%2Bcu130-cp310-abi3-manylinux_2_28_x86_64.whl", body=BODY)
    path = make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, name, SHA, None)
    assert path.name == name and path.read_bytes() == BODY


def test_github_redirect_keeps_token_off_the_storage_host(tmp_path, mocked):
    mocked.add(responses.GET, GH_URL, status=302, headers={"Location": STORAGE_URL})
    mocked.add(responses.GET, STORAGE_URL, body=BODY)
    path = make_fetcher(tmp_path, github_token=TOKEN).fetch_asset(GH_BASE, NAME, SHA, len(BODY))
    assert path.read_bytes() == BODY
    assert [c.request.url for c in mocked.calls] == [GH_URL, STORAGE_URL]
    assert mocked.calls[0].request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert "Authorization" not in mocked.calls[1].request.headers


def test_token_not_sent_to_a_mirror(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    make_fetcher(tmp_path, github_token=TOKEN).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert "Authorization" not in mocked.calls[0].request.headers


@pytest.mark.parametrize(
    "url, sent",
    [
        ("https://github.com/o/r/releases/download/v1/x", True),
        ("https://api.github.com/repos/o/r/releases", True),
        ("https://GitHub.com/o/r", True),
        ("http://github.com/o/r", False),
        ("https://github.com:8443/o/r", False),
        ("https://github.com.evil.example/o/r", False),
        ("https://evilgithub.com/o/r", False),
        ("https://objects.githubusercontent.com/x", False),
        ("file:///tmp/wheelhouse/x", False),
    ],
)
def test_auth_headers_only_for_github_over_https(url, sent):
    assert auth_headers(url, TOKEN) == ({"Authorization": f"Bearer {TOKEN}"} if sent else {})
    assert auth_headers(url, None) == {}


def test_404_is_a_fetch_error_naming_status_and_url(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, status=404)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    message = str(info.value)
    assert "HTTP 404 Not Found" in message and MIRROR_URL in message and "(1 attempt)" in message
    assert len(mocked.calls) == 1
    assert cache_entries(tmp_path) == []


def test_403_with_retry_after_is_retried(tmp_path, mocked):
    mocked.add(responses.GET, GH_URL, status=403, headers={"Retry-After": "1"})
    mocked.add(responses.GET, GH_URL, body=BODY)
    path = make_fetcher(tmp_path).fetch_asset(GH_BASE, NAME, SHA, len(BODY))
    assert path.read_bytes() == BODY
    assert len(mocked.calls) == 2


def test_403_without_retry_after_is_not_retried(tmp_path, mocked):
    mocked.add(responses.GET, GH_URL, status=403)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_asset(GH_BASE, NAME, SHA, len(BODY))
    assert len(mocked.calls) == 1
    assert "HTTP 403 Forbidden" in str(info.value)
    assert "GITHUB_TOKEN" in str(info.value)  # the hint, for a GitHub host without a token


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_transient_status_then_200(tmp_path, mocked, status):
    mocked.add(responses.GET, MIRROR_URL, status=status)
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    path = make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert path.read_bytes() == BODY
    assert len(mocked.calls) == 2


def test_500_forever_gives_up_after_retries_plus_one(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, status=500)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert len(mocked.calls) == RETRIES + 1
    assert "HTTP 500 Internal Server Error" in str(info.value)
    assert f"({RETRIES + 1} attempts)" in str(info.value)
    assert cache_entries(tmp_path) == []


def test_truncated_body_leaves_nothing_in_cache(tmp_path, mocked):
    mocked.add(
        responses.GET,
        MIRROR_URL,
        body=BODY[:100],
        headers={"Content-Length": str(len(BODY))},
        auto_calculate_content_length=False,
    )
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert "connection broken" in str(info.value) and "IncompleteRead" in str(info.value)
    # urllib3 cannot retry a body that breaks off; the fetcher retries the download itself.
    assert len(mocked.calls) == RETRIES + 1
    assert cache_entries(tmp_path) == []


def test_wrong_checksum_is_never_retried_nor_kept(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY + b"tampered")
    with pytest.raises(VerificationError) as info:
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, None)
    assert SHA in str(info.value) and "FORCE_BUILD=1" in str(info.value)
    assert len(mocked.calls) == 1
    assert cache_entries(tmp_path) == []  # no final file, no .partial- file


def test_wrong_size_is_a_verification_error(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    with pytest.raises(VerificationError):
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY) - 1)
    assert cache_entries(tmp_path) == []


@pytest.mark.parametrize(
    "error, words",
    [
        (requests.exceptions.ConnectTimeout(), "connection timed out after 10 s"),
        (requests.exceptions.ReadTimeout(), "timed out after 30 s waiting for data"),
        (requests.exceptions.ConnectionError(), "connection error"),
    ],
)
def test_network_errors_become_fetch_errors(tmp_path, mocked, error, words):
    mocked.add(responses.GET, MIRROR_URL, body=error)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert words in str(info.value) and MIRROR_URL in str(info.value)
    assert cache_entries(tmp_path) == []


def test_token_never_appears_in_errors(tmp_path, mocked):
    mocked.add(responses.GET, GH_URL, status=404)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path, github_token=TOKEN).fetch_asset(GH_BASE, NAME, SHA, len(BODY))
    assert TOKEN not in str(info.value) and TOKEN not in repr(info.value)
    assert "GITHUB_TOKEN" not in str(info.value)  # 404: no rate-limit hint


def test_display_url_drops_credentials_and_query():
    shown = display_url("https://user:pa55@mirror.example:8443/a/b.whl?X-Amz-Signature=zz#f")
    assert shown == "https://mirror.example:8443/a/b.whl"


# -- cache ----------------------------------------------------------------------------------------


def test_cache_hit_makes_no_request(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    first = make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    logs = []
    second = make_fetcher(tmp_path, logs).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert first == second
    assert len(mocked.calls) == 1
    assert any(line.startswith(f"using cached {NAME}") for line in logs)


def test_corrupted_cached_file_is_downloaded_again(tmp_path, mocked):
    cached = tmp_path / "cache" / SHA / NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"bit rot")
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    logs = []
    path = make_fetcher(tmp_path, logs).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert path.read_bytes() == BODY
    assert len(mocked.calls) == 1
    assert any("unusable" in line for line in logs)


def test_leftover_partial_files_are_cleaned_under_the_lock(tmp_path, mocked):
    folder = tmp_path / "cache" / SHA
    folder.mkdir(parents=True)
    (folder / ".partial-killed").write_bytes(b"half")
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert cache_entries(tmp_path) == [NAME]


def test_concurrent_fetches_download_once(tmp_path, mocked):
    def slow(request):
        time.sleep(0.2)
        return (200, {}, BODY)

    mocked.add_callback(responses.GET, MIRROR_URL, callback=slow)
    results, errors = [], []

    def worker():
        try:
            results.append(make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert len(mocked.calls) == 1


@pytest.mark.parametrize("sha", [None, "", "abc", "../" + SHA[3:]])
def test_asset_without_valid_sha256_is_refused_before_any_request(tmp_path, mocked, sha):
    with pytest.raises(VerificationError, match="refusing to install an unverified wheel"):
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, sha, len(BODY))
    assert len(mocked.calls) == 0


@pytest.mark.parametrize("name", ["", "../evil.whl", "a/b.whl", ".lock"])
def test_asset_name_must_be_a_plain_file_name(tmp_path, mocked, name):
    with pytest.raises(FetchError, match="not a plain file name"):
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, name, SHA, len(BODY))
    assert len(mocked.calls) == 0


# -- offline and file:// --------------------------------------------------------------------------


@pytest.fixture
def wheelhouse(tmp_path):
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    (folder / NAME).write_bytes(BODY)
    (folder / "manifest.json").write_text('{"version": "0.1.0", "assets": []}')
    return folder


def test_offline_refuses_http(tmp_path, mocked):
    fetcher = make_fetcher(tmp_path, offline=True)
    with pytest.raises(FetchError) as info:
        fetcher.fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert str(info.value) == (
        f"CUDELTA_OFFLINE=1: not downloading {MIRROR_URL}; point CUDELTA_WHEEL_URL at a file:// "
        "wheelhouse or unset CUDELTA_OFFLINE"
    )
    with pytest.raises(FetchError, match="CUDELTA_OFFLINE=1"):
        fetcher.fetch_json(MIRROR_BASE, "manifest.json")
    assert len(mocked.calls) == 0


def test_offline_still_uses_the_cache(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    path = make_fetcher(tmp_path, offline=True).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert path.read_bytes() == BODY and len(mocked.calls) == 1


def test_file_wheelhouse_works_offline(tmp_path, wheelhouse):
    fetcher = make_fetcher(tmp_path, offline=True)
    path = fetcher.fetch_asset(wheelhouse.as_uri(), NAME, SHA, len(BODY))
    assert path == tmp_path / "cache" / SHA / NAME and path.read_bytes() == BODY
    assert fetcher.fetch_json(wheelhouse.as_uri(), "manifest.json") == {"version": "0.1.0", "assets": []}


def test_file_wheelhouse_missing_file(tmp_path, wheelhouse):
    fetcher = make_fetcher(tmp_path)
    with pytest.raises(FetchError, match="could not read file://.*missing.whl"):
        fetcher.fetch_asset(wheelhouse.as_uri(), "missing.whl", SHA, None)
    with pytest.raises(FetchError, match="could not read file://.*nope.json"):
        fetcher.fetch_json(wheelhouse.as_uri(), "nope.json")


def test_file_wheelhouse_is_verified_too(tmp_path, wheelhouse):
    (wheelhouse / NAME).write_bytes(BODY + b"tampered")
    with pytest.raises(VerificationError):
        make_fetcher(tmp_path).fetch_asset(wheelhouse.as_uri(), NAME, SHA, None)
    assert cache_entries(tmp_path) == []


# -- the manifest ---------------------------------------------------------------------------------


def test_fetch_json_over_http(tmp_path, mocked):
    mocked.add(responses.GET, f"{GH_BASE}/manifest.json", json={"assets": [1]})
    assert make_fetcher(tmp_path).fetch_json(GH_BASE, "manifest.json") == {"assets": [1]}


@pytest.mark.parametrize("body, words", [(b"<html>not json", "is not valid JSON"), (b"[1, 2]", "not an object")])
def test_fetch_json_rejects_bad_content(tmp_path, mocked, body, words):
    mocked.add(responses.GET, f"{GH_BASE}/manifest.json", body=body)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_json(GH_BASE, "manifest.json")
    assert words in str(info.value) and f"{GH_BASE}/manifest.json" in str(info.value)


def test_fetch_json_invalid_file(tmp_path, wheelhouse):
    (wheelhouse / "manifest.json").write_text("{")
    with pytest.raises(FetchError, match="manifest.json is not valid JSON"):
        make_fetcher(tmp_path).fetch_json(wheelhouse.as_uri(), "manifest.json")


def test_fetch_json_http_error(tmp_path, mocked):
    mocked.add(responses.GET, f"{GH_BASE}/manifest.json", status=503)
    with pytest.raises(FetchError, match="HTTP 503"):
        make_fetcher(tmp_path).fetch_json(GH_BASE, "manifest.json")
    assert len(mocked.calls) == RETRIES + 1


# -- the retry policy -----------------------------------------------------------------------------


def _response_with(headers):
    return HTTPResponse(body=b"", headers=headers, status=403, preload_content=False)


def test_retry_after_is_capped(tmp_path):
    retry = make_fetcher(tmp_path).retry
    assert retry.get_retry_after(_response_with({"Retry-After": "3600"})) == 60.0
    in_an_hour = formatdate(time.time() + 3600, usegmt=True)
    assert retry.get_retry_after(_response_with({"Retry-After": in_an_hour})) <= 60.0
    assert retry.get_retry_after(_response_with({"Retry-After": "5"})) == 5.0
    # A malformed value falls back to the backoff instead of raising mid-request.
    assert retry.get_retry_after(_response_with({"Retry-After": "soon"})) == 0.0


def test_retry_policy_shape(tmp_path):
    retry = make_fetcher(tmp_path).retry
    assert (retry.total, retry.connect, retry.read, retry.status) == (RETRIES,) * 4
    assert 403 not in retry.status_forcelist and set(retry.status_forcelist) == {429, 500, 502, 503, 504}
    assert retry.is_retry("GET", 403, has_retry_after=True)
    assert not retry.is_retry("GET", 403, has_retry_after=False)
    assert not retry.is_retry("POST", 500)
    assert not retry.raise_on_status and retry.respect_retry_after_header
    # urllib3 copies the policy on each attempt; the cap must survive the copy.
    later = retry.increment("GET", "/x", response=_response_with({"Retry-After": "30"}))
    assert isinstance(later, CappedRetry) and later.max_retry_after == 60.0


def test_a_retry_after_beyond_the_cap_ends_the_retries_at_once(tmp_path):
    retry = make_fetcher(tmp_path).retry
    with pytest.raises(MaxRetryError, match="Retry-After 3600 s is longer than the 60 s"):
        retry.increment("GET", "/x", response=_response_with({"Retry-After": "3600"}))


# -- a real HTTP server: urllib3's own retry and Content-Length paths -----------------------------


def _reply(status, body=b"", headers=None, length=None, delay=0.0):
    def step(handler):
        time.sleep(delay)
        handler.send_response(status)
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body) if length is None else length))
        if length is not None:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
        try:
            handler.wfile.write(body)
        except OSError:
            pass

    return step


@pytest.fixture
def server():
    routes, hits = {}, Counter()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            hits[self.path] += 1
            plan = routes[self.path]
            (plan.pop(0) if len(plan) > 1 else plan[0])(self)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield SimpleNamespace(base=f"http://127.0.0.1:{httpd.server_port}/v0.1.0", routes=routes, hits=hits)
    httpd.shutdown()
    httpd.server_close()


def local_session():
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment for 127.0.0.1
    return session


def test_real_server_500_forever_counts_attempts(tmp_path, server):
    server.routes[f"/v0.1.0/{NAME}"] = [_reply(500)]
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path, session=local_session()).fetch_asset(server.base, NAME, SHA, len(BODY))
    assert server.hits[f"/v0.1.0/{NAME}"] == RETRIES + 1
    assert f"HTTP 500 Internal Server Error ({RETRIES + 1} attempts)" in str(info.value)


def test_real_server_403_retry_after_then_200(tmp_path, server):
    server.routes[f"/v0.1.0/{NAME}"] = [_reply(403, headers={"Retry-After": "0"}), _reply(200, BODY)]
    path = make_fetcher(tmp_path, session=local_session()).fetch_asset(server.base, NAME, SHA, len(BODY))
    assert path.read_bytes() == BODY and server.hits[f"/v0.1.0/{NAME}"] == 2


def test_real_server_rate_limit_for_an_hour_fails_fast(tmp_path, server):
    server.routes[f"/v0.1.0/{NAME}"] = [_reply(429, headers={"Retry-After": "3600"})] * 3
    started = time.monotonic()
    with pytest.raises(FetchError, match="429"):
        make_fetcher(tmp_path, session=local_session()).fetch_asset(server.base, NAME, SHA, len(BODY))
    assert server.hits[f"/v0.1.0/{NAME}"] == 1 and time.monotonic() - started < 5


def test_real_server_truncated_body(tmp_path, server):
    server.routes[f"/v0.1.0/{NAME}"] = [_reply(200, BODY[:100], length=len(BODY))]
    with pytest.raises(FetchError, match="connection broken.*IncompleteRead"):
        make_fetcher(tmp_path, session=local_session()).fetch_asset(server.base, NAME, SHA, None)
    assert cache_entries(tmp_path) == []


def test_real_server_read_timeout(tmp_path, server):
    server.routes[f"/v0.1.0/{NAME}"] = [_reply(200, BODY, delay=0.5)]
    fetcher = make_fetcher(tmp_path, session=local_session(), http_timeout=0.1, http_retries=1)
    with pytest.raises(FetchError) as info:
        fetcher.fetch_asset(server.base, NAME, SHA, len(BODY))
    assert "timed out after 0.1 s waiting for data (2 attempts)" in str(info.value)


def test_real_connection_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path, session=local_session()).fetch_asset(f"http://127.0.0.1:{port}/v", NAME, SHA, None)
    message = str(info.value)
    assert "could not connect" in message and f"({RETRIES + 1} attempts)" in message
    assert "<urllib3" not in message and "HTTPConnection(" not in message


# -- redirects: no downgrade to plain http elsewhere, the token stays on github.com ------------------


@pytest.mark.parametrize(
    "start, location, followed",
    [
        (MIRROR_URL, "https://cdn.example/x.whl", True),
        (MIRROR_URL, "http://example.invalid/x.whl", False),  # https -> http elsewhere
        (GH_URL, "http://github.com/x.whl", False),  # https -> http on the same host is a downgrade too
        (MIRROR_URL, "http://192.0.2.1/x.whl", False),
        (MIRROR_URL, "http://127.0.0.1:8000/x.whl", True),  # a local mirror, tests
        (MIRROR_URL, "http://127.8.9.10/x.whl", True),
        (MIRROR_URL, "http://localhost/x.whl", True),
        (MIRROR_URL, "http://[::1]:8000/x.whl", True),
        (MIRROR_URL, "http://localhost.evil.example/x.whl", False),
        (MIRROR_URL, "http://127.0.0.1.nip.io/x.whl", False),
        ("http://mirror.corp/v1/x.whl", "http://mirror.corp/blobs/x.whl", True),  # the user chose plain http there
        ("http://mirror.corp/v1/x.whl", "http://mirror.corp:8080/blobs/x.whl", False),
        ("http://mirror.corp/v1/x.whl", "http://other.corp/x.whl", False),
        (MIRROR_URL, "ftp://mirror.example/x.whl", False),
        (MIRROR_URL, "file:///etc/passwd", False),
    ],
)
def test_check_redirect(start, location, followed):
    if followed:
        check_redirect(start, location)
    else:
        with pytest.raises(FetchError, match="refusing the redirect"):
            check_redirect(start, location)


def test_redirect_to_plain_http_elsewhere_is_refused_before_any_request_there(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, status=302, headers={"Location": "http://example.invalid/x.whl"})
    mocked.add(responses.GET, "http://example.invalid/x.whl", body=BODY)
    with pytest.raises(FetchError) as info:
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert str(info.value) == (
        f"refusing the redirect of {MIRROR_URL} to http://example.invalid/x.whl: http scheme on "
        "example.invalid, not https; only https, or plain http to this machine (127.0.0.1, ::1, "
        "localhost), is followed")
    assert [c.request.url for c in mocked.calls] == [MIRROR_URL]
    assert cache_entries(tmp_path) == []


def test_a_relative_redirect_keeps_the_scheme_and_is_followed(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, status=302, headers={"Location": "/blobs/x.whl"})
    mocked.add(responses.GET, "https://mirror.example/blobs/x.whl", body=BODY)
    assert make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY)).read_bytes() == BODY


def test_the_manifest_redirect_is_checked_too(tmp_path, mocked):
    mocked.add(responses.GET, f"{GH_BASE}/manifest.json", status=301, headers={"Location": "http://evil.example/m.json"})
    with pytest.raises(FetchError, match="refusing the redirect"):
        make_fetcher(tmp_path).fetch_json(GH_BASE, "manifest.json")
    assert len(mocked.calls) == 1


@pytest.mark.parametrize("elsewhere", ["https://github.com.evil.example/x", "https://mirror.example/x",
                                       "https://api.github.com.evil.example/x"])
def test_token_is_not_sent_after_a_redirect_off_github(tmp_path, mocked, elsewhere):
    mocked.add(responses.GET, GH_URL, status=302, headers={"Location": elsewhere})
    mocked.add(responses.GET, elsewhere, body=BODY)
    make_fetcher(tmp_path, github_token=TOKEN).fetch_asset(GH_BASE, NAME, SHA, len(BODY))
    assert mocked.calls[0].request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert "Authorization" not in mocked.calls[1].request.headers


# -- never past the manifest's size + 1 -----------------------------------------------------------


class CountingRaw:
    """A response body that counts what was read from it (read1, as urllib3 >= 2 offers)."""

    def __init__(self, data: bytes, step: int = 4096, clock=None, seconds_per_read: float = 0.0):
        self.data, self.step, self.read_bytes = data, step, 0
        self.clock, self.seconds_per_read = clock, seconds_per_read

    def read1(self, amt, decode_content=True):
        if self.clock is not None:
            self.clock.now += self.seconds_per_read
        chunk = self.data[self.read_bytes:self.read_bytes + min(amt, self.step)]
        self.read_bytes += len(chunk)
        return chunk


def transfer(total, limit=None, logs=None, deadline=1e9, min_rate=0.0, window=20.0):
    return Transfer(
        NAME, total, limit=limit, too_long=lambda: VerificationError("too long"), deadline=deadline,
        deadline_s=300, min_rate=min_rate, window=window, read_timeout=30.0,
        log=(logs.append if logs is not None else lambda line: None))


def test_a_body_is_read_to_size_plus_one_and_no_further():
    raw = CountingRaw(BODY + b"x" * 3_000_000)
    with pytest.raises(VerificationError):
        for _ in transfer(len(BODY), limit=len(BODY) + 1).chunks(raw):
            pass
    assert raw.read_bytes == len(BODY) + 1


def test_a_body_of_the_right_size_passes_the_limit():
    raw = CountingRaw(BODY)
    assert b"".join(transfer(len(BODY), limit=len(BODY) + 1).chunks(raw)) == BODY


def test_a_longer_body_is_a_verification_error_and_not_cached(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY + b"x" * 100_000, auto_calculate_content_length=False)
    with pytest.raises(VerificationError, match=f"the server sent more; stopped reading at {len(BODY) + 1} bytes"):
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert len(mocked.calls) == 1 and cache_entries(tmp_path) == []


def test_an_announced_longer_body_is_refused_on_its_header(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY + b"x" * 10, auto_calculate_content_length=True)
    with pytest.raises(VerificationError, match=f"says {len(BODY)} bytes, the server announces {len(BODY) + 10} bytes"):
        make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert cache_entries(tmp_path) == []


def test_an_oversized_manifest_is_not_read_to_its_end(tmp_path, mocked, monkeypatch):
    monkeypatch.setattr(fetch, "MAX_JSON_BYTES", 1000)
    mocked.add(responses.GET, f"{GH_BASE}/manifest.json", body=b"{" + b" " * 5000 + b"}")
    with pytest.raises(FetchError, match="is larger than 1 KB, so not a release manifest"):
        make_fetcher(tmp_path).fetch_json(GH_BASE, "manifest.json")


# -- deadline, minimum rate, progress (a fake clock: every read takes `seconds_per_read`) -----------


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(fetch.time, "monotonic", fake)
    return fake


def test_a_trickle_below_the_minimum_rate_stops_once_the_window_has_passed(clock):
    raw = CountingRaw(b"x" * 1_400_000, step=1000, clock=clock, seconds_per_read=1.0)  # 1 KB/s
    t = transfer(1_400_000, min_rate=32_000, window=20.0)
    with pytest.raises(TransferStopped) as info:
        for _ in t.chunks(raw):
            pass
    assert clock.now - t.started == 20.0  # not 23 minutes
    assert info.value.reason == ("too slow: 1.0 KB/s over the last 20 s, below the minimum 32 KB/s "
                                 "(CUDELTA_HTTP_MIN_RATE); got 20 KB of 1.4 MB (1%)")


def test_the_rate_is_judged_on_the_last_window_not_since_the_start(clock):
    # 50 KB/s for 30 s, then 1 KB/s: the average stays above 32 KB/s for 15 s more; the window
    # sees the stall within 4 s.
    t = transfer(None, min_rate=32_000, window=10.0)
    fast = CountingRaw(b"x" * 1_500_000, step=50_000, clock=clock, seconds_per_read=1.0)
    slow = CountingRaw(b"x" * 1_000_000, step=1000, clock=clock, seconds_per_read=1.0)

    class Both:
        def read1(self, amt, decode_content=True):
            return fast.read1(amt) or slow.read1(amt)

    with pytest.raises(TransferStopped, match="too slow"):
        for _ in t.chunks(Both()):
            pass
    assert 30.0 < clock.now - t.started <= 35.0


def test_a_slow_but_sufficient_download_completes(clock):
    raw = CountingRaw(b"x" * 400_000, step=40_000, clock=clock, seconds_per_read=1.0)  # 40 KB/s
    assert len(b"".join(transfer(400_000, min_rate=32_000, window=5.0).chunks(raw))) == 400_000


def test_the_deadline_stops_a_body_above_the_minimum_rate(clock):
    raw = CountingRaw(b"x" * 10_000_000, step=40_000, clock=clock, seconds_per_read=1.0)
    t = transfer(10_000_000, deadline=clock.now + 60, min_rate=32_000)
    with pytest.raises(TransferStopped) as info:
        for _ in t.chunks(raw):
            pass
    assert clock.now - t.started == 60.0
    assert info.value.reason == "not done after the 300 s limit (CUDELTA_HTTP_DEADLINE); got 2.4 MB of 10.0 MB (24%)"


def test_progress_is_a_few_lines_not_a_flood(clock):
    raw = CountingRaw(b"x" * 1_400_000, step=1000, clock=clock, seconds_per_read=0.0625)  # 16 KB/s, 87.5 s
    logs = []
    assert len(b"".join(transfer(1_400_000, logs=logs).chunks(raw))) == 1_400_000
    # The first after 3 s, then one every 10 s: 9 lines for 87.5 s, from 1400 reads.
    assert len(logs) == 9, logs
    assert logs[0] == f"downloading {NAME}: 48 KB of 1.4 MB (3%) at 16 KB/s, 3 s"
    assert logs[-1] == f"downloading {NAME}: 1.3 MB of 1.4 MB (94%) at 16 KB/s, 83 s"


def test_a_quick_download_prints_no_progress(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    logs = []
    make_fetcher(tmp_path, logs).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert not any(line.startswith(f"downloading {NAME}: ") for line in logs)


def test_retries_never_start_after_the_deadline(tmp_path, mocked):
    # A Retry-After of 5 s (under the 60 s cap) would be slept, twice; the 1 s deadline forbids it.
    mocked.add(responses.GET, MIRROR_URL, status=503, headers={"Retry-After": "5"})
    started = time.monotonic()
    with pytest.raises(FetchError, match="HTTP 503"):
        make_fetcher(tmp_path, http_deadline=1.0).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    assert time.monotonic() - started < 1.0 and len(mocked.calls) == 1


def test_the_retry_policy_of_a_fetch_carries_its_deadline(tmp_path):
    retry = make_fetcher(tmp_path).retry.new(deadline=123.0)
    assert isinstance(retry, CappedRetry) and retry.deadline == 123.0
    assert retry.new(total=1).deadline == 123.0  # urllib3's copies keep it


# -- the cache lock: announced, bounded, then a private download ----------------------------------


def hold_lock(tmp_path, owner="pid 4242 on buildhost since 10:00:00\nverifying its cached copy of x.whl"):
    folder = tmp_path / "cache" / SHA
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_OWNER_NAME).write_text(owner + "\n")
    lock = fetch.filelock.FileLock(str(folder / LOCK_NAME))
    lock.acquire(timeout=0)
    return lock


def test_a_held_lock_is_announced_bounded_and_bypassed(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    lock = hold_lock(tmp_path)
    logs = []
    try:
        path = fetch.Fetcher(Settings(cache_dir=tmp_path / "cache", http_retries=0), backoff_factor=0,
                             log=logs.append, lock_wait=0.2).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    finally:
        lock.release()
    folder = tmp_path / "cache" / SHA
    assert logs[0] == (f"waiting up to 0.2 s for the download cache lock {folder / '.lock'}, held by pid 4242 "
                       "on buildhost since 10:00:00, which is verifying its cached copy of x.whl")
    assert logs[1] == (f"{folder / '.lock'} is still held after 0.2 s (by pid 4242 on buildhost since 10:00:00, "
                       f"which is verifying its cached copy of x.whl); downloading {NAME} into a private "
                       "temporary folder instead (the cache is left to the other install)")
    assert path.read_bytes() == BODY and path.name == NAME and folder not in path.parents
    assert cache_entries(tmp_path) == [LOCK_OWNER_NAME]  # the holder's; nothing of ours


def test_a_private_download_that_fails_leaves_nothing(tmp_path, mocked, monkeypatch):
    mocked.add(responses.GET, MIRROR_URL, body=BODY + b"tampered")
    made = []
    real_mkdtemp = fetch.tempfile.mkdtemp
    monkeypatch.setattr(fetch.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(dir=tmp_path, **kw)) or made[-1])
    lock = hold_lock(tmp_path)
    try:
        with pytest.raises(VerificationError):
            make_fetcher(tmp_path, lock_wait=0.05).fetch_asset(MIRROR_BASE, NAME, SHA, None)
    finally:
        lock.release()
    assert len(made) == 1 and not os.path.exists(made[0])


def test_an_unknown_holder_is_said_so(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    lock = hold_lock(tmp_path, owner="")
    logs = []
    try:
        make_fetcher(tmp_path, logs, lock_wait=0.05).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    finally:
        lock.release()
    assert logs[0].endswith("held by a process that did not say (it does not say what it is doing)")


def test_a_holder_of_an_older_version_is_named_without_a_phase(tmp_path, mocked):
    mocked.add(responses.GET, MIRROR_URL, body=BODY)
    lock = hold_lock(tmp_path, owner="pid 7 on oldhost since 09:00:00")  # one line: no phase written
    logs = []
    try:
        make_fetcher(tmp_path, logs, lock_wait=0.05).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    finally:
        lock.release()
    assert logs[0].endswith("held by pid 7 on oldhost since 09:00:00 (it does not say what it is doing)")


def test_the_lock_owner_is_recorded_while_held_and_removed_after(tmp_path, mocked):
    seen = []

    def body(request):
        seen.append((tmp_path / "cache" / SHA / LOCK_OWNER_NAME).read_text())
        return (200, {}, BODY)

    mocked.add_callback(responses.GET, MIRROR_URL, callback=body)
    make_fetcher(tmp_path).fetch_asset(MIRROR_BASE, NAME, SHA, len(BODY))
    who, doing = seen[0].splitlines()
    assert who.startswith(f"pid {os.getpid()} on {socket.gethostname()} since ")
    assert doing == f"downloading {NAME}"  # the request is being made: no byte has come yet
    assert cache_entries(tmp_path) == [NAME]


def test_the_settings_docs_state_the_window_the_fetcher_uses():
    import dataclasses

    docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(Settings)}
    assert f"over any {RATE_WINDOW_S:g} s once a body has flowed for {RATE_WINDOW_S:g} s" in docs["http_min_rate"]
