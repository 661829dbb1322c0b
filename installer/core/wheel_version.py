"""Rewrite a wheel's version: add the `+cuXYZ` label to a release asset, or drop it for pip.

pip refuses a wheel built from an sdist unless its name and version equal the sdist's, while the
release asset keeps its variant in the version (so it is also installable by URL, with
--find-links and from the PEP 503 index). One function does both directions: the dist-info folder
is renamed, METADATA's Version replaced and RECORD rewritten by `wheel.wheelfile.WheelFile`.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from wheel.wheelfile import WheelFile

SOURCE_RECORD = "cudelta_source.json"  # the install record: cudelta/_install_record.py


def wheel_filename(name: str, version: str, tags: str) -> str:
    return f"{name}-{version}-{tags}.whl"


def retag_version(src: Path, new_version: str, out_dir: Path, *, extra_dist_info: Optional[dict] = None,
                  platform: Optional[str] = None) -> Path:
    """Copy wheel `src` into `out_dir` with version `new_version` (and platform tag `platform`,
    if given); returns the new path.

    `extra_dist_info` is written as dist-info/cudelta_source.json (the install record of a
    prebuilt: what was chosen, from what, and where it came from).
    """
    name, old_version, build, tags = parse_wheel_filename(src.name)
    Version(new_version)  # raises InvalidVersion early, before any file is written
    dist_name = canonicalize_name(name).replace("-", "_")
    py_tag, abi_tag, plat_tag = src.name[:-4].split("-")[-3:]
    tag_text = f"{py_tag}-{abi_tag}-{platform or plat_tag}"
    build_part = f"-{build[0]}{build[1]}" if build else ""
    out_path = out_dir / (f"{dist_name}-{new_version}{build_part}-{tag_text}.whl")
    old_info = f"{dist_name}-{old_version}.dist-info/"
    new_info = f"{dist_name}-{new_version}.dist-info/"

    out_dir.mkdir(parents=True, exist_ok=True)
    # WheelFile names RECORD after the file it writes, so the temporary keeps the final name,
    # in a private folder beside the target; the rename makes the result appear whole or not at all.
    tmp_dir = Path(tempfile.mkdtemp(prefix=".retag-", dir=out_dir))
    tmp_path = tmp_dir / out_path.name
    try:
        _rewrite(src, tmp_path, old_info, new_info, new_version, extra_dist_info, tag_text)
        tmp_path.replace(out_path)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_path


def _rewrite(src: Path, dst: Path, old_info: str, new_info: str, new_version: str,
             extra_dist_info: Optional[dict], tag_text: str) -> None:
    with WheelFile(src) as zin, WheelFile(dst, "w") as zout:
        for info in zin.infolist():
            if info.filename == old_info + "RECORD":
                continue  # WheelFile writes a fresh RECORD on close
            data = zin.read(info.filename)
            target = info.filename
            if target.startswith(old_info):
                target = new_info + target[len(old_info):]
                if target == new_info + "METADATA":
                    data = _set_metadata_version(data, new_version)
                elif target == new_info + "WHEEL":
                    data = re.sub(rb"(?m)^Tag: .*$", b"Tag: " + tag_text.encode(), data)
            zout.writestr(_with_name(info, target), data)
        if extra_dist_info is not None:
            zout.writestr(new_info + SOURCE_RECORD, json.dumps(extra_dist_info, indent=1, sort_keys=True))


def _set_metadata_version(data: bytes, version: str) -> bytes:
    text = data.decode("utf-8")
    text, count = re.subn(r"(?m)^Version: .*$", f"Version: {version}", text, count=1)
    if count != 1:
        raise ValueError("wheel METADATA has no Version field")
    return text.encode("utf-8")


def _with_name(info, filename: str):
    import zipfile

    new = zipfile.ZipInfo(filename, date_time=info.date_time)
    new.external_attr = info.external_attr
    new.compress_type = zipfile.ZIP_DEFLATED
    return new


def public_version(version: str) -> str:
    return Version(version).public


def with_local_label(version: str, label: str) -> str:
    return f"{Version(version).public}+{label}"
