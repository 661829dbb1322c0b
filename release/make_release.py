"""Assemble the assets of one release from the wheels the release matrix built.

    python -m release.make_release --version 0.1.0 --out DIR WHEEL...

writes into DIR (new or empty):

    <wheel>...                      the wheels, copied unchanged
    manifest.json                   schema 1 (installer/choose/manifest.py): name, size, sha256 and, from
                                    each wheel's own cudelta/_build_info.json, CUDA toolkit, cubin
                                    archs, PTX, torch / Python / driver floors; platform from the name
    SHA256SUMS                      `sha256sum -c` format, covering the wheels and manifest.json
    whl/<cuXYZ>/index.html          a PEP 503 simple index per CUDA flavour, so that
    whl/<cuXYZ>/cudelta/index.html  `pip install cudelta --extra-index-url <DIR's URL>/whl/cu130`
                                    (or --index-url) works without the sdist

The index links are relative (`../../../<wheel>#sha256=<hex>`), so DIR works wherever it is
served, as is; `--link-base URL` makes them absolute instead (an index published apart from the
wheels, e.g. pointing at the GitHub release download URL).

Every input is checked before anything is written: a wheel given twice, a wheel of another
version than --version, a label only in the file name (METADATA must carry it too), a missing or
incomplete build record, or two wheels for one (CUDA toolkit, platform) are errors naming the
wheel; the manifest is validated by the same parser the installer reads it with.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import posixpath
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import quote

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from installer.choose.manifest import Asset, Manifest, asset_to_dict, parse_asset, parse_manifest
from installer.compile import build_record
from installer.core import cuda, shipped
from installer.core.errors import InstallerError
from installer.fetch.verify import sha256_file

PROJECT = "cudelta"
POLICY = shipped.load("_release_policy")
BUILD_INFO = f"cudelta/{build_record.FILENAME}"
MANIFEST_NAME = "manifest.json"
SUMS_NAME = "SHA256SUMS"
INDEX_DIR = "whl"
# Keys of the build record the manifest needs (cudelta/_build_record.py: the contract).
BUILD_INFO_KEYS = ("version", "cuda_toolkit", "archs", "ptx", "torch_floor", "python_floor")


class ReleaseError(Exception):
    """An input that cannot become a release asset; the message names the wheel and the fix."""


@dataclass(frozen=True)
class WheelInput:
    """What one wheel given on the command line contributes, read once."""

    path: Path
    name: str
    size: int
    sha256: str
    metadata_name: str
    metadata_version: str
    build_info: Mapping[str, Any]


# -- reading the inputs ---------------------------------------------------------------------------


def read_wheel(path: Path) -> WheelInput:
    """Size, digest, METADATA name/version and build record of the wheel at `path`."""
    if not path.is_file():
        raise ReleaseError(f"{path}: no such file")
    try:
        parse_wheel_filename(path.name)
    except (InvalidWheelFilename, InvalidVersion) as exc:
        raise ReleaseError(f"{path}: not a wheel file name ({exc})") from None
    try:
        with zipfile.ZipFile(path) as zf:
            meta_name, meta_version = read_metadata(zf, path.name)
            build_info = read_build_info(zf, path.name)
    except zipfile.BadZipFile as exc:
        raise ReleaseError(f"{path}: not a zip archive ({exc})") from None
    return WheelInput(
        path=path,
        name=path.name,
        size=path.stat().st_size,
        sha256=sha256_file(path),
        metadata_name=meta_name,
        metadata_version=meta_version,
        build_info=build_info,
    )


def read_metadata(zf: zipfile.ZipFile, wheel_name: str) -> Tuple[str, str]:
    """(Name, Version) of the wheel's top-level `*.dist-info/METADATA`."""
    found = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
    if len(found) != 1:
        raise ReleaseError(f"{wheel_name}: expected one *.dist-info/METADATA, found {len(found)}")
    headers = HeaderParser().parsestr(zf.read(found[0]).decode("utf-8"))
    name, version = headers.get("Name"), headers.get("Version")
    if not name or not version:
        raise ReleaseError(f"{wheel_name}: {found[0]} lacks Name or Version")
    return name.strip(), version.strip()


def read_build_info(zf: zipfile.ZipFile, wheel_name: str) -> Dict[str, Any]:
    """The wheel's `cudelta/_build_info.json` (what the build compiled: toolkit, archs, floors)."""
    try:
        raw = zf.read(BUILD_INFO)
    except KeyError:
        raise ReleaseError(
            f"{wheel_name}: has no {BUILD_INFO}; release wheels come from "
            "CUDELTA_RELEASE_BUILD=1 python setup.py bdist_wheel"
        ) from None
    try:
        return build_record.loads(raw.decode("utf-8", "replace"), required=BUILD_INFO_KEYS)
    except build_record.BuildRecordError as exc:
        raise ReleaseError(f"{wheel_name}: {BUILD_INFO}: {exc}") from None


