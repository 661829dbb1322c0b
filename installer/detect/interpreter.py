"""The interpreter cudelta is installed into, as its own probe reports it (`python -I -c PROBE`).

Pure parsing (`parse_*`, `normalise_*`) apart from running the probe (`run_probe`,
`probe_in_process`); the torch files it points at are read by torch_files.py.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Optional, Tuple

from ..core import shipped
from ..core.target import PROBE

_shared = shipped.load("_install_record")

PROBE_TIMEOUT_S = 30.0  # a cold conda/NFS install can take seconds just to start Python


@dataclass(frozen=True)
class InterpreterFacts:
    """One interpreter as its own probe reported it (before torch's files are read)."""

    python_version: Tuple[int, int]
    implementation: str
    abiflags: str
    free_threaded: bool
    executable: str
    prefix: str
    os_name: str
    machine: str
    glibc: Optional[Tuple[int, int]]
    torch_dir: Optional[str] = None
    torch_version_py: Optional[str] = None
    torch_dist_version: Optional[str] = None
    torch_error: Optional[str] = None
    torch_imported: bool = False


# Shared with the run time, which compares the machine it runs on with the install record's.
normalise_os = _shared.normalise_os
normalise_machine = _shared.normalise_machine
parse_glibc = _shared.parse_glibc


def parse_probe_json(text: str) -> InterpreterFacts:
    """The probe's stdout -> InterpreterFacts; ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"probe printed no JSON ({e}): {text[:200]!r}") from None
    if not isinstance(data, dict) or data.get("probe") != 1:
        raise ValueError(f"probe printed an unexpected document: {text[:200]!r}")
    try:
        major, minor = (int(x) for x in data["python_version"])
        os_name = normalise_os(str(data["platform"]))
        torch = data.get("torch") or {}
        if not isinstance(torch, dict):
            raise TypeError("torch is not an object")
        return InterpreterFacts(
            python_version=(major, minor),
            implementation=str(data["implementation"]),
            abiflags=str(data.get("abiflags") or ""),
            free_threaded=bool(data.get("gil_disabled")),
            executable=str(data.get("executable") or ""),
            prefix=str(data.get("prefix") or ""),
            os_name=os_name,
            machine=normalise_machine(os_name, str(data["machine"])),
            glibc=parse_glibc(data.get("glibc")),
            torch_dir=torch.get("dir"),
            torch_version_py=torch.get("version_py"),
            torch_dist_version=torch.get("dist_version"),
            torch_error=torch.get("error"),
            torch_imported=bool(data.get("torch_imported")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"probe output lacks {e}: {text[:200]!r}") from None


def run_probe(python: str, timeout: float = PROBE_TIMEOUT_S) -> Tuple[Optional[InterpreterFacts], Optional[str]]:
    """Run PROBE under `python -I`; (facts, None) or (None, why it failed)."""
    try:
        proc = subprocess.run(
            [python, "-I", "-c", PROBE],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"{python} -I did not answer within {timeout:g} s"
    except OSError as e:
        return None, f"{python} could not be run ({e.strerror or e})"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} -I exited with {proc.returncode}: {tail}"
    try:
        return parse_probe_json(proc.stdout), None
    except ValueError as e:
        return None, f"{python}: {e}"


def probe_in_process() -> InterpreterFacts:
    """This interpreter's own facts, when a child cannot be started (torch left unseen: the
    build env's sys.path is not the target's)."""
    namespace = {"__name__": "cudelta_probe"}
    exec(compile(PROBE, "<cudelta probe>", "exec"), namespace)  # our own constant, not a torch file
    return parse_probe_json(json.dumps(namespace["facts"](find_torch=False)))
