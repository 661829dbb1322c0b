"""The install record, `cudelta_source.json` in the dist-info: what an install chose, and from what.

pip and uv cache the wheel an sdist built, so the choice made on one machine (a GPU-less CI
runner, an image build) can be installed, unbuilt, on another (a GPU host). The record keeps what
the choice was made from, so that the installed package can tell, at run time and without the
installer, whether this machine would have chosen differently: `stale()` here is that rule, and
the GPU-coverage and preference rules it needs are the installer's own (installer/choose/choose.py and
installer/core/cuda.py use the functions below), so the two cannot disagree.

Written by installer/choose/install_record.py (which loads this file by path and validates every record
with `parse`), read by the loader (cudelta/_native.py), `python -m cudelta` and the tests.
Standard library only, and no import of the package: build tooling loads this file by path.

Schema 2:

    schema      2
    kind        'prebuilt' (a verified release asset) | 'pure' (no native code) | 'local' (compiled here)
    reason      the choice's one line, as the install said it
    machine     what the choice was made from:
                  os 'linux', arch 'x86_64', glibc '2.36' | null, python '3.11',
                  driver_cuda '13.0' | null (the driver the build saw, none: null),
                  gpus ['9.0', ...] (compute capabilities the build saw),
                  torch '2.14.1+cu130' | null (reported only), override 'CUDELTA_DRIVER_CUDA=cpu' | null
    chosen      prebuilt, local: the library's facts {name, platform, cuda, driver_floor, archs, ptx}
    candidates  prebuilt: every asset of the release this platform and Python can install (the
                chosen one included), with the same facts: what another machine of the platform gets
    rejected    prebuilt: [[asset name, why not], ...], every asset not chosen
    pure_because  pure: 'override' (CUDELTA_DRIVER_CUDA=cpu) | 'platform' (no CUDA build for it)
    asset, sha256, url, manifest   prebuilt: where the asset came from

Schema 1 (no `schema`) held only asset, sha256, url and manifest; it is read, carries no facts, and
is never judged stale.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

SCHEMA = 2
FILENAME = "cudelta_source.json"
KINDS = ("prebuilt", "pure", "local")
# The cure for a cached wheel, before each reinstall command (cudelta/_build_record.py's).
CLEAR_PIP_CACHE = "pip cache remove cudelta"
CLEAR_UV_CACHE = "uv cache clean cudelta"

Version = Tuple[int, int]


class InstallRecordError(ValueError):
    """A record that is not one: the message names the key."""


# --------------------------------------------------------------------------------------------
# The rules the installer's choice and this check share


_CODE_RE = re.compile(r"(sm|compute)_(\d{2,})([af]?)")


def parse_code_arch(text: str) -> Tuple[str, int, int, str]:
    """'sm_90a' -> ('sm', 9, 0, 'a'); 'compute_120' -> ('compute', 12, 0, '')."""
    m = _CODE_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a CUDA arch: {text!r}")
    number = int(m.group(2))
    return m.group(1), number // 10, number % 10, m.group(3)


def arch_covers(arch: str, major: int, minor: int) -> bool:
    """Whether code for `arch` runs on a GPU of compute capability major.minor.

    sm_XY cubins run on X.y for y >= Y (same major); sm_XYa only on X.Y (arch-specific
    features); sm_XYf on the family, X.y for y >= Y; PTX compute_XY is JIT-compiled for any
    cc >= X.Y, while compute_XYa / compute_XYf PTX is bound like the cubin of the same suffix.
    """
    kind, a_major, a_minor, suffix = parse_code_arch(arch)
    if suffix == "a":
        return (major, minor) == (a_major, a_minor)
    if kind == "sm" or suffix == "f":
        return major == a_major and minor >= a_minor
    return (major, minor) >= (a_major, a_minor)


def covering_arch(archs: Iterable[str], major: int, minor: int) -> Optional[str]:
    """The image the driver would run on a major.minor GPU: a cubin before PTX (no JIT), the
    nearest cc first, and at equal cc an arch-specific one before a family one before a plain
    one (more features enabled). None if nothing covers it."""
    best: Optional[Tuple[Tuple[int, int, int, int], str]] = None
    for arch in archs:
        if not arch_covers(arch, major, minor):
            continue
        kind, a_major, a_minor, suffix = parse_code_arch(arch)
        key = (int(kind == "sm"), a_major, a_minor, {"a": 2, "f": 1, "": 0}[suffix])
        if best is None or key > best[0]:
            best = (key, arch)
    return best[1] if best else None


def runnable_images(archs: Sequence[str], ptx: Sequence[str], toolkit: Version,
                    driver: Optional[Version]) -> Tuple[str, ...]:
    """What a library offers a GPU: its cubins, and its PTX only where the driver can JIT it (a
    driver that knows the toolkit's PTX version; an unseen one cannot be counted on)."""
    return tuple(archs) + (tuple(ptx) if driver is not None and driver >= toolkit else ())


def preference(cuda: Version, driver_floor: Version, driver_seen: bool) -> Tuple:
    """Sort key of the assets that fit (highest wins): with a driver in sight, the newest toolkit
    it runs; with none, the one that runs on the most drivers, then the newest toolkit."""
    if driver_seen:
        return (cuda,)
    return (tuple(-x for x in driver_floor), cuda)


# --------------------------------------------------------------------------------------------
# Names of the platform, as the installer's probe and the run time both spell them


def normalise_os(platform: str) -> str:
    """sys.platform -> 'linux', 'windows', 'darwin', ..."""
    if platform.startswith("linux"):
        return "linux"
    if platform.startswith(("win32", "cygwin", "msys")):
        return "windows"
    return platform  # 'darwin', 'freebsd13', ...


def normalise_machine(os_name: str, machine: str) -> str:
    m = machine.strip().lower()
    if m in {"amd64", "x64"}:
        return "x86_64"
    if m == "arm64" and os_name == "linux":
        return "aarch64"
    return m


def parse_glibc(text: Optional[str]) -> Optional[Version]:
    """os.confstr('CS_GNU_LIBC_VERSION'): 'glibc 2.36' -> (2, 36); musl and others -> None."""
    m = re.fullmatch(r"\s*glibc\s+(\d+)\.(\d+)\S*\s*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# --------------------------------------------------------------------------------------------
# The record


def _version(text: Optional[str]) -> Optional[Version]:
    if text is None:
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def _fmt(version: Optional[Version]) -> str:
    return f"{version[0]}.{version[1]}" if version else "none"


_MACHINE = {"os": str, "arch": str, "glibc": (str, type(None)), "python": str, "driver_cuda": (str, type(None)),
            "gpus": list, "torch": (str, type(None)), "override": (str, type(None))}
_LIBRARY = {"name": str, "platform": str, "cuda": str, "driver_floor": str, "archs": list, "ptx": list}


def _check_object(where: str, obj: Any, fields: Mapping[str, Any]) -> None:
    if not isinstance(obj, dict):
        raise InstallRecordError(f"install record {where} is {obj!r}; expected a JSON object")
    for key, kind in fields.items():
        if key not in obj:
            raise InstallRecordError(f"install record {where} lacks {key}")
        if not isinstance(obj[key], kind):
            raise InstallRecordError(f"install record {where}.{key} is {obj[key]!r}")
        if isinstance(obj[key], list) and not all(isinstance(x, str) for x in obj[key]):
            raise InstallRecordError(f"install record {where}.{key} is {obj[key]!r}; expected a list of strings")


def parse(data: Any) -> Dict[str, Any]:
    """A decoded record -> a copy, schema 1 or 2; InstallRecordError naming what is wrong."""
    if not isinstance(data, dict):
        raise InstallRecordError(f"the install record is {type(data).__name__}, not a JSON object")
    record = dict(data)
    schema = record.setdefault("schema", 1)
    if schema == 1:
        return record
    if schema != SCHEMA:
        raise InstallRecordError(f"install record schema {schema!r}; this cudelta reads schemas 1 and {SCHEMA}")
    if record.get("kind") not in KINDS:
        raise InstallRecordError(f"install record kind is {record.get('kind')!r}; expected one of {', '.join(KINDS)}")
    if not isinstance(record.get("reason"), str):
        raise InstallRecordError(f"install record reason is {record.get('reason')!r}; expected a string")
    _check_object("machine", record.get("machine"), _MACHINE)
    if record["kind"] in ("prebuilt", "local"):
        _check_object("chosen", record.get("chosen"), _LIBRARY)
    if record["kind"] == "prebuilt":
        for i, candidate in enumerate(record.get("candidates", [])):
            _check_object(f"candidates[{i}]", candidate, _LIBRARY)
        for i, row in enumerate(record.get("rejected", [])):
            if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, str) for x in row)):
                raise InstallRecordError(f"install record rejected[{i}] is {row!r}; expected [asset, reason]")
    if record["kind"] == "pure" and record.get("pure_because") not in ("override", "platform"):
        raise InstallRecordError(f"install record pure_because is {record.get('pure_because')!r}; "
                                 "expected 'override' or 'platform'")
    return record