# -- checks (pure) --------------------------------------------------------------------------------


def check_wheels(wheels: Sequence[WheelInput], version: str) -> None:
    """Raise ReleaseError unless every wheel is a distinct `version` asset of this project."""
    if not wheels:
        raise ReleaseError("no wheels given")
    wanted = Version(version)
    seen: Dict[str, Path] = {}
    for w in wheels:
        if w.name in seen:
            raise ReleaseError(f"{w.name} is given twice ({seen[w.name]} and {w.path}); each asset once")
        seen[w.name] = w.path
        check_wheel(w, wanted)
    check_one_per_variant(wheels)


def check_wheel(w: WheelInput, wanted: Version) -> None:
    name, file_version, _, _ = parse_wheel_filename(w.name)
    if name != canonicalize_name(PROJECT):
        raise ReleaseError(f"{w.name} is a wheel of {name!r}, not {PROJECT}")
    if Version(file_version.public) != wanted:
        raise ReleaseError(f"{w.name} is version {file_version.public}, not --version {wanted}")
    try:
        meta_version = Version(w.metadata_version)
    except InvalidVersion:
        raise ReleaseError(f"{w.name}: METADATA Version {w.metadata_version!r} is not a version") from None
    if canonicalize_name(w.metadata_name) != name or meta_version != file_version:
        raise ReleaseError(
            f"{w.name}: METADATA says {w.metadata_name} {w.metadata_version}, the file name "
            f"{name} {file_version}; they must agree (a label only in the file name breaks pip and uv)"
        )
    try:
        built = Version(str(w.build_info["version"]))
    except InvalidVersion:
        built = None
    if built is None or Version(built.public) != wanted:
        raise ReleaseError(f"{w.name}: {BUILD_INFO} says version {w.build_info['version']!r}, not {wanted}")


def check_one_per_variant(wheels: Sequence[WheelInput]) -> None:
    """One wheel per (CUDA toolkit, platform): the installer must never have to pick between two."""
    seen: Dict[Tuple[str, str], str] = {}
    for w in wheels:
        key = (cuda_major_minor(w.build_info["cuda_toolkit"], w.name), platform_of(w.name))
        if key in seen:
            raise ReleaseError(f"{seen[key]} and {w.name} are both CUDA {key[0]} wheels for {key[1]}; give one")
        seen[key] = w.name


# -- the manifest (pure) --------------------------------------------------------------------------


def cuda_major_minor(toolkit: Any, wheel_name: str) -> str:
    """'13.0' or '13.0.88' -> '13.0'."""
    try:
        return cuda.format_version(cuda.parse_version(str(toolkit), patch_ok=True))
    except ValueError:
        raise ReleaseError(f"{wheel_name}: {BUILD_INFO} cuda_toolkit {toolkit!r} is not a CUDA version like '13.0'") from None


def platform_of(wheel_name: str) -> str:
    """The single platform tag of a wheel's name, e.g. 'manylinux_2_28_x86_64'."""
    platforms = sorted({t.platform for t in parse_wheel_filename(wheel_name)[3]})
    if len(platforms) != 1:
        raise ReleaseError(f"{wheel_name}: expected one platform tag, found {', '.join(platforms)}")
    return platforms[0]


def make_asset(name: str, size: int, sha256: str, build_info: Mapping[str, Any]) -> Asset:
    """One manifest entry, validated exactly as the installer will parse it."""
    toolkit = cuda_major_minor(build_info.get("cuda_toolkit"), name)
    asset = Asset(
        name=name,
        size=size,
        sha256=sha256,
        cuda=toolkit,
        platform=platform_of(name),
        archs=tuple(build_info.get("archs") or ()),
        ptx=tuple(build_info.get("ptx") or ()),
        torch_floor=str(build_info.get("torch_floor")),
        python_floor=str(build_info.get("python_floor")),
        driver_floor=cuda.format_version(POLICY.driver_floor(toolkit)),
    )
    try:
        return parse_asset(asset_to_dict(asset), where=name)
    except InstallerError as exc:
        raise ReleaseError(str(exc)) from None


def make_manifest(version: str, assets: Sequence[Asset]) -> Manifest:
    manifest = Manifest(version=str(Version(version)), assets=tuple(sorted(assets, key=lambda a: a.name)))
    try:
        return parse_manifest(json.loads(manifest.to_json()))
    except InstallerError as exc:
        raise ReleaseError(str(exc)) from None


def sha256sums(entries: Iterable[Tuple[str, str]]) -> str:
    """`sha256sum` output for (name, hex digest) pairs, sorted by name."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(entries))


# -- the PEP 503 index (pure) ---------------------------------------------------------------------


def flavour(asset: Asset) -> str:
    """'13.0' -> 'cu130', the folder name of that toolkit's index."""
    return asset.cuda_label


