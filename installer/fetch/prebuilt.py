"""The fetch path: the trusted manifest, the choice, the download and its check, the retagged wheel.

`install_prebuilt` puts a verified prebuilt wheel, renamed to the sdist's version (pip insists),
into the dist folder; or says that the pure-Python wheel is the answer; or says why there is
none, which the caller turns into a compile (or an error under CUDELTA_NO_BUILD).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from ..choose import install_record
from ..choose.choose import choose
from ..choose.manifest import Manifest, loads_manifest, parse_manifest
from ..core import shipped
from ..core.errors import FetchError, VerificationError
from ..core.log import say
from ..core.settings import Settings
from ..core.target import TargetEnv
from ..core.wheel_version import public_version, retag_version
from .fetch import Fetcher
from .urls import asset_url, display_url

MANIFEST_NAME = "manifest.json"
# Beside the installer's sources in the sdist (commands.sdist writes it; release/assemble_release.py checks it).
EMBEDDED_MANIFEST = shipped.SOURCE_ROOT / "installer" / "release_manifest.json"


@dataclass(frozen=True)
class Outcome:
    kind: str  # "installed" | "pure" (build the pure-Python wheel) | "none"
    why_not: Optional[str] = None  # for "none": why no prebuilt wheel was used
    cause: str = ""  # for "none": "network" (the manifest or the download failed) | "no-match"
    reason: str = ""  # the choice's line (the pure wheel's install record keeps it)


def trusted_manifest(settings: Settings, fetcher: Fetcher, base: str) -> Tuple[Manifest, str]:
    """The manifest downloads are verified against, and which one it is (said in the log).

    The release's sdist embeds it: PyPI served and hashed that file, so a replaced GitHub asset
    or a hostile mirror cannot pass. A downloaded one is trusted only where there is no embedded
    one (a git checkout) or the user opts in for a private mirror of their own builds.
    """
    if EMBEDDED_MANIFEST.is_file() and not settings.trust_downloaded_manifest:
        manifest = loads_manifest(EMBEDDED_MANIFEST.read_text())
        say(f"trusting the release manifest embedded in this sdist (release {manifest.version}, "
            f"{len(manifest.assets)} assets)")
        return manifest, "manifest embedded in the sdist"
    why = ("CUDELTA_TRUST_DOWNLOADED_MANIFEST=1" if EMBEDDED_MANIFEST.is_file()
           else "no manifest embedded in this source tree")
    manifest = parse_manifest(fetcher.fetch_json(base, MANIFEST_NAME))
    say(f"trusting {MANIFEST_NAME} downloaded from the release URL ({why})")
    return manifest, f"{MANIFEST_NAME} downloaded from the release URL"


def install_prebuilt(settings: Settings, target: TargetEnv, version: str, dist_dir: Path) -> Outcome:
    base = settings.release_url(version)
    fetcher = Fetcher(settings)
    try:
        manifest, trusted = trusted_manifest(settings, fetcher, base)
    except FetchError as exc:
        return Outcome("none", f"release manifest unavailable: {exc}", "network")
    choice = choose(manifest, target, version)
    if settings.explain:
        say(f"CUDELTA_EXPLAIN: {len(choice.verdicts)} asset(s) of release {manifest.version} for {target.summary()}")
        for line in choice.table() or ["(no asset looked at)"]:
            say("  " + line)
    say(choice.reason)
    if choice.pure_python:
        return Outcome("pure", reason=choice.reason)
    if choice.asset is None:
        return Outcome("none", f"no asset matches: {choice.reason}", "no-match")
    asset = choice.asset
    try:
        path = fetcher.fetch_asset(base, asset.name, asset.sha256, asset.size)
    except VerificationError:
        raise  # a corrupt or tampered asset is an error, never a reason to quietly compile
    except FetchError as exc:
        return Outcome("none", f"download failed: {exc}", "network")
    source = {"asset": asset.name, "sha256": asset.sha256, "url": display_url(asset_url(base, asset.name)),
              "manifest": trusted}
    record = install_record.prebuilt(target, choice, source)
    out = retag_version(Path(path), public_version(version), dist_dir, extra_dist_info=record)
    say(f"installing prebuilt {asset.name} (sha256 verified against the {trusted}) as {out.name}")
    return Outcome("installed")
