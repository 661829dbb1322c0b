"""The release manifest (`manifest.json`, one per release), parsed and written in one place.

    {"schema": 1, "version": "0.1.0", "assets": [
      {"name": "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl", "size": 123,
       "sha256": "<64 hex>", "cuda": "13.0", "platform": "manylinux_2_28_x86_64",
       "archs": ["sm_80", "sm_90a", "sm_100f", "sm_120f"], "ptx": ["compute_120"],
       "torch_floor": "2.10", "python_floor": "3.10", "driver_floor": "13.0"}]}

The manifest is what the sha256 check trusts, so a malformed one is an error naming the field,
never a guess. Unknown keys are ignored so a later release may add some; a different `schema`
means the meaning changed and is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from ..core import cuda
from ..core.errors import InstallerError

SCHEMA = 1

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MAJOR_MINOR_RE = re.compile(r"(\d+)\.(\d+)")  # a Python floor; CUDA versions are cuda.py's


@dataclass(frozen=True)
class Asset:
    name: str
    size: int
    sha256: str
    cuda: str  # toolkit 'major.minor' the wheel was built with
    platform: str
    archs: Tuple[str, ...]  # cubins: 'sm_80', 'sm_90a', 'sm_100f'
    ptx: Tuple[str, ...]  # 'compute_120'
    torch_floor: str
    python_floor: str
    driver_floor: str

    @property
    def version(self) -> Version:
        return parse_wheel_filename(self.name)[1]

    @property
    def public_version(self) -> str:
        return self.version.public

    @property
    def tags(self) -> FrozenSet[Tag]:
        return parse_wheel_filename(self.name)[3]

    @property
    def cuda_tuple(self) -> Tuple[int, int]:
        return cuda.parse_version(self.cuda)

    @property
    def python_floor_tuple(self) -> Tuple[int, int]:
        return _major_minor(self.python_floor)

    @property
    def driver_floor_tuple(self) -> Tuple[int, int]:
        return cuda.parse_version(self.driver_floor)

    @property
    def cuda_label(self) -> str:
        """'cu130': the wheel's local version label and its PEP 503 index folder."""
        return cuda.label(self.cuda_tuple)

    def describe_archs(self) -> str:
        """'sm_80, sm_90a, sm_100f, sm_120f + compute_120' for messages."""
        text = ", ".join(self.archs) or "no cubins"
        return text + (" + " + ", ".join(self.ptx) if self.ptx else "")