def loads(text: str) -> Dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InstallRecordError(f"the install record is not valid JSON ({exc})") from None
    return parse(data)


def dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(dict(record), indent=1, sort_keys=True) + "\n"


# --------------------------------------------------------------------------------------------
# Would this machine choose differently?


@dataclass(frozen=True)
class Machine:
    """What the run time sees: the facts a choice is made from."""

    os: str
    arch: str
    glibc: Optional[Version]
    driver_cuda: Optional[Version]
    gpus: Tuple[Version, ...]  # compute capabilities


@dataclass(frozen=True)
class Finding:
    level: str  # "stale": this machine would choose differently | "notice": a better build exists
    why: str

    def message(self, pip_reinstall: str, uv_reinstall: str) -> str:
        """The one line the loader says: what differs, then the cure, pip's and uv's (the reinstall
        commands are cudelta/_build_record.py's)."""
        cure = f"{CLEAR_PIP_CACHE} && {pip_reinstall} (uv: {CLEAR_UV_CACHE} && {uv_reinstall})"
        if self.level == "stale":
            return f"this install was chosen for another machine: {self.why}. Clear the cached wheel and reinstall: {cure}"
        return f"{self.why}; to switch: {cure}"


def describe_machine(driver: Optional[Version], gpus: Sequence[Version]) -> str:
    driver_text = f"driver CUDA {_fmt(driver)}" if driver else "no NVIDIA driver"
    gpu_text = ", ".join(f"{major}.{minor}" for major, minor in gpus)
    return driver_text + (f" and GPUs of compute {gpu_text}" if gpus else " and no GPU")


