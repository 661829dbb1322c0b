"""A download cache that cannot hold the wheel never costs the verified download: the wheel is
installed from a private temporary folder, and one line says why the cache could not hold it and
which variable fixes that. Real disks only: a regular file where the cache's folder would be, a
folder where the wheel would be, and tmpfs mounts that are full or read-only (we run as root here
and in CI; where mounting is refused, those cases skip and say so). The fetches go to the real
release server of the e2e tests on 127.0.0.1.

Also here: what a process waiting on the cache's lock is told about the holder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

import pytest
import requests

from installer.core.errors import FetchError
from installer.core.settings import Settings
from installer.fetch import fetch
from installer.fetch.cache import LOCK_NAME, LOCK_OWNER_NAME, PARTIAL_PREFIX
from installer.fetch.fetch import Fetcher

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_fetch_faults beside this file

# The release server, the asset and its fixture are test_fetch_faults' (one source for both files).
from test_fetch_faults import DATA, NAME, SHA, SIZE, TAG, server  # noqa: E402,F401  (server: a fixture)


def make_fetcher(cache_dir: Path, logs, **kw) -> Fetcher:
    """`logs`: a list the lines go to, or a function that takes them."""
    session = requests.Session()
    session.trust_env = False  # no proxy from the environment for 127.0.0.1
    settings = Settings(cache_dir=cache_dir, http_retries=0, http_deadline=20.0, http_min_rate=0)
    log = logs.append if isinstance(logs, list) else logs
    return Fetcher(settings, session=session, backoff_factor=0, log=log, **kw)


def delivered(path: Path, cache_dir: Path) -> bool:
    """The verified wheel, outside the cache."""
    return (path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SHA
            and cache_dir not in path.parents and path.name == NAME)


def partials(cache_dir: Path) -> List[Path]:
    return [p for p in cache_dir.rglob("*") if p.name.startswith(PARTIAL_PREFIX) or p.name == NAME and p.is_file()] \
        if cache_dir.is_dir() else []


def fallback_lines(logs: List[str]) -> List[str]:
    return [line for line in logs if line.startswith(f"not caching {NAME}: ")]


@contextmanager
def tmpfs(where: Path, size: str, *, read_only: bool = False, fill=None) -> Iterator[Path]:
    """A real tmpfs of `size` at `where`; `fill(path)` runs before it is made read-only."""
    where.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "cudelta-test", str(where)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); a full or read-only disk needs one")
    try:
        if fill is not None:
            fill(where)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# -- the cache cannot be created ---------------------------------------------------------------------


def test_a_cache_under_a_regular_file_costs_one_line_not_the_download(tmp_path, server):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    cache_dir = blocker / "cudelta"
    logs: List[str] = []
    path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    assert delivered(path, cache_dir)
    assert fallback_lines(logs) == [
        f"not caching {NAME}: {blocker} is a file, not a folder, so the download cache {cache_dir} cannot be "
        "created (ENOTDIR); set CUDELTA_CACHE_DIR to a folder; downloading it into a private temporary folder "
        "instead"]
    assert blocker.read_text() == "a file, not a folder"
    assert server.bytes_sent(NAME) == SIZE  # one download


def test_a_cache_that_is_itself_a_regular_file_is_said_so(tmp_path, server):
    cache_dir = tmp_path / "cache"
    cache_dir.write_text("")
    logs: List[str] = []
    path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    assert delivered(path, cache_dir)
    [line] = fallback_lines(logs)
    assert f": {cache_dir} is a file, not a folder, so the download cache {cache_dir} cannot be created" in line
    assert "set CUDELTA_CACHE_DIR to a folder" in line


# -- a folder where the wheel would be ---------------------------------------------------------------


def test_a_folder_in_the_way_of_the_wheel_is_named_before_downloading(tmp_path, server):
    cache_dir = tmp_path / "cache"
    in_the_way = cache_dir / SHA / NAME
    (in_the_way / "something").mkdir(parents=True)
    logs: List[str] = []
    path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    assert delivered(path, cache_dir)
    assert fallback_lines(logs) == [
        f"not caching {NAME}: a folder is in the way of the cache's file {in_the_way} (EISDIR); remove that "
        "folder or set CUDELTA_CACHE_DIR to another folder; downloading it into a private temporary folder instead"]
    assert "free space" not in fallback_lines(logs)[0]
    assert (in_the_way / "something").is_dir()  # the user's folder is left alone
    assert partials(cache_dir) == [] and not (cache_dir / SHA / LOCK_OWNER_NAME).exists()
    assert server.bytes_sent(NAME) == SIZE


def test_a_folder_that_appears_during_the_download_keeps_the_verified_download(tmp_path, server):
    # Not through the lock (another tool, a user): the rename into place fails after the check.
    # The verified file is moved out of the cache and installed; it is not downloaded twice.
    server.trickle(NAME, 300_000)  # 1 s
    cache_dir = tmp_path / "cache"
    folder = cache_dir / SHA

    def put_a_folder_in_the_way() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if folder.is_dir() and any(p.name.startswith(PARTIAL_PREFIX) and "owner" not in p.name
                                       for p in folder.iterdir()):
                (folder / NAME).mkdir()
                return
            time.sleep(0.01)

    racer = threading.Thread(target=put_a_folder_in_the_way)
    racer.start()
    logs: List[str] = []
    try:
        path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    finally:
        racer.join()
    assert (folder / NAME).is_dir(), "the folder never got in the way"
    assert delivered(path, cache_dir)
    assert fallback_lines(logs) == [
        f"not caching {NAME}: a folder is in the way of the cache's file {folder / NAME} (EISDIR); remove that "
        "folder or set CUDELTA_CACHE_DIR to another folder; installing the verified download from a private "
        "temporary folder instead"]
    assert server.bytes_sent(NAME) == SIZE
    assert partials(cache_dir) == []


# -- full and read-only disks (real tmpfs mounts) ------------------------------------------------------


def test_a_full_cache_disk_is_said_before_downloading(tmp_path, server):
    with tmpfs(tmp_path / "small", "64k") as small:
        cache_dir = small / "cudelta"
        logs: List[str] = []
        path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
        [line] = fallback_lines(logs)
        assert line.startswith(f"not caching {NAME}: no space left on the disk of the download cache {cache_dir} (")
        assert line.endswith(" KB free, 300 KB needed) (ENOSPC); free some space there or set CUDELTA_CACHE_DIR "
                             "to a folder on another disk; downloading it into a private temporary folder instead")
        assert partials(cache_dir) == []
    assert delivered(path, cache_dir)
    assert server.bytes_sent(NAME) == SIZE


def test_a_disk_that_fills_during_the_download_downloads_again_privately(tmp_path, server):
    # No size in the manifest: nothing to judge the room by, so the disk fills mid-write.
    with tmpfs(tmp_path / "small", "64k") as small:
        cache_dir = small / "cudelta"
        logs: List[str] = []
        path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, None)
        assert fallback_lines(logs) == [
            f"not caching {NAME}: no space left on the disk of the download cache {cache_dir} (ENOSPC); free some "
            "space there or set CUDELTA_CACHE_DIR to a folder on another disk; downloading it again into a "
            "private temporary folder instead"]
        assert partials(cache_dir) == []
        assert [p.name for p in (cache_dir / SHA).iterdir()] == [LOCK_NAME]
    assert delivered(path, cache_dir)


def test_a_read_only_cache_is_said_so(tmp_path, server):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        cache_dir = ro / "cudelta"
        logs: List[str] = []
        path = make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
        assert fallback_lines(logs) == [
            f"not caching {NAME}: the download cache {cache_dir} is on a read-only filesystem (EROFS); set "
            "CUDELTA_CACHE_DIR to a writable folder; downloading it into a private temporary folder instead"]
        assert list(ro.iterdir()) == []
    assert delivered(path, cache_dir)


def test_a_read_only_cache_holding_the_verified_wheel_is_used_as_it_is(tmp_path, server):
    def seed(root: Path) -> None:
        (root / "cudelta" / SHA).mkdir(parents=True)
        (root / "cudelta" / SHA / NAME).write_bytes(DATA)

    with tmpfs(tmp_path / "ro", "1m", read_only=True, fill=seed) as ro:
        logs: List[str] = []
        path = make_fetcher(ro / "cudelta", logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
        assert path == ro / "cudelta" / SHA / NAME
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA
        [line] = [line for line in logs if line.startswith(f"using cached {NAME}")]
        assert line.endswith("without the cache's lock: the download cache "
                             f"{ro / 'cudelta'} is on a read-only filesystem (EROFS); set CUDELTA_CACHE_DIR to a "
                             "writable folder")
    assert server.bytes_sent(NAME) == 0


def test_a_read_only_cache_with_a_corrupt_wheel_is_not_trusted(tmp_path, server):
    def seed(root: Path) -> None:
        (root / "cudelta" / SHA).mkdir(parents=True)
        (root / "cudelta" / SHA / NAME).write_bytes(DATA[:-1] + b"!")

    with tmpfs(tmp_path / "ro", "1m", read_only=True, fill=seed) as ro:
        logs: List[str] = []
        path = make_fetcher(ro / "cudelta", logs).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
        assert delivered(path, ro / "cudelta")
        assert len(fallback_lines(logs)) == 1 and "(EROFS)" in fallback_lines(logs)[0]
    assert server.bytes_sent(NAME) == SIZE


def test_when_the_private_folder_is_full_too_the_error_says_both(tmp_path, server, monkeypatch):
    with tmpfs(tmp_path / "small", "64k") as small, tmpfs(tmp_path / "tmp", "64k") as tmp:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # what TMPDIR sets
        cache_dir = small / "cudelta"
        logs: List[str] = []
        with pytest.raises(FetchError) as info:
            make_fetcher(cache_dir, logs).fetch_asset(server.base_url(TAG), NAME, SHA, None)
        assert str(info.value) == (
            f"could not save {NAME} to a private temporary folder under {tmp}: No space left on device "
            "(ENOSPC); set TMPDIR to a folder with free space; the download cache could not hold it either: "
            f"no space left on the disk of the download cache {cache_dir} (ENOSPC); free some space there or "
            "set CUDELTA_CACHE_DIR to a folder on another disk")
        assert list(tmp.iterdir()) == []  # the private folder is gone
        assert partials(cache_dir) == []


# One install as another user, for a cache it may not write (EACCES). Root writes anywhere, so as
# root the child drops to nobody; its private folder is gone when it exits, so it hashes its own.
CHILD = """
import hashlib, sys
from pathlib import Path
import requests
from installer.core.settings import Settings
from installer.fetch.fetch import Fetcher
base, cache, name, sha, size = sys.argv[1:6]
session = requests.Session()
session.trust_env = False
fetcher = Fetcher(Settings(cache_dir=Path(cache), http_retries=0, http_min_rate=0), session=session,
                  backoff_factor=0, log=lambda line: print("log:", line, flush=True))
