"""Choose the release asset for a target, or say in one line why there is none.

Pure: a Manifest and a TargetEnv in, a Choice out. The choice reads only what every build can
see, torch or no torch (pip builds sdists before it installs their dependencies): the platform
(OS, CPU arch, glibc), the Python, the driver's CUDA version and every GPU's compute capability.
The library carries its CUDA runtime, so torch's own CUDA flavour is not an input.

Each asset is checked against an ordered list of rules (Python, platform, driver, GPU coverage).
With a driver in sight, the newest toolkit build it runs wins; with none (image builds, CI), the
most compatible build, the one with the lowest driver floor. When nothing passes, the asset that
got furthest explains the refusal, since its failing rule is the one the user is closest to fixing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from packaging.tags import Tag, compatible_tags, cpython_tags, generic_tags
from packaging.version import InvalidVersion, Version

from ..core import cuda
from ..core.cuda import covering_arch, preference, runnable_images
from ..core.target import TargetEnv
from .manifest import Asset, Manifest

PURE_PYTHON_TAIL = "installing the pure-Python wheel (ops run the PyTorch reference path)"


@dataclass(frozen=True)
class AssetVerdict:
    """One row of the table CUDELTA_EXPLAIN prints and the install record keeps."""

    asset: Asset
    status: str  # "chosen" | "fits" (matches, not preferred) | "rejected"
    reason: str  # how it matched, or the rule it failed
    installable: bool  # this platform and Python can install it (the driver and GPUs aside)


@dataclass(frozen=True)
class Choice:
    asset: Optional[Asset]
    reason: str  # one line, shown to the user as is
    # No CUDA to match at all (CPU torch, macOS, CUDELTA_CUDA_VERSION=cpu): the build should
    # produce the pure-Python wheel, not compile.
    pure_python: bool = False
    # Every asset of the package version, with its verdict (empty where no asset was looked at).
    verdicts: Tuple[AssetVerdict, ...] = ()

    @property
    def rejected(self) -> List[Tuple[str, str]]:
        """(asset name, why not) for every asset not chosen."""
        return [(v.asset.name, v.reason) for v in self.verdicts if v.status != "chosen"]

    @property
    def candidates(self) -> Tuple[Asset, ...]:
        """The assets this platform and Python can install: what another machine of it may get."""
        return tuple(v.asset for v in self.verdicts if v.installable)

    def table(self) -> List[str]:
        """CUDELTA_EXPLAIN's lines: one per asset, its verdict and why."""
        return [f"{v.status:8s} {v.asset.name}: {v.reason}" for v in self.verdicts]


# --------------------------------------------------------------------------------------------
# Platform and Python tags


_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def linux_platforms(machine: str, glibc: Optional[Tuple[int, int]]) -> List[str]:
    """Platform tags a glibc Linux accepts, most specific first (as packaging.tags orders them,
    but for the target's glibc rather than this process's)."""
    platforms = []
    if glibc is not None and glibc[0] == 2:
        # manylinux_2_5 exists only for x86; other arches start at manylinux2014 (glibc 2.17).
        floor = 5 if machine in ("x86_64", "i686") else 17
        for minor in range(glibc[1], floor - 1, -1):
            platforms.append(f"manylinux_2_{minor}_{machine}")
            legacy = _LEGACY_MANYLINUX.get(minor)
            if legacy and (minor == 17 or machine in ("x86_64", "i686")):
                platforms.append(f"{legacy}_{machine}")
    platforms.append(f"linux_{machine}")
    return platforms


def target_platforms(target: TargetEnv) -> List[str]:
    if target.os_name == "linux":
        return linux_platforms(target.machine, target.glibc)
    if target.os_name == "windows":
        return [{"x86_64": "win_amd64", "arm64": "win_arm64", "x86": "win32"}.get(target.machine, f"win_{target.machine}")]
    # cudelta publishes no wheels for other systems (and chooses pure-Python there); a tag
    # that matches nothing keeps the platform rule honest.
    return [f"{target.os_name}_{target.machine}"]


def target_tags(target: TargetEnv) -> List[Tag]:
    """Wheel tags the target interpreter accepts, in preference order."""
    platforms = target_platforms(target)
    version = target.python_version
    nodot = f"{version[0]}{version[1]}"
    if target.implementation == "cpython":
        abi = f"cp{nodot}{target.abiflags}"
        if target.free_threaded and not abi.endswith("t"):
            abi += "t"
        tags = list(cpython_tags(python_version=version, abis=[abi], platforms=platforms))
        interpreter = f"cp{nodot}"
    else:
        short = {"pypy": "pp"}.get(target.implementation, target.implementation)
        interpreter = f"{short}{nodot}"
        tags = list(generic_tags(interpreter=interpreter, abis=["none"], platforms=platforms))
    tags += list(compatible_tags(python_version=version, interpreter=interpreter, platforms=platforms))
    if target.free_threaded:
        # The stable ABI does not exist for free-threaded builds before abi3t; older packaging
        # releases still list abi3 for them.
        tags = [t for t in tags if t.abi != "abi3"]
    return tags


