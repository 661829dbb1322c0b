"""Writing the install record (`cudelta_source.json` in the wheel's dist-info): what was chosen, from what.

Every wheel the sdist builds carries one, prebuilt, pure-Python or compiled here, so the installed
package can tell when it runs on a machine that would have chosen differently (a wheel served from
pip's or uv's cache, a Docker cache mount, a shared home). The schema, its one reader and the
staleness rule live in cudelta/_install_record.py, which this module loads by path; every record
written here goes through that reader first.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..core import cuda, shipped
from ..core.target import TargetEnv
from .manifest import Asset

reader = shipped.load("_install_record")
SCHEMA: int = reader.SCHEMA
FILENAME: str = reader.FILENAME


def machine_facts(target: TargetEnv) -> Dict[str, Any]:
    """What the choice was made from: the driver as seen (an override is named beside it)."""
    override = None
    if target.driver_override:
        override = f"CUDELTA_DRIVER_CUDA={target.driver_override}"
    return {
        "os": target.os_name,
        "arch": target.machine,
        "glibc": cuda.format_version(target.glibc) if target.glibc else None,
        "python": target.python_tag,
        "driver_cuda": cuda.format_version(target.driver_seen) if target.driver_seen else None,
        "gpus": [f"{g.major}.{g.minor}" for g in target.gpus],
        "torch": target.torch_version,
        "override": override,
    }


def _asset_facts(asset: Asset) -> Dict[str, Any]:
    return reader.library_facts(asset.name, asset.platform, asset.cuda, asset.driver_floor, asset.archs, asset.ptx)


def prebuilt(target: TargetEnv, choice, source: Mapping[str, str]) -> Dict[str, Any]:
    """The record of a verified release asset; `choice` is installer.choose.choose.Choice, `source` where
    it came from (asset, sha256, url, manifest)."""
    record = {
        "schema": SCHEMA, "kind": "prebuilt", "reason": choice.reason, "machine": machine_facts(target),
        "chosen": _asset_facts(choice.asset),
        "candidates": [_asset_facts(a) for a in choice.candidates],
        "rejected": [list(row) for row in choice.rejected],
        **source,
    }
    return reader.parse(record)


def pure(target: TargetEnv, reason: str) -> Dict[str, Any]:
    """The pure-Python wheel's record: chosen by the user (CUDELTA_DRIVER_CUDA=cpu) or by the platform."""
    because = "override" if target.driver_override and target.driver_override.cpu else "platform"
    return reader.parse({"schema": SCHEMA, "kind": "pure", "reason": reason, "machine": machine_facts(target),
                         "pure_because": because})


def local(target: TargetEnv, reason: str, build: Mapping[str, Any], platform: str) -> Dict[str, Any]:
    """A local compile's record; `build` is its build record (cudelta/_build_record.py)."""
    chosen = reader.library_facts("this machine's compile", platform, cuda.format_version(
        cuda.parse_version(build["cuda_toolkit"], patch_ok=True)), build["driver_floor"], build["archs"], build["ptx"])
    return reader.parse({"schema": SCHEMA, "kind": "local", "reason": reason, "machine": machine_facts(target),
                         "chosen": chosen})


def dumps(record: Mapping[str, Any]) -> str:
    return reader.dumps(record)