def uncovered(library: Mapping[str, Any], machine: Machine) -> Optional[str]:
    """Why `library` (a record's chosen/candidate entry) cannot run here, or None."""
    floor = _version(library["driver_floor"])
    if machine.driver_cuda is not None and floor is not None and machine.driver_cuda < floor:
        return (f"{library['name']} needs a driver for CUDA >= {library['driver_floor']} and this driver supports "
                f"CUDA {_fmt(machine.driver_cuda)}")
    images = runnable_images(library["archs"], library["ptx"], _version(library["cuda"]), machine.driver_cuda)
    for index, (major, minor) in enumerate(machine.gpus):
        if covering_arch(images, major, minor) is None:
            return (f"{library['name']} has no cubin or PTX for GPU {index} (compute {major}.{minor}); it holds "
                    f"{', '.join(list(library['archs']) + list(library['ptx']))}")
    return None


def _glibc_floor(platform: str) -> Optional[Version]:
    m = re.match(r"manylinux_(\d+)_(\d+)_", platform)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _platform_problem(record: Mapping[str, Any], machine: Machine) -> Optional[str]:
    made = record["machine"]
    if (made["os"], made["arch"]) != (machine.os, machine.arch):
        return f"it was chosen on {made['os']} {made['arch']} and this is {machine.os} {machine.arch}"
    chosen = record.get("chosen")
    floor = _glibc_floor(chosen["platform"]) if chosen else None
    if floor and machine.glibc and machine.glibc < floor:
        return f"{chosen['platform']} needs glibc >= {_fmt(floor)} and this system has glibc {_fmt(machine.glibc)}"
    return None


def stale(record: Mapping[str, Any], machine: Machine) -> Optional[Finding]:
    """What this machine would have chosen differently from the record, or None.

    A choice made from the very facts this machine shows stands (a deliberate override on this
    machine included); only a choice made elsewhere is judged, with the installer's own rules.
    """
    if record.get("schema") != SCHEMA:
        return None  # a record without facts cannot be judged
    problem = _platform_problem(record, machine)
    if problem:
        return Finding("stale", problem)
    made = record["machine"]
    made_gpus = tuple(sorted(_version(cc) for cc in made["gpus"]))
    if (_version(made["driver_cuda"]), made_gpus) == (machine.driver_cuda, tuple(sorted(machine.gpus))):
        return None
    made_on = describe_machine(_version(made["driver_cuda"]), [_version(cc) for cc in made["gpus"]])
    if made["override"]:
        made_on += f" ({made['override']})"
    if record["kind"] == "pure":
        if record["pure_because"] == "override" and machine.os == "linux" and machine.driver_cuda and machine.gpus:
            return Finding("stale", f"the pure-Python wheel (ops run the slow PyTorch reference) was chosen on a "
                                    f"machine with {made_on}, and this one has "
                                    f"{describe_machine(machine.driver_cuda, machine.gpus)}")
        return None
    chosen = record["chosen"]
    problem = uncovered(chosen, machine)
    if problem:
        return Finding("stale", f"{problem} (chosen on a machine with {made_on})")
    if record["kind"] != "prebuilt" or machine.driver_cuda is None:
        return None
    fitting = [c for c in record.get("candidates", []) if uncovered(c, machine) is None]
    key = lambda c: preference(_version(c["cuda"]), _version(c["driver_floor"]), True)  # noqa: E731
    best = max(fitting, key=key, default=None)
    if best is not None and key(best) > key(chosen):
        return Finding("notice", f"{chosen['name']} was chosen on a machine with {made_on}; this machine's "
                                 f"driver (CUDA {_fmt(machine.driver_cuda)}) runs the newer {best['name']}")
    return None


def library_facts(name: str, platform: str, cuda: str, driver_floor: str, archs: Iterable[str],
                  ptx: Iterable[str]) -> Dict[str, Any]:
    """A `chosen` / `candidates` entry."""
    return {"name": name, "platform": platform, "cuda": cuda, "driver_floor": driver_floor,
            "archs": list(archs), "ptx": list(ptx)}


def rejected_rows(record: Mapping[str, Any]) -> List[Tuple[str, str]]:
    return [(name, why) for name, why in record.get("rejected", [])]