# --------------------------------------------------------------------------------------------
# The rules


@dataclass(frozen=True)
class _Context:
    target: TargetEnv
    release: str
    assets: Tuple[Asset, ...]  # of the package version
    tag_rank: Dict[Tag, int]


@dataclass(frozen=True)
class _Verdict:
    asset: Asset
    stage: int  # rules passed; len(_RULES) for a match
    reason: str  # why refused, or how each rule was met
    tag_rank: int = 0


def _python_label(target: TargetEnv) -> str:
    impl = {"cpython": "Python", "pypy": "PyPy"}.get(target.implementation, target.implementation)
    return f"{impl} {target.python_tag}"


def _rule_python(asset: Asset, ctx: _Context) -> Tuple[Optional[str], str]:
    t = ctx.target
    if t.python_version < asset.python_floor_tuple:
        return f"{_python_label(t)} is older than {asset.python_floor}, the floor of {asset.name}", ""
    if t.free_threaded and all(tag.abi == "abi3" for tag in asset.tags):
        return f"{_python_label(t)} is free-threaded and cannot load the abi3 wheel {asset.name}", ""
    return None, ""


def _rule_platform(asset: Asset, ctx: _Context) -> Tuple[Optional[str], str]:
    ranks = [ctx.tag_rank[tag] for tag in asset.tags if tag in ctx.tag_rank]
    if ranks:
        return None, target_platforms(ctx.target)[0]
    t = ctx.target
    accepted = set(target_platforms(t))
    if any(tag.platform in accepted for tag in asset.tags):
        shown = ", ".join(sorted(f"{tag.interpreter}-{tag.abi}" for tag in asset.tags))
        return f"{asset.name} ({shown}) does not fit {_python_label(t)} ({t.implementation})", ""
    platform = asset.platform
    if t.os_name == "linux" and platform.startswith("manylinux_2_") and platform.endswith("_" + t.machine):
        need = platform[len("manylinux_2_"):].split("_", 1)[0]
        have = f"glibc {cuda.format_version(t.glibc)}" if t.glibc else "no glibc (musl?)"
        return f"{platform} needs glibc >= 2.{need}; this system has {have}", ""
    system = f"{t.os_name} {t.machine}" + (f" glibc {cuda.format_version(t.glibc)}" if t.glibc else "")
    have = ", ".join(sorted({a.platform for a in ctx.assets}))
    return f"no prebuilt wheel for {system}: release {ctx.release} has {have} only", ""


def _driver_desc(target: TargetEnv) -> str:
    assert target.driver_cuda is not None
    by = " by CUDELTA_DRIVER_CUDA" if target.driver_override else ""
    return f"driver CUDA {cuda.format_version(target.driver_cuda)}{by}"


def _rule_driver(asset: Asset, ctx: _Context) -> Tuple[Optional[str], str]:
    driver = ctx.target.driver_cuda
    if driver is None:
        return None, f"no driver visible, {asset.name} runs on drivers for CUDA >= {asset.driver_floor}"
    if driver >= asset.driver_floor_tuple:
        return None, _driver_desc(ctx.target)
    return (f"the NVIDIA driver supports CUDA {cuda.format_version(driver)}, older than the {asset.driver_floor} "
            f"that {asset.name} needs (update the driver)"), ""


def _rule_gpus(asset: Asset, ctx: _Context) -> Tuple[Optional[str], str]:
    gpus = ctx.target.gpus
    if not gpus:
        return None, f"no GPU visible, the fat binary covers {asset.describe_archs()}"
    images = runnable_images(asset.archs, asset.ptx, asset.cuda_tuple, ctx.target.driver_cuda)
    groups: Dict[Tuple[str, str], List[int]] = {}
    for gpu in gpus:
        arch = covering_arch(images, gpu.major, gpu.minor)
        if arch is None:
            jit = (f"; its PTX needs a driver for CUDA >= {asset.cuda}"
                   if asset.ptx and covering_arch(asset.ptx, gpu.major, gpu.minor) else "")
            return (f"GPU {gpu.index} (compute {gpu.major}.{gpu.minor}) has no cubin or PTX in "
                    f"{asset.name}: release archs {asset.describe_archs()}{jit}"), ""
        how = f"{arch} cubin" if arch.startswith("sm_") else f"{arch} PTX (JIT)"
        groups.setdefault((gpu.sm, how), []).append(gpu.index)
    return None, ", ".join(
        f"GPU {','.join(map(str, indices))} {sm} via {how}" for (sm, how), indices in groups.items()
    )


_RULES = (_rule_python, _rule_platform, _rule_driver, _rule_gpus)


