"""The download cache's folder discipline: files appear whole and verified, or not at all; the lock
says who holds it and what it is doing; a cache that cannot hold a file says why, in words that
name the fix. installer/fetch/fetch.py holds the lock and decides what to fetch.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import socket
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Optional

from .transfer import amount
from .verify import verify_file

LOCK_NAME = ".lock"
# Beside the lock, not in it: waiting processes open the lock file too, and may truncate it.
LOCK_OWNER_NAME = ".lock.owner"
PARTIAL_PREFIX = ".partial-"
# The holder rewrites its phase at most this often while downloading (a waiter reads it when it
# starts waiting and when it gives up): cheap, and fresh enough to show progress between the two.
OWNER_EVERY_S = 0.25
# Room kept free beyond the wheel itself (filesystem metadata, the lock files) when judging
# whether the cache's disk can take a download before starting it.
SPACE_MARGIN = 64 * 1024
PRIVATE_PREFIX = "cudelta-download-"


class DiskError(Exception):
    """Writing a file failed on the disk's side, not the network's: `error` is the OSError, `path`
    the file or folder it was about. `verified`: a verified copy that could not be renamed into
    place, left for the caller to move out (it is inside the cache and must not stay there), then
    where the caller moved it."""

    def __init__(self, error: OSError, path: Path, verified: Optional[Path] = None, detail: str = "") -> None:
        super().__init__(f"{path}: {error.strerror or type(error).__name__}")
        self.error, self.path, self.verified, self.detail = error, path, verified, detail
        self.mid_download = False  # set by the fetcher: some bytes had come (and are lost)


def write_verified(
    chunks: Iterable[bytes], target: Path, sha256: str, size: Optional[int], what: str
) -> None:
    """Write `chunks` beside `target`, verify, then rename into place.

    The rename is atomic within a folder, so `target` either does not exist or holds a verified
    file; whatever fails (network, disk, checksum, Ctrl-C) removes the partial file, except a
    verified file whose rename failed: that one is handed to the caller in DiskError.verified.
    Failures of the disk (not of `chunks`) are DiskError, so the caller can tell a full or
    read-only disk from a broken download.
    """
    try:
        tmp = tempfile.NamedTemporaryFile(dir=target.parent, delete=False, prefix=PARTIAL_PREFIX)
    except OSError as exc:
        raise DiskError(exc, target.parent) from None
    tmp_path = Path(tmp.name)
    keep = False
    try:
        try:
            for chunk in chunks:
                _on_disk(tmp_path, tmp.write, chunk)
            _on_disk(tmp_path, _flush_to_disk, tmp)
            _on_disk(tmp_path, tmp.close)
        finally:
            # Closing flushes what is buffered: on a full disk it fails again, after DiskError said why.
            with suppress(OSError):
                tmp.close()
        verify_file(tmp_path, sha256, size, what)
        # NamedTemporaryFile is 0600; a cache shared between users must stay readable.
        os.chmod(tmp_path, 0o644)
        try:
            os.replace(tmp_path, target)
        except OSError as exc:
            keep = True
            raise DiskError(exc, target, verified=tmp_path) from None
    except BaseException:
        if not keep:
            with suppress(OSError):
                tmp_path.unlink()
        raise


def _flush_to_disk(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _on_disk(path: Path, call, *args) -> None:  # type: ignore[no-untyped-def]
    try:
        call(*args)
    except OSError as exc:
        raise DiskError(exc, path) from None


def check_room(target: Path, size: Optional[int]) -> None:
    """DiskError, before any byte is downloaded, when `target` cannot be written: something other
    than a file at its path (a folder, EISDIR), or a disk without room for `size` bytes (ENOSPC)."""
    if (target.exists() or target.is_symlink()) and not target.is_file():
        raise DiskError(IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target)), target)
    if size is None:
        return
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        return  # not knowing is no reason to refuse: the write itself will tell
    if free < size + SPACE_MARGIN:
        raise DiskError(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), target.parent,
                        detail=f"{amount(free)} free, {amount(size)} needed")


def private_folder() -> Path:
    """A new folder of this process's own, outside the cache, removed when the process exits (the
    caller copies the wheel out before that)."""
    folder = Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def move_out(verified: Path, name: str) -> Path:
    """Move a verified file out of the cache into a private folder; the cache keeps nothing of it."""
    try:
        folder = private_folder()
        return Path(shutil.move(str(verified), str(folder / name)))
    finally:
        with suppress(OSError):
            verified.unlink()


def remove_partials(folder: Path) -> None:
    """Partial files of processes that were killed; safe only while holding the folder's lock."""
    for path in folder.glob(PARTIAL_PREFIX + "*"):
        with suppress(OSError):
            path.unlink()


