"""The last line of an install that cannot succeed: what stopped it, and every way out that applies.

An install is at a dead end when no prebuilt wheel was used (the download failed, nothing
matches, FORCE_BUILD or CUDELTA_NO_BUILD) and this machine cannot compile either (no torch, a
torch without CUDA, no nvcc), or a compile started and failed. pip shows the build's last lines
and little else, so that line must say everything: the pure-Python wheel, a mirror, a compile
with what it lacks (installer/compile/local_build.compile_blockers), and the network cause. Pure: settings,
target and what happened in, text out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from .core.settings import Settings
from .core.target import TargetEnv

PURE = "CUDELTA_DRIVER_CUDA=cpu installs the pure-Python wheel (its ops run the PyTorch reference)"
_HOLDING = "holding this release's manifest.json and wheels"
MIRROR_URL = f"CUDELTA_WHEEL_URL=<an http(s) mirror or a file:// folder {_HOLDING}>"
MIRROR = f"{MIRROR_URL} installs from there (README: air-gapped installs)"
OFFLINE_MIRROR = f"CUDELTA_WHEEL_URL=file://<a folder {_HOLDING}> installs from there (README: air-gapped installs)"


@dataclass(frozen=True)
class NoPrebuilt:
    """Why no prebuilt wheel was installed."""

    why: str  # as the user reads it: 'download failed: could not download ...'
    cause: str  # "network" (a download or the manifest failed) | "no-match" | "not-tried" (FORCE_BUILD)


def _compile_needs(target: TargetEnv) -> str:
    """What a local compile needs, with what this target has instead."""
    if target.torch_version is None:
        torch = "a CUDA build of torch installed first"
    elif target.torch_cuda is None:
        torch = f"a CUDA build of torch (not {target.torch_version})"
    else:
        torch = f"torch {target.torch_version}"
    nvcc = f"nvcc {target.nvcc_version}" if target.nvcc_version else "nvcc (the CUDA toolkit, on PATH or CUDA_HOME)"
    return f"{torch} and {nvcc}"


def _offline_without_a_folder(settings: Settings) -> bool:
    """CUDELTA_OFFLINE=1 and the release URL is not a file:// folder: nothing was even tried."""
    return settings.offline and not (settings.wheel_url or "").startswith("file:")


def ways_out(settings: Settings, target: TargetEnv, missed: NoPrebuilt, blockers: Sequence[str],
             compile_failed: bool = False) -> List[str]:
    """Every way out that applies, most immediate first; the network cause last."""
    out = [PURE]
    if missed.cause == "not-tried":
        out.append(f"unset FORCE_BUILD to install the verified prebuilt wheel (where GitHub is out of reach, "
                   f"from a mirror: {MIRROR_URL})")
        if not compile_failed:
            out.append(f"install {_compile_needs(target)} for FORCE_BUILD's compile")
        return out
    if missed.cause == "network":
        out.append(OFFLINE_MIRROR if settings.offline else MIRROR)
    if compile_failed:
        pass  # the compile was the way; its own error, which leads the line, says what to fix
    elif settings.no_build and not blockers:
        out.append("unset CUDELTA_NO_BUILD to compile here")
    else:
        out.append(f"FORCE_BUILD=1 with {_compile_needs(target)} compiles here")
    if missed.cause == "network":
        out.append("or unset CUDELTA_OFFLINE to download" if _offline_without_a_folder(settings)
                   else f"or fix what stopped the download ({missed.why})")
    return out


def final_line(settings: Settings, target: TargetEnv, missed: NoPrebuilt, blockers: Sequence[str],
               compile_failure: Optional[str] = None) -> str:
    """The one line an install that cannot succeed ends with.

    `compile_failure`: the error of a compile that started (or whose toolchain check failed); it
    leads the line unchanged, as the troubleshooting table in RELEASING.md quotes it.
    """
    ways = "; ".join(ways_out(settings, target, missed, blockers, compile_failed=compile_failure is not None))
    if compile_failure is not None:
        return _one_line(f"{compile_failure.rstrip('.')}. Other ways out: {ways}.")
    if missed.cause == "not-tried":
        stopped = "FORCE_BUILD=1 skips the prebuilt wheel"
    elif missed.cause == "network":
        stopped = ("CUDELTA_OFFLINE=1 forbids downloading the prebuilt wheel" if _offline_without_a_folder(settings)
                   else "the prebuilt wheel could not be downloaded")
    else:
        stopped = f"no prebuilt wheel ({missed.why})"
    if settings.no_build and missed.cause != "not-tried":
        stopped += ", and CUDELTA_NO_BUILD=1 forbids compiling" + (f" ({'; '.join(blockers)})" if blockers else "")
    else:
        stopped += f", and this machine cannot compile ({'; '.join(blockers)})"
    return _one_line(f"cannot install cudelta: {stopped}. Ways out: {ways}.")


def _one_line(text: str) -> str:
    # A cause quoted from elsewhere (a server's reason, a compiler's error) may hold line breaks.
    return " ".join(text.split())