def _evaluate(asset: Asset, ctx: _Context) -> _Verdict:
    met = []
    for stage, rule in enumerate(_RULES):
        refusal, how = rule(asset, ctx)
        if refusal is not None:
            return _Verdict(asset, stage, refusal)
        met.append(how)
    # Order of the success line: what was matched, then the machine.
    _, platform, driver, gpus = met
    rank = min(ctx.tag_rank[tag] for tag in asset.tags if tag in ctx.tag_rank)
    return _Verdict(asset, len(_RULES), f"{asset.name} matches: {driver}, {gpus}, {platform}", rank)


# --------------------------------------------------------------------------------------------
# Entry point


def pure_python_reason(target: TargetEnv) -> Optional[str]:
    """Why the target gets no native code at all, or None. The one place this is decided."""
    if target.os_name != "linux":
        return f"{target.os_name} has no CUDA build of cudelta: {PURE_PYTHON_TAIL}"
    if target.driver_override and target.driver_override.cpu:
        return f"CUDELTA_DRIVER_CUDA={target.driver_override}: {PURE_PYTHON_TAIL}"
    return None


def _best(matches: List[_Verdict], driver_seen: bool) -> _Verdict:
    # With a driver, the newest toolkit it runs; with none, the build that runs on the most drivers
    # (the rule the run time's staleness check shares, cudelta/_install_record.py).
    return max(matches, key=lambda v: (preference(v.asset.cuda_tuple, v.asset.driver_floor_tuple, driver_seen),
                                       -v.tag_rank))


_INSTALLABLE_STAGE = 2  # python and platform rules passed


def _row_reason(v: _Verdict, best: Optional[_Verdict], ctx: _Context) -> str:
    """The table's reason for one asset (the refusal lines speak for the release as a whole)."""
    if v is best:
        return v.reason[len(v.asset.name) + 1:]  # 'matches: ...'
    if v.stage == len(_RULES):
        if ctx.target.driver_cuda is not None:
            return f"matches too; {best.asset.name} comes first (the newest toolkit this driver runs)"
        return (f"matches too; with no driver visible {best.asset.name} comes first "
                f"(driver floor {best.asset.driver_floor}, the lowest, then the newest toolkit)")
    if v.reason.startswith("no prebuilt wheel for "):
        return f"built for {v.asset.platform}, not {target_platforms(ctx.target)[0]}"
    return v.reason


def _table(verdicts: List[_Verdict], best: Optional[_Verdict], ctx: _Context) -> Tuple[AssetVerdict, ...]:
    statuses = {len(_RULES): "fits"}
    return tuple(
        AssetVerdict(v.asset, "chosen" if v is best else statuses.get(v.stage, "rejected"), _row_reason(v, best, ctx),
                     installable=v.stage >= _INSTALLABLE_STAGE)
        for v in verdicts)


def choose(manifest: Manifest, target: TargetEnv, package_version: str) -> Choice:
    pure = pure_python_reason(target)
    if pure is not None:
        return Choice(None, pure, pure_python=True)
    try:
        wanted = Version(package_version)
    except InvalidVersion:
        return Choice(None, f"cudelta version {package_version!r} is not a version; no prebuilt wheel")
    assets = tuple(a for a in manifest.assets if Version(a.public_version) == Version(wanted.public))
    if not assets:
        return Choice(None, f"release {manifest.version} lists no prebuilt wheel of cudelta {wanted.public}")
    if not any(a.platform.endswith("_" + target.machine) for a in assets):
        # No CUDA build exists for this CPU at all: a compile would be the first of its kind.
        return Choice(None, f"release {manifest.version} has no CUDA build for {target.machine}: "
                      f"{PURE_PYTHON_TAIL}", pure_python=True)

    tags = target_tags(target)
    ctx = _Context(target=target, release=manifest.version, assets=assets,
                   tag_rank={tag: i for i, tag in reversed(list(enumerate(tags)))})
    verdicts = [_evaluate(asset, ctx) for asset in assets]
    matches = [v for v in verdicts if v.stage == len(_RULES)]
    driver_seen = target.driver_cuda is not None
    if matches:
        best = _best(matches, driver_seen)
        reason = best.reason
        if not driver_seen:
            reason = ("no NVIDIA driver visible, so the most compatible build (CUDELTA_DRIVER_CUDA=<version> "
                      "chooses for a given driver): " + reason)
        return Choice(best.asset, reason, verdicts=_table(verdicts, best, ctx))
    # Furthest along; among those, one for this CPU, then the highest toolkit (the one an upgrade
    # would reach).
    closest = max(verdicts, key=lambda v: (v.stage, v.asset.platform.endswith("_" + target.machine),
                                           v.asset.cuda_tuple))
    return Choice(None, closest.reason, verdicts=_table(verdicts, None, ctx))
