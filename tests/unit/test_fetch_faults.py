"""The installer's Fetcher against a real HTTP server (tests/e2e/release_server.py) that misbehaves:
trickles, stalls, sends more than the file, redirects to plain http elsewhere; and two processes
contending for the download cache's lock. Bounds are seconds here (minutes in an install), so
each case shows in wall time that nothing waits without end: each test takes under ~4 s.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

import pytest
import requests

from installer.core.errors import FetchError, VerificationError
from installer.core.settings import Settings
from installer.fetch.cache import LOCK_NAME, LOCK_OWNER_NAME, PARTIAL_PREFIX
from installer.fetch.fetch import Fetcher

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_make_release beside this file
from test_make_release import load_module  # noqa: E402

ReleaseServer = load_module("release_server", ROOT / "tests" / "e2e" / "release_server.py").ReleaseServer

TAG = "v0.1.0"
NAME = "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
# Random bytes: what a wheel looks like on the wire (compressed), large enough to trickle.
DATA = hashlib.sha256(b"seed").digest() * (300_000 // 32)
SHA = hashlib.sha256(DATA).hexdigest()
SIZE = len(DATA)

# The child process of the lock tests: one install, fetching through the same cache.
CHILD = """
import sys
from pathlib import Path
import requests
from installer.core.settings import Settings
from installer.fetch.fetch import Fetcher
base, cache, name, sha, size = sys.argv[1:6]
session = requests.Session()
session.trust_env = False
settings = Settings(cache_dir=Path(cache), http_retries=0, http_min_rate=0, http_deadline=20)
fetcher = Fetcher(settings, session=session, backoff_factor=0, log=lambda line: print(line, flush=True))
print("path:", fetcher.fetch_asset(base, name, sha, int(size)), flush=True)
"""


# Lower bounds pin that nothing ends early; upper bounds only have to tell seconds from the
# minutes the faults used to take, so they leave room for a loaded 2-core machine.
SLACK_S = 2.5


@pytest.fixture
def server(tmp_path):
    release = tmp_path / "release"
    release.mkdir()
    (release / NAME).write_bytes(DATA)
    with ReleaseServer(tmp_path / "srv-root") as srv:
        srv.add_release(TAG, release)
        yield srv


def make_fetcher(tmp_path: Path, logs: List[str], *, lock_wait: float = 5.0, rate_window: float = 1.0,
                 **settings) -> Fetcher:
    settings.setdefault("http_retries", 1)
    settings.setdefault("http_deadline", 10.0)
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment for 127.0.0.1
    return Fetcher(Settings(cache_dir=tmp_path / "cache", **settings), session=session, backoff_factor=0,
                   log=logs.append, lock_wait=lock_wait, rate_window=rate_window,
                   progress_after=0.5, progress_every=0.5)


def cache_files(tmp_path: Path) -> List[str]:
    folder = tmp_path / "cache" / SHA
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME) if folder.exists() else []


def fails(exc_type, call: Callable[[], object]):
    """(the exception, seconds until it came)."""
    started = time.monotonic()
    with pytest.raises(exc_type) as info:
        call()
    return info.value, time.monotonic() - started


# -- slow servers -----------------------------------------------------------------------------------


def test_trickle_ends_at_the_deadline_with_progress_on_the_way(tmp_path, server):
    # 1 KB/s: the held-out fault that kept an install busy for 23 min on a 1.4 MB asset.
    server.trickle(NAME, 1000)
    logs: List[str] = []
    fetcher = make_fetcher(tmp_path, logs, http_deadline=2.0, http_min_rate=0)
    error, took = fails(FetchError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert "not done after the 2 s limit (CUDELTA_HTTP_DEADLINE)" in str(error)
    # What came, and a body stopped by the bounds is not retried.
    assert re.search(r"; got \d KB of 300 KB \(0%\) \(1 attempt\)$", str(error)), str(error)
    assert 2.0 <= took < 2.0 + SLACK_S
    progress = [line for line in logs if line.startswith(f"downloading {NAME}: ")]
    assert 2 <= len(progress) <= 4, logs  # a few lines, not a flood
    assert all(" KB of 300 KB (" in line and " KB/s, " in line for line in progress), progress
    assert cache_files(tmp_path) == []


def test_trickle_below_the_minimum_rate_ends_after_the_window(tmp_path, server):
    server.trickle(NAME, 1000)
    logs: List[str] = []
    fetcher = make_fetcher(tmp_path, logs, http_deadline=10.0, http_min_rate=32)
    error, took = fails(FetchError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert re.search(r"too slow: (\d\.\d KB/s over the last 1 s|nothing for 1 s), below the minimum 32 KB/s "
                     r"\(CUDELTA_HTTP_MIN_RATE\)", str(error)), str(error)
    assert 1.0 <= took < 1.0 + SLACK_S
    assert cache_files(tmp_path) == []


def test_a_silent_server_ends_at_the_deadline_not_after_the_read_timeout(tmp_path, server):
    server.trickle(NAME, 0)  # headers, then nothing
    logs: List[str] = []
    fetcher = make_fetcher(tmp_path, logs, http_deadline=1.5, http_timeout=30.0, http_min_rate=0)
    error, took = fails(FetchError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert "not done after the 1.5 s limit (CUDELTA_HTTP_DEADLINE); got 0 KB of 300 KB (0%) (1 attempt)" in str(error)
    assert 1.5 <= took < 1.5 + SLACK_S
    assert cache_files(tmp_path) == []


def test_a_silent_server_is_too_slow_after_the_window_and_not_retried(tmp_path, server):
    server.trickle(NAME, 0)
    fetcher = make_fetcher(tmp_path, [], http_deadline=10.0, http_timeout=30.0, http_min_rate=32, http_retries=3)
    error, took = fails(FetchError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert ("too slow: nothing for 1 s, below the minimum 32 KB/s (CUDELTA_HTTP_MIN_RATE); got 0 KB of 300 KB "
            "(0%) (1 attempt)") in str(error)
    assert 1.0 <= took < 1.0 + SLACK_S
    assert server.paths().count(f"/storage/{TAG}/{NAME}") == 1


def test_slow_but_above_the_minimum_completes_and_shows_progress(tmp_path, server):
    server.trickle(NAME, 200_000)  # 300 KB in 1.5 s
    logs: List[str] = []
    fetcher = make_fetcher(tmp_path, logs, http_min_rate=32)
    path = fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    assert path.read_bytes() == DATA and cache_files(tmp_path) == [NAME]
    progress = [line for line in logs if line.startswith(f"downloading {NAME}: ")]
    assert 1 <= len(progress) <= 3, logs
    assert any(line.startswith(f"downloaded {NAME} in ") for line in logs)


def test_the_manifest_is_bounded_too(tmp_path, server):
    (server._release_dir(TAG) / "manifest.json").write_text('{"assets": []}' + " " * 5000)
    server.trickle("manifest.json", 1000)
    fetcher = make_fetcher(tmp_path, [], http_deadline=1.0, http_min_rate=0)
    error, took = fails(FetchError, lambda: fetcher.fetch_json(server.base_url(TAG), "manifest.json"))
    assert "not done after the 1 s limit" in str(error) and took < 2.0


# -- longer than the manifest says ------------------------------------------------------------------


def test_an_announced_longer_body_is_refused_before_reading_it(tmp_path, server):
    server.overlong(NAME, 1_000_000, announce=True)  # 1.3 MB for a 0.3 MB asset
    fetcher = make_fetcher(tmp_path, [])
    error, took = fails(VerificationError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert f"the release manifest says {SIZE} bytes, the server announces {SIZE + 1_000_000} bytes" in str(error)
    assert took < 1.0 and cache_files(tmp_path) == []


def test_a_longer_body_without_length_is_not_read_past_size_plus_one(tmp_path, server):
    extra = 48_000_000
    server.overlong(NAME, extra)  # close-delimited: only the byte count can stop it
    fetcher = make_fetcher(tmp_path, [])
    error, took = fails(VerificationError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert f"stopped reading at {SIZE + 1} bytes" in str(error)
    assert cache_files(tmp_path) == []
    # The server stops when the client hangs up: what went out is the file plus socket buffers,
    # not the 48 MB behind it.
    deadline = time.monotonic() + 3
    while not server.errors and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.errors, "the server was never cut off"
    assert server.bytes_sent(NAME) < SIZE + extra // 2


# -- redirects ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("location", [
    "http://example.invalid/asset.whl",
    # A non-routable address: connecting would hang until the 10 s connect timeout.
    "http://192.0.2.1:9/asset.whl",
    "ftp://192.0.2.1/asset.whl",
])
def test_a_redirect_to_plain_http_elsewhere_is_refused_before_connecting(tmp_path, server, location):
    server.redirect(NAME, location)
    fetcher = make_fetcher(tmp_path, [])
    error, took = fails(FetchError, lambda: fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE))
    assert f"refusing the redirect of {server.base_url(TAG)}/" in str(error)
    assert "only https, or plain http to this machine" in str(error)
    assert took < 1.0
    assert len(server.requests) == 1  # no retry of a refusal
    assert cache_files(tmp_path) == []


def test_a_redirect_to_plain_http_on_this_machine_is_followed(tmp_path, server):
    # The server listens on 127.0.0.1 only; other loopback spellings are checked in test_fetch.py.
    server.redirect(NAME, f"http://localhost:{server.port}/storage/{TAG}/{NAME}?sig=1")
    path = make_fetcher(tmp_path, []).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    assert path.read_bytes() == DATA
    assert server.paths()[-1] == f"/storage/{TAG}/{NAME}"


# -- two installs, one cache -------------------------------------------------------------------------


def start_child(tmp_path: Path, server) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, server.base_url(TAG), str(tmp_path / "cache"), NAME, SHA, str(SIZE)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_lock_owner(tmp_path: Path, child: subprocess.Popen) -> str:
    """Who holds the lock, once the holder says bytes are coming in."""
    owner = tmp_path / "cache" / SHA / LOCK_OWNER_NAME
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and child.poll() is None:
        lines = owner.read_text().splitlines() if owner.exists() else []
        if len(lines) == 2 and lines[1].startswith(f"downloading {NAME} ("):
            return lines[0]
        time.sleep(0.02)
    raise AssertionError(f"the child never said it was downloading: {child.communicate(timeout=5)[0]}")


def test_a_lock_held_too_long_is_announced_then_bypassed_with_a_private_download(tmp_path, server):
    server.trickle(NAME, 150_000, times=1)  # the child's download: 2 s, holding the lock
    child = start_child(tmp_path, server)
    try:
        owner = wait_for_lock_owner(tmp_path, child)
        assert owner.startswith(f"pid {child.pid} on {socket.gethostname()} since ")
        logs: List[str] = []
        fetcher = make_fetcher(tmp_path, logs, lock_wait=0.5)
        started = time.monotonic()
        path = fetcher.fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
        took = time.monotonic() - started
        lock = tmp_path / "cache" / SHA / LOCK_NAME
        # The holder's own words, how far it had got when each line was written.
        assert re.fullmatch(rf"waiting up to 0\.5 s for the download cache lock {re.escape(str(lock))}, held by "
                            rf"{re.escape(owner)}, which is downloading {re.escape(NAME)} \((\d+) KB of 300 KB\)",
                            logs[0]), logs[0]
        assert re.fullmatch(rf"{re.escape(str(lock))} is still held after 0\.5 s \(by {re.escape(owner)}, which is "
                            rf"downloading {re.escape(NAME)} \(\d+ KB of 300 KB\)\); downloading {re.escape(NAME)} "
                            r"into a private temporary folder instead \(the cache is left to the other install\)",
                            logs[1]), logs[1]
        got = [int(re.search(r"\((\d+) KB of", line).group(1)) for line in logs[:2]]
        assert 0 < got[0] < got[1] < 300, got  # updated as it goes
        assert path.read_bytes() == DATA and took < 2.0
        assert tmp_path / "cache" not in path.parents  # nothing of ours where the cache could use it
        assert child.poll() is None, "the child finished before the private download; nothing was contended"
        assert NAME not in cache_files(tmp_path)
    finally:
        out, _ = child.communicate(timeout=10)
    assert child.returncode == 0, out
    assert cache_files(tmp_path) == [NAME]  # the child's, verified, renamed into place
    assert not list((tmp_path / "cache").rglob(PARTIAL_PREFIX + "*"))


def test_a_lock_released_in_time_is_waited_for_and_the_cached_file_used(tmp_path, server):
    server.trickle(NAME, 300_000, times=1)  # the child's download: 1 s
    child = start_child(tmp_path, server)
    try:
        wait_for_lock_owner(tmp_path, child)
        logs: List[str] = []
        path = make_fetcher(tmp_path, logs, lock_wait=8.0).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    finally:
        out, _ = child.communicate(timeout=10)
    assert child.returncode == 0, out
    assert logs[0].startswith("waiting up to 8 s for the download cache lock ")
    assert logs[1].startswith("got the download cache lock after ")
    assert any(line.startswith(f"using cached {NAME}") for line in logs)
    assert path == tmp_path / "cache" / SHA / NAME and path.read_bytes() == DATA
    assert server.bytes_sent(NAME) == SIZE  # downloaded once, by the child