def wheel_href(name: str, sha256: str, page_dir: str, link_base: Optional[str]) -> str:
    """The link to wheel `name` from the index page in folder `page_dir` (relative to the release)."""
    quoted = quote(name, safe="")
    if link_base:
        target = link_base.rstrip("/") + "/" + quoted
    else:
        target = posixpath.relpath(".", page_dir) + "/" + quoted
    return f"{target}#sha256={sha256}"


def _page(title: str, links: Sequence[str]) -> str:
    body = "".join(f"    {link}<br/>\n" for link in links)
    return (
        "<!DOCTYPE html>\n<html>\n  <head>\n    <meta name=\"pypi:repository-version\" content=\"1.0\">\n"
        f"    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n    <h1>{html.escape(title)}</h1>\n"
        f"{body}  </body>\n</html>\n"
    )


def index_pages(assets: Sequence[Asset], link_base: Optional[str] = None) -> Dict[str, str]:
    """{path relative to the release folder: HTML} of the simple index of every CUDA flavour."""
    project = canonicalize_name(PROJECT)
    by_flavour: Dict[str, List[Asset]] = {}
    for asset in assets:
        by_flavour.setdefault(flavour(asset), []).append(asset)
    pages: Dict[str, str] = {}
    for flav, group in sorted(by_flavour.items()):
        root = f"{INDEX_DIR}/{flav}"
        pages[f"{root}/index.html"] = _page(
            f"Simple index ({flav})", [f'<a href="{project}/">{html.escape(project)}</a>'])
        page_dir = f"{root}/{project}"
        links = []
        for asset in sorted(group, key=lambda a: a.name):
            href = html.escape(wheel_href(asset.name, asset.sha256, page_dir, link_base), quote=True)
            requires = html.escape(f">={asset.python_floor}", quote=True)
            links.append(f'<a href="{href}" data-requires-python="{requires}">{html.escape(asset.name)}</a>')
        pages[f"{page_dir}/index.html"] = _page(f"Links for {project}", links)
    return pages


# -- writing --------------------------------------------------------------------------------------


def plan_release(version: str, wheels: Sequence[WheelInput], link_base: Optional[str] = None
                 ) -> Tuple[Manifest, Dict[str, str]]:
    """(manifest, {relative path: text} of every generated file), from checked inputs; pure."""
    check_wheels(wheels, version)
    manifest = make_manifest(version, [make_asset(w.name, w.size, w.sha256, w.build_info) for w in wheels])
    manifest_text = manifest.to_json()
    files = {MANIFEST_NAME: manifest_text}
    manifest_sha = _sha256_text(manifest_text)
    files[SUMS_NAME] = sha256sums([(a.name, a.sha256) for a in manifest.assets] + [(MANIFEST_NAME, manifest_sha)])
    files.update(index_pages(manifest.assets, link_base))
    return manifest, files


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prepare_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleaseError(f"--out {out} must be a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)


def write_release(out: Path, wheels: Sequence[WheelInput], files: Mapping[str, str]) -> List[Path]:
    """Copy the wheels and write the generated files into `out`; returns what was written."""
    written = []
    for w in wheels:
        dst = out / w.name
        shutil.copyfile(w.path, dst)
        if os.path.getsize(dst) != w.size:  # the source changed under us
            raise ReleaseError(f"{w.path} changed while the release was being made")
        written.append(dst)
    for rel, text in files.items():
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text, encoding="utf-8")
        written.append(dst)
    return written


def make_release(version: str, out: Path, wheel_paths: Sequence[Path], link_base: Optional[str] = None) -> Manifest:
    """Everything main() does, for callers in Python (tests, other scripts)."""
    try:
        Version(version)
    except InvalidVersion:
        raise ReleaseError(f"--version {version!r} is not a version, e.g. 0.1.0") from None
    wheels = [read_wheel(Path(p)) for p in wheel_paths]
    manifest, files = plan_release(version, wheels, link_base)
    prepare_out_dir(out)
    write_release(out, wheels, files)
    return manifest


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True, help="the release's version, e.g. 0.1.0 (tag v0.1.0)")
    parser.add_argument("--out", required=True, type=Path, help="new or empty folder for the release assets")
    parser.add_argument("--link-base", default=None,
                        help="absolute URL the index links wheels under (default: relative links into --out)")
    parser.add_argument("wheels", nargs="+", type=Path, metavar="WHEEL")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        manifest = make_release(args.version, args.out, args.wheels, args.link_base)
    except ReleaseError as exc:
        print(f"make_release: error: {exc}", file=sys.stderr)
        return 1
    for asset in manifest.assets:
        print(f"{asset.name}  {asset.size} bytes  sha256 {asset.sha256}  CUDA {asset.cuda}  "
              f"{asset.describe_archs()}")
    flavours = sorted({flavour(a) for a in manifest.assets})
    print(f"wrote {len(manifest.assets)} wheel(s), {MANIFEST_NAME}, {SUMS_NAME} and the index "
          f"{', '.join(f'{INDEX_DIR}/{f}/' for f in flavours)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