# -- why the cache cannot hold a file ---------------------------------------------------------------

FIX = "set CUDELTA_CACHE_DIR to"


def unusable_words(failure: DiskError, cache_dir: Path) -> str:
    """Why the download cache `cache_dir` cannot hold a file, and the fix: one clause each, in
    words that tell the causes apart; the errno's name is kept for searching."""
    error, path = failure.error, failure.path
    code = error.errno
    name = errno.errorcode.get(code or 0, "")
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(path)
        where = f"{blocker} is a file, not a folder" if blocker else f"{path} is not a folder"
        return f"{where}, so the download cache {cache_dir} cannot be created ({name}); {FIX} a folder"
    if code in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left" if code == errno.ENOSPC else "disk quota exceeded"
        detail = f" ({failure.detail})" if failure.detail else ""
        return (f"{what} on the disk of the download cache {cache_dir}{detail} ({name}); free some space "
                f"there or {FIX} a folder on another disk")
    if code == errno.EROFS:
        return f"the download cache {cache_dir} is on a read-only filesystem ({name}); {FIX} a writable folder"
    if code in (errno.EACCES, errno.EPERM):
        return (f"no permission to write {path} in the download cache {cache_dir} ({name}); {FIX} "
                "a folder you can write to")
    if code == errno.EISDIR:
        return (f"a folder is in the way of the cache's file {path} ({name}); remove that folder or {FIX} "
                "another folder")
    return (f"cannot write {path} in the download cache {cache_dir}: {error.strerror or type(error).__name__}"
            f"{f' ({name})' if name else ''}; {FIX} a writable folder with free space")


def _file_in_the_way(path: Path) -> Optional[Path]:
    """The nearest existing ancestor of `path` (or `path`) that is not a folder."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


# -- the lock's owner file --------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    who: str  # "pid 123 on host since 10:00:00"
    doing: str  # "downloading x.whl (0.3 MB of 1.4 MB)"; "" when it did not say


class LockOwner:
    """The owner file of a lock this process holds: who, and what it is doing now. Rewritten as the
    phase changes (atomically: a waiter never reads half a file); removed when the lock is released."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_OWNER_NAME
        self.who = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
        self._written = 0.0

    def doing(self, phase: str, *, throttle: bool = False) -> None:
        now = time.monotonic()
        if throttle and now - self._written < OWNER_EVERY_S:
            return
        self._written = now
        # A partial name: a process killed between write and rename leaves what remove_partials takes.
        tmp = self.path.with_name(f"{PARTIAL_PREFIX}owner-{os.getpid()}")
        try:
            tmp.write_text(f"{self.who}\n{phase}\n")
            os.replace(tmp, self.path)
        except OSError:  # who holds the lock is for messages only; a full disk must not stop a fetch
            with suppress(OSError):
                tmp.unlink()

    def remove(self) -> None:
        with suppress(OSError):
            self.path.unlink()


def lock_holder(folder: Path) -> Holder:
    try:
        lines = (folder / LOCK_OWNER_NAME).read_text().splitlines()
    except OSError:
        lines = []
    who = lines[0].strip() if lines else ""
    doing = lines[1].strip() if len(lines) > 1 else ""
    return Holder(who or "a process that did not say", doing)
