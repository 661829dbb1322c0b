"""The download cache's folder discipline: files appear whole and verified, or not at all; the lock
says who holds it. installer/fetch.py holds the lock and decides what to fetch.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Iterable, Optional

from .verify import verify_file

LOCK_NAME = ".lock"
# Beside the lock, not in it: waiting processes open the lock file too, and may truncate it.
LOCK_OWNER_NAME = ".lock.owner"
PARTIAL_PREFIX = ".partial-"


def write_verified(
    chunks: Iterable[bytes], target: Path, sha256: str, size: Optional[int], what: str
) -> None:
    """Write `chunks` beside `target`, verify, then rename into place.

    The rename is atomic within a folder, so `target` either does not exist or holds a verified
    file; whatever fails (network, disk, checksum, Ctrl-C) removes the partial file.
    """
    tmp = tempfile.NamedTemporaryFile(dir=target.parent, delete=False, prefix=PARTIAL_PREFIX)
    tmp_path = Path(tmp.name)
    try:
        with tmp:
            for chunk in chunks:
                tmp.write(chunk)
            tmp.flush()
            os.fsync(tmp.fileno())
        verify_file(tmp_path, sha256, size, what)
        # NamedTemporaryFile is 0600; a cache shared between users must stay readable.
        os.chmod(tmp_path, 0o644)
        os.replace(tmp_path, target)
    except BaseException:
        with suppress(OSError):
            tmp_path.unlink()
        raise


def remove_partials(folder: Path) -> None:
    """Partial files of processes that were killed; safe only while holding the folder's lock."""
    for path in folder.glob(PARTIAL_PREFIX + "*"):
        with suppress(OSError):
            path.unlink()



def write_lock_owner(folder: Path) -> None:
    """Who holds the lock, for the message of a process that waits on it."""
    with suppress(OSError):
        (folder / LOCK_OWNER_NAME).write_text(
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n")


def lock_owner(folder: Path) -> str:
    try:
        owner = (folder / LOCK_OWNER_NAME).read_text().strip()
    except OSError:
        owner = ""
    return owner or "a process that did not say"
