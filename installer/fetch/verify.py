"""Checksum verification of downloaded release assets.

The release manifest's sha256 is the only thing that ties a wheel fetched over the network (or
from a mirror, or from a cache that another process wrote) to what the release matrix built; so
an asset without one, or with one that does not match, is never installed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

from ..core.errors import VerificationError

CHUNK_SIZE = 1 << 20

_SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")

_FALLBACK = "set FORCE_BUILD=1 to compile from source instead"


def is_sha256(value: Optional[str]) -> bool:
    """True for a 64-hex-digit digest; the digest also names a cache folder, so nothing else."""
    return isinstance(value, str) and _SHA256_RE.fullmatch(value) is not None


def require_sha256(expected_sha256: Optional[str], what: str) -> str:
    """The digest in lower case, or VerificationError: an asset that cannot be checked is refused."""
    if not is_sha256(expected_sha256):
        raise VerificationError(
            f"release manifest has no sha256 for {what}; refusing to install an unverified "
            f"wheel (got {expected_sha256!r}, expected 64 hex digits); {_FALLBACK}"
        )
    assert expected_sha256 is not None
    return expected_sha256.lower()


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so a large wheel is never held in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK_SIZE), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(
    path: Path,
    expected_sha256: Optional[str],
    expected_size: Optional[int],
    what: str,
) -> None:
    """Raise VerificationError unless `path` has the manifest's size (when given) and sha256.

    Both the size and the digest are reported on a mismatch, whichever differs: a size that is off
    usually means a truncated or replaced download, a same-size digest mismatch a corrupted one.
    """
    expected = require_sha256(expected_sha256, what)
    actual_size = path.stat().st_size
    actual = sha256_file(path)
    if actual == expected and (expected_size is None or actual_size == expected_size):
        return
    sizes = (
        f"; size: expected {expected_size} bytes, got {actual_size}"
        if expected_size is not None and actual_size != expected_size
        else ""
    )
    raise VerificationError(
        f"checksum mismatch for {what}: expected sha256 {expected}, got {actual}{sizes}. "
        f"The file was not installed. Retry the install to download it again, or {_FALLBACK}."
    )