@dataclass(frozen=True)
class Manifest:
    version: str
    assets: Tuple[Asset, ...]
    schema: int = SCHEMA

    def to_dict(self) -> Dict[str, Any]:
        return {"schema": self.schema, "version": self.version,
                "assets": [asset_to_dict(a) for a in self.assets]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def find(self, name: str) -> Optional[Asset]:
        return next((a for a in self.assets if a.name == name), None)


def asset_to_dict(asset: Asset) -> Dict[str, Any]:
    return {
        "name": asset.name,
        "size": asset.size,
        "sha256": asset.sha256,
        "cuda": asset.cuda,
        "platform": asset.platform,
        "archs": list(asset.archs),
        "ptx": list(asset.ptx),
        "torch_floor": asset.torch_floor,
        "python_floor": asset.python_floor,
        "driver_floor": asset.driver_floor,
    }


def _major_minor(text: str) -> Tuple[int, int]:
    m = _MAJOR_MINOR_RE.fullmatch(text)
    assert m, text  # parse_manifest only lets such strings through
    return int(m.group(1)), int(m.group(2))


def _bad(where: str, value: Any, expected: str) -> InstallerError:
    shown = repr(value)
    if len(shown) > 120:
        shown = shown[:117] + "..."
    return InstallerError(f"release manifest: {where} is {shown}; expected {expected}")


def _field(obj: Dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise InstallerError(f"release manifest: {where}.{key} is missing")
    return obj[key]


def _string(obj: Dict[str, Any], key: str, where: str, valid: Optional[Callable[[str], bool]] = None,
            expected: str = "a string") -> str:
    value = _field(obj, key, where)
    if not isinstance(value, str) or (valid is not None and not valid(value)):
        raise _bad(f"{where}.{key}", value, expected)
    return value


def _string_list(obj: Dict[str, Any], key: str, where: str, valid: Callable[[str], bool],
                 expected: str) -> Tuple[str, ...]:
    value = _field(obj, key, where)
    if not isinstance(value, list):
        raise _bad(f"{where}.{key}", value, f"a list of {expected}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not valid(item):
            raise _bad(f"{where}.{key}[{i}]", item, expected)
    return tuple(value)


def _is_version(text: str) -> bool:
    try:
        cuda.parse_version(text)
    except ValueError:
        return False
    return True


def parse_asset(obj: Any, where: str = "asset") -> Asset:
    if not isinstance(obj, dict):
        raise _bad(where, obj, "an object")
    name = _string(obj, "name", where)
    try:
        _, version, _, tags = parse_wheel_filename(name)
    except (InvalidWheelFilename, InvalidVersion) as e:
        raise _bad(f"{where}.name", name, f"a wheel filename ({e})") from None
    size = _field(obj, "size", where)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(f"{where}.size", size, "a byte count (whole number >= 0)")
    mm = "'major.minor', e.g. '13.0'"
    asset = Asset(
        name=name,
        size=size,
        sha256=_string(obj, "sha256", where, _SHA256_RE.fullmatch, "64 lowercase hex digits"),
        cuda=_string(obj, "cuda", where, _is_version, mm),
        platform=_string(obj, "platform", where),
        archs=_string_list(obj, "archs", where, cuda.is_cubin, "cubin archs like 'sm_90a'"),
        ptx=_string_list(obj, "ptx", where, cuda.is_ptx, "PTX archs like 'compute_120'"),
        torch_floor=_string(obj, "torch_floor", where),
        python_floor=_string(obj, "python_floor", where, _MAJOR_MINOR_RE.fullmatch, "'major.minor', e.g. '3.10'"),
        driver_floor=_string(obj, "driver_floor", where, _is_version, mm),
    )
    try:
        Version(asset.torch_floor)
    except InvalidVersion:
        raise _bad(f"{where}.torch_floor", asset.torch_floor, "a version, e.g. '2.10'") from None
    if not asset.archs and not asset.ptx:
        raise _bad(f"{where}.archs", [], "at least one cubin or PTX arch")
    platforms = {t.platform for t in tags}
    if asset.platform not in platforms:
        raise _bad(f"{where}.platform", asset.platform, f"the platform tag of its name ({', '.join(sorted(platforms))})")
    labelled = cuda.version_of_local(str(version))
    if labelled and cuda.format_version(labelled) != asset.cuda:
        raise _bad(f"{where}.cuda", asset.cuda, f"the toolkit of its name's +{version.local} label")
    return asset


def parse_manifest(data: Any) -> Manifest:
    """A decoded manifest.json -> Manifest, or InstallerError naming the bad field."""
    if not isinstance(data, dict):
        raise _bad("the document", data, "a JSON object")
    schema = _field(data, "schema", "manifest")
    if schema != SCHEMA:
        raise _bad("schema", schema, f"{SCHEMA} (this installer reads schema {SCHEMA} only)")
    version = _string(data, "version", "manifest")
    try:
        Version(version)
    except InvalidVersion:
        raise _bad("version", version, "a version, e.g. '0.1.0'") from None
    raw_assets = _field(data, "assets", "manifest")
    if not isinstance(raw_assets, list):
        raise _bad("assets", raw_assets, "a list")
    assets = []
    seen = set()
    for i, obj in enumerate(raw_assets):
        asset = parse_asset(obj, f"assets[{i}]")
        if asset.name in seen:
            raise _bad(f"assets[{i}].name", asset.name, "a name not listed before")
        if Version(asset.public_version) != Version(version):
            raise _bad(f"assets[{i}].name", asset.name, f"a wheel of the manifest's version {version}")
        seen.add(asset.name)
        assets.append(asset)
    return Manifest(version=version, assets=tuple(assets), schema=schema)


def loads_manifest(text: str) -> Manifest:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise InstallerError(f"release manifest is not valid JSON: {e}") from None
    return parse_manifest(data)
