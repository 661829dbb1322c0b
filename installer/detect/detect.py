"""Detect the target environment: the interpreter cudelta is installed into, its torch, the
NVIDIA driver and GPUs, nvcc and the host compiler.

The build runs inside an environment that is usually *not* the target (pip's isolated build env,
uv's build venv), so the target is seen through an explicit, ordered list of sources, overrides
first (as uv's torch-backend detection does):

  interpreter: CUDELTA_TARGET_PYTHON, then the build interpreter seen by a child `python -I`
               (which drops pip's PYTHONPATH overlay), then $VIRTUAL_ENV's python when the build
               interpreter shows no torch;
  torch:       torch/version.py of the interpreter above, reported only (often not installed
               yet: pip builds sdists before installing their dependencies);
  driver/GPUs: CUDELTA_DRIVER_CUDA, then libcuda.so.1 through ctypes in this process, then nvidia-smi.

torch is never imported (seconds, and it may initialise CUDA): its facts are read from files.
Nothing here raises for an unusual machine: what cannot be seen is None plus a line in `notes`.

Each source has its module (interpreter.py, torch_files.py, driver.py, toolchain.py), with the
parsing pure and the I/O in its `probe_*` / `find_*` functions; `detect()` here is the one entry
point and the one place that orders the sources.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Optional, Tuple

from ..core import cuda
from ..core.settings import Settings
from ..core.target import TargetEnv
from .driver import probe_driver, probe_nvidia_smi
from .interpreter import InterpreterFacts, normalise_os, probe_in_process, run_probe
from .toolchain import probe_host_compiler, probe_nvcc
from .torch_files import read_torch

TORCH_UNSEEN = ("torch is not visible to this build (not installed yet, or outside what the build "
                "sees); it is reported only: the prebuilt wheel is chosen without it")


# --------------------------------------------------------------------------------------------
# Choosing among what was seen


def _venv_python(venv: str, os_name: str) -> Path:
    return Path(venv) / ("Scripts/python.exe" if os_name == "windows" else "bin/python")


def _same_dir(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def _same_abi(a: InterpreterFacts, b: InterpreterFacts) -> bool:
    return (a.python_version, a.implementation, a.free_threaded) == (b.python_version, b.implementation, b.free_threaded)


def _select_interpreter(
    settings: Settings, executable: str, environ: Mapping[str, str],
    first: Tuple[Optional[InterpreterFacts], Optional[str]],
) -> Tuple[InterpreterFacts, str, list]:
    """Walk the ordered sources; `first` is the already-run probe of the first source."""
    notes = []
    if settings.target_python is not None:
        facts, err = first
        if facts is not None:
            return facts, f"CUDELTA_TARGET_PYTHON {settings.target_python} (child python -I)", notes
        notes.append(f"CUDELTA_TARGET_PYTHON: {err}; using the build interpreter")
        first = run_probe(executable)

    facts, err = first
    if facts is None:
        notes.append(f"child probe failed ({err}); torch unseen")
        return probe_in_process(), f"build interpreter {executable} (in-process)", notes
    source = f"target interpreter {executable} (child python -I)"
    if facts.torch_dir:
        return facts, source, notes

    venv = environ.get("VIRTUAL_ENV")
    if venv:
        venv_python = _venv_python(venv, facts.os_name)
        # Compared by prefix: venv pythons are symlinks to one base binary, so the files are
        # the same even when the environments differ.
        if venv_python.is_file() and not _same_dir(venv, facts.prefix):
            other, other_err = run_probe(str(venv_python))
            if other is None:
                notes.append(f"VIRTUAL_ENV: {other_err}")
            elif not other.torch_dir:
                pass
            elif not _same_abi(facts, other):
                notes.append(
                    f"VIRTUAL_ENV {venv} has torch but Python {other.python_version[0]}."
                    f"{other.python_version[1]}, not the build's {facts.python_version[0]}."
                    f"{facts.python_version[1]}; not used"
                )
            else:
                return other, (f"VIRTUAL_ENV {venv_python} (child python -I); the build "
                               f"interpreter {executable} shows no torch"), notes
    return facts, source, notes


def _apply_driver_override(env: TargetEnv, override: Optional[cuda.DriverOverride]) -> TargetEnv:
    if override is None:
        return env
    seen = cuda.format_version(env.driver_cuda) if env.driver_cuda else "none"
    note = f"driver CUDA {override} set by CUDELTA_DRIVER_CUDA (the driver seen: {seen})"
    return replace(env, driver_cuda=override.version, driver_override=override, overridden_driver_seen=env.driver_cuda,
                   notes=env.notes + (note,))


def detect(
    settings: Settings,
    *,
    executable: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> TargetEnv:
    """The target environment, never raising. `environ` is read only for VIRTUAL_ENV,
    CUDA_HOME, CUDA_PATH, CXX and PATH; configuration comes from `settings`."""
    executable = executable or sys.executable
    environ = os.environ if environ is None else environ
    first_python = str(settings.target_python) if settings.target_python is not None else executable
    os_guess = normalise_os(sys.platform)

    # The child probe and the tools run while libcuda initialises here: cuInit alone can take
    # most of the time budget on a multi-GPU host.
    with ThreadPoolExecutor(max_workers=3) as pool:
        probe_f = pool.submit(run_probe, first_python)
        nvcc_f = pool.submit(probe_nvcc, os_guess, environ)
        cxx_f = pool.submit(probe_host_compiler, environ)
        driver = probe_driver(os_guess)
        if driver.failed:
            gpus, why = probe_nvidia_smi(environ.get("PATH", os.defpath))
            driver = replace(driver, gpus=gpus, notes=driver.notes + ((why,) if why else ()))
        first = probe_f.result()
        nvcc_version, nvcc_note = nvcc_f.result()
        host_compiler, cxx_note = cxx_f.result()

    facts, source, notes = _select_interpreter(settings, executable, environ, first)
    torch = read_torch(facts)
    notes.extend(torch.notes)
    if facts.torch_error:
        notes.append(f"torch could not be located: {facts.torch_error}")
    if facts.torch_dir and torch.version is None:
        notes.append(f"torch at {facts.torch_dir} names no version (no readable version.py or metadata)")
    elif torch.version is None:
        if source.startswith("CUDELTA_TARGET_PYTHON"):
            notes.append(f"CUDELTA_TARGET_PYTHON {settings.target_python} has no torch installed")
        else:
            notes.append(TORCH_UNSEEN)
    notes.extend(driver.notes)
    notes.extend(n for n in (nvcc_note, cxx_note) if n)

    env = TargetEnv(
        python_version=facts.python_version,
        implementation=facts.implementation,
        os_name=facts.os_name,
        machine=facts.machine,
        executable=facts.executable,
        abiflags=facts.abiflags,
        free_threaded=facts.free_threaded,
        glibc=facts.glibc,
        torch_version=torch.version,
        torch_cuda=torch.cuda,
        torch_cxx11_abi=torch.cxx11_abi,
        driver_cuda=driver.driver_cuda,
        gpus=driver.gpus,
        nvcc_version=nvcc_version,
        host_compiler=host_compiler,
        source=source,
        notes=tuple(notes),
    )
    return _apply_driver_override(env, settings.driver_cuda)
