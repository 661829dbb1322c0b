import hashlib

import pytest

from installer.core.errors import VerificationError
from installer.fetch import verify

DATA = b"wheel bytes " * 100_000  # > 1 MiB: several chunks
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def wheel(tmp_path):
    path = tmp_path / "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
    path.write_bytes(DATA)
    return path


def test_sha256_file_matches_hashlib(wheel):
    assert verify.sha256_file(wheel) == DIGEST


def test_sha256_file_of_empty_file(tmp_path):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert verify.sha256_file(empty) == hashlib.sha256(b"").hexdigest()


def test_verify_accepts_matching_digest_and_size(wheel):
    verify.verify_file(wheel, DIGEST, len(DATA), wheel.name)
    verify.verify_file(wheel, DIGEST, None, wheel.name)


def test_verify_accepts_upper_case_digest(wheel):
    verify.verify_file(wheel, DIGEST.upper(), len(DATA), wheel.name)


@pytest.mark.parametrize("expected", [None, "", "abc", "g" * 64, DIGEST + "0", " " + DIGEST[1:]])
def test_verify_refuses_missing_or_malformed_digest(wheel, expected):
    with pytest.raises(VerificationError) as info:
        verify.verify_file(wheel, expected, len(DATA), "the-asset.whl")
    message = str(info.value)
    assert "release manifest has no sha256 for the-asset.whl" in message
    assert "refusing to install an unverified wheel" in message


def test_verify_digest_mismatch_names_asset_both_digests_and_fallback(wheel):
    wrong = "0" * 64
    with pytest.raises(VerificationError) as info:
        verify.verify_file(wheel, wrong, len(DATA), "the-asset.whl")
    message = str(info.value)
    assert "the-asset.whl" in message
    assert wrong in message and DIGEST in message
    assert "not installed" in message
    assert "FORCE_BUILD=1" in message


def test_verify_size_mismatch_fails_even_with_matching_digest(wheel):
    with pytest.raises(VerificationError) as info:
        verify.verify_file(wheel, DIGEST, len(DATA) + 1, "the-asset.whl")
    message = str(info.value)
    assert f"expected {len(DATA) + 1} bytes, got {len(DATA)}" in message
    assert DIGEST in message
    assert "FORCE_BUILD=1" in message


def test_is_sha256():
    assert verify.is_sha256(DIGEST)
    assert not verify.is_sha256(DIGEST[:-1])
    assert not verify.is_sha256(None)
    assert not verify.is_sha256("../" + DIGEST[3:])