path = fetcher.fetch_asset(base, name, sha, int(size))
print("delivered:", hashlib.sha256(path.read_bytes()).hexdigest(), Path(cache) in path.parents, flush=True)
"""


def test_a_cache_this_user_may_not_write_is_said_so(server):
    # Outside tmp_path: pytest's folders are private to their user, and the child is another user.
    shared = Path(tempfile.mkdtemp(prefix="cudelta-eacces-"))
    try:
        shared.chmod(0o755)
        cache_dir = shared / "cache"
        cache_dir.mkdir(mode=0o755)
        as_another_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        if os.geteuid() != 0:
            cache_dir.chmod(0o555)
        proc = subprocess.run(
            [*as_another_user, sys.executable, "-c", CHILD, server.base_url(TAG), str(cache_dir), NAME, SHA, str(SIZE)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1", "TMPDIR": "/tmp"},
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"delivered: {SHA} False" in proc.stdout.splitlines()
        assert (f"log: not caching {NAME}: no permission to write {cache_dir / SHA} in the download cache "
                f"{cache_dir} (EACCES); set CUDELTA_CACHE_DIR to a folder you can write to; downloading it into a "
                "private temporary folder instead") in proc.stdout.splitlines(), proc.stdout
        assert list(cache_dir.iterdir()) == []
    finally:
        cache_dir.chmod(0o755)
        shutil.rmtree(shared)


# -- the lock: waiters are told what the holder is doing ---------------------------------------------


def test_a_waiter_is_told_the_holder_is_verifying_its_cached_copy(tmp_path, server, monkeypatch):
    # The holder runs the real path in a thread; only its hashing is held up (a large wheel on a
    # slow disk) until the waiter has said what it waits on.
    cache_dir = tmp_path / "cache"
    (cache_dir / SHA).mkdir(parents=True)
    (cache_dir / SHA / NAME).write_bytes(DATA)
    waiter_spoke = threading.Event()
    real_verify = fetch.verify_file

    def slow_for_the_holder(*args, **kw):
        if threading.current_thread().name == "holder":
            assert waiter_spoke.wait(10), "the waiter never announced its wait"
        return real_verify(*args, **kw)

    monkeypatch.setattr(fetch, "verify_file", slow_for_the_holder)
    holder_logs: List[str] = []
    holder = threading.Thread(name="holder", target=lambda: holder_logs.append(
        make_fetcher(cache_dir, []).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)))
    holder.start()
    owner = cache_dir / SHA / LOCK_OWNER_NAME
    deadline = time.monotonic() + 10
    while not owner.exists() and time.monotonic() < deadline:
        time.sleep(0.01)

    logs: List[str] = []

    def log(line: str) -> None:
        logs.append(line)
        waiter_spoke.set()

    try:
        path = make_fetcher(cache_dir, log, lock_wait=10).fetch_asset(server.base_url(TAG), NAME, SHA, SIZE)
    finally:
        waiter_spoke.set()
        holder.join(10)
    assert logs[0].startswith(f"waiting up to 10 s for the download cache lock {cache_dir / SHA / LOCK_NAME}, "
                              "held by pid ")
    assert logs[0].endswith(f", which is verifying its cached copy of {NAME}")
    assert "fetching" not in logs[0] and "download" not in logs[0].split("which is")[1]
    assert logs[1].startswith("got the download cache lock after ")
    assert path == cache_dir / SHA / NAME and holder_logs == [path]
    assert server.bytes_sent(NAME) == 0
