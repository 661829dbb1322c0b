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

Parsing is pure (`parse_*`), the I/O sits in the `probe_*` / `find_*` functions, and `detect()`
is the one entry point.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

from .settings import Settings
from .target import PROBE, Gpu, TargetEnv

PROBE_TIMEOUT_S = 30.0  # a cold conda/NFS install can take seconds just to start Python
TOOL_TIMEOUT_S = 10.0
NVIDIA_SMI_TIMEOUT_S = 5.0

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CUDA_ERROR_NO_DEVICE = 100

# libc10 is small (MBs) and carries std::string in hundreds of exported signatures; the
# multi-GB libtorch_cpu is never read.
_LIBC10_READ_LIMIT = 64 << 20
_CXX11_MARKER = b"NSt7__cxx1112basic_string"

TORCH_UNSEEN = ("torch is not visible to this build (not installed yet, or outside what the build "
                "sees); it is reported only: the prebuilt wheel is chosen without it")


# --------------------------------------------------------------------------------------------
# Data seen by the probe


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


@dataclass(frozen=True)
class TorchFacts:
    version: Optional[str] = None
    cuda: Optional[str] = None
    cxx11_abi: Optional[bool] = None
    notes: Tuple[str, ...] = ()


@dataclass(frozen=True)
class DriverFacts:
    driver_cuda: Optional[Tuple[int, int]] = None
    gpus: Tuple[Gpu, ...] = ()
    notes: Tuple[str, ...] = ()
    # libcuda loaded but could not enumerate: worth asking nvidia-smi. Not set when there is
    # no driver, or when the driver answered "no device" (CUDA_VISIBLE_DEVICES may hide them).
    failed: bool = False


# --------------------------------------------------------------------------------------------
# Pure parsing


def normalise_os(platform: str) -> str:
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


def parse_glibc(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """os.confstr('CS_GNU_LIBC_VERSION'): 'glibc 2.36' -> (2, 36); musl and others -> None."""
    m = re.fullmatch(r"\s*glibc\s+(\d+)\.(\d+)\S*\s*", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


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


def parse_torch_version_py(text: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """torch/version.py -> (__version__, cuda, hip), read with ast: the file is never executed."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return (None, None, None)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and (value.value is None or isinstance(value.value, str)):
            for t in targets:
                if isinstance(t, ast.Name):
                    found[t.id] = value.value
    return (found.get("__version__"), found.get("cuda"), found.get("hip"))


def parse_torch_cmake_abi(text: str) -> Optional[bool]:
    """TorchConfig.cmake's TORCH_CXX_FLAGS carried -D_GLIBCXX_USE_CXX11_ABI=0/1 up to torch 2.6."""
    m = re.search(r"-D_GLIBCXX_USE_CXX11_ABI=([01])", text)
    return None if m is None else m.group(1) == "1"


def parse_libc10_abi(data: bytes) -> Optional[bool]:
    """libc10.so's symbols name std::__cxx11::basic_string only when built with the cxx11 ABI."""
    if not data.startswith(b"\x7fELF"):
        return None
    return _CXX11_MARKER in data


def cuda_from_local_label(version: str) -> Optional[str]:
    """'2.14.1+cu130' -> '13.0' (torch's wheel labels put the toolkit minor in the last digit)."""
    m = re.search(r"\+cu(\d+)(\d)$", version.strip())
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def parse_driver_version(value: int) -> Optional[Tuple[int, int]]:
    """cuDriverGetVersion: 1000 * major + 10 * minor, e.g. 13000 -> (13, 0), 12080 -> (12, 8)."""
    if value <= 0:
        return None
    return (value // 1000, (value % 1000) // 10)


def parse_nvcc_version(text: str) -> Optional[str]:
    """`nvcc --version` -> '13.0' from 'Cuda compilation tools, release 13.0, V13.0.88'."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def parse_compiler_version(text: str) -> Optional[str]:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line or None


def parse_nvidia_smi(text: str) -> Tuple[Gpu, ...]:
    """`nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader` -> GPUs.

    Names may contain commas, so index is the first field and compute_cap the last.
    """
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 3:
            continue
        m = re.fullmatch(r"(\d+)\.(\d+)", fields[-1])
        if not fields[0].isdigit() or not m:
            continue
        gpus.append(Gpu(int(fields[0]), ", ".join(fields[1:-1]), int(m.group(1)), int(m.group(2))))
    return tuple(gpus)


def torch_facts_from_files(
    version_py: Optional[str],
    dist_version: Optional[str],
    cmake_text: Optional[str],
    libc10_head: Optional[bytes],
) -> TorchFacts:
    """Combine what torch's files say; each fallback used is written into notes."""
    notes = []
    version, cuda, hip = parse_torch_version_py(version_py) if version_py else (None, None, None)
    if version is None and dist_version:
        version = dist_version
        cuda = cuda_from_local_label(dist_version)
        notes.append(
            f"torch/version.py unreadable; version {dist_version} from package metadata"
            + (f", CUDA {cuda} from its +cu label" if cuda else ", CUDA unknown")
        )
    if hip:
        notes.append(f"torch {version} is a ROCm build (HIP {hip}); no CUDA")
        cuda = None
    abi = parse_torch_cmake_abi(cmake_text) if cmake_text else None
    if abi is None and libc10_head:
        abi = parse_libc10_abi(libc10_head)
    return TorchFacts(version=version, cuda=cuda, cxx11_abi=abi, notes=tuple(notes))


# --------------------------------------------------------------------------------------------
# I/O: each function turns any failure into None / a note


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


def _read_text(path: Path, limit: int = 1 << 20) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def _read_bytes(path: Path, limit: int) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def read_torch(facts: InterpreterFacts) -> TorchFacts:
    if not facts.torch_dir:
        return TorchFacts()
    root = Path(facts.torch_dir)
    cmake = _read_text(root / "share" / "cmake" / "Torch" / "TorchConfig.cmake")
    libc10 = None
    if facts.os_name == "linux" and (cmake is None or parse_torch_cmake_abi(cmake) is None):
        libc10 = _read_bytes(root / "lib" / "libc10.so", _LIBC10_READ_LIMIT)
    return torch_facts_from_files(facts.torch_version_py, facts.torch_dist_version, cmake, libc10)


def _cuda_error_name(lib, code: int) -> str:
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return f"{code} {name.value.decode()}"
    except (AttributeError, OSError):
        pass
    return str(code)


def probe_driver(os_name: str) -> DriverFacts:
    """Driver CUDA version and GPUs from libcuda itself (honours CUDA_VISIBLE_DEVICES)."""
    libname = {"linux": "libcuda.so.1", "windows": "nvcuda.dll"}.get(os_name)
    if libname is None:
        return DriverFacts(notes=(f"no NVIDIA driver on {os_name}",))
    try:
        lib = ctypes.CDLL(libname)
    except OSError:
        return DriverFacts(notes=(f"no NVIDIA driver found ({libname})",))
    try:
        version = ctypes.c_int(0)
        rc = lib.cuDriverGetVersion(ctypes.byref(version))
        driver = parse_driver_version(version.value) if rc == 0 else None
        rc = lib.cuInit(0)
        if rc == CUDA_ERROR_NO_DEVICE:
            return DriverFacts(driver, (), ("the NVIDIA driver reports no visible GPU "
                                            "(CUDA_VISIBLE_DEVICES may hide them)",))
        if rc != 0:
            return DriverFacts(driver, (), (f"cuInit failed: CUDA error {_cuda_error_name(lib, rc)}",), failed=True)
        count = ctypes.c_int(0)
        rc = lib.cuDeviceGetCount(ctypes.byref(count))
        if rc != 0:
            return DriverFacts(driver, (), (f"cuDeviceGetCount failed: CUDA error {_cuda_error_name(lib, rc)}",), failed=True)
        gpus = []
        for ordinal in range(count.value):
            dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
            name = ctypes.create_string_buffer(256)
            rc = (lib.cuDeviceGet(ctypes.byref(dev), ordinal)
                  or lib.cuDeviceGetName(name, len(name), dev)
                  or lib.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
                  or lib.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
            if rc != 0:
                return DriverFacts(driver, (), (f"querying GPU {ordinal} failed: CUDA error {_cuda_error_name(lib, rc)}",), failed=True)
            gpus.append(Gpu(ordinal, name.value.decode("utf-8", "replace"), major.value, minor.value))
        return DriverFacts(driver, tuple(gpus))
    except (AttributeError, OSError) as e:  # a libcuda without these symbols is not a driver we know
        return DriverFacts(None, (), (f"{libname} is unusable ({e})",), failed=True)


def probe_nvidia_smi(path_env: Optional[str]) -> Tuple[Tuple[Gpu, ...], Optional[str]]:
    exe = shutil.which("nvidia-smi", path=path_env)
    if exe is None:
        return (), "nvidia-smi not found either"
    out, err = _run_tool([exe, "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
                         NVIDIA_SMI_TIMEOUT_S)
    if out is None:
        return (), err
    gpus = parse_nvidia_smi(out)
    return gpus, ("GPUs listed by nvidia-smi (it ignores CUDA_VISIBLE_DEVICES)" if gpus
                  else "nvidia-smi lists no GPU")


def _run_tool(argv: Sequence[str], timeout: float = TOOL_TIMEOUT_S) -> Tuple[Optional[str], Optional[str]]:
    try:
        proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(argv)}` did not answer within {timeout:g} s"
    except OSError as e:
        return None, f"`{argv[0]}` could not be run ({e.strerror or e})"
    if proc.returncode != 0:
        return None, f"`{' '.join(argv)}` exited with {proc.returncode}"
    return proc.stdout + proc.stderr, None


def find_nvcc(os_name: str, environ: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """The nvcc torch.utils.cpp_extension would use: CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda."""
    exe = "nvcc.exe" if os_name == "windows" else "nvcc"
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = environ.get(var)
        if home:
            candidate = Path(home) / "bin" / exe
            if candidate.is_file():
                return str(candidate), None
            # torch's build would use this CUDA_HOME too, so a different nvcc would mislead
            return None, f"{var}={home} has no bin/{exe}"
    found = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if found:
        return found, None
    fallback = Path("/usr/local/cuda/bin/nvcc")
    if os_name == "linux" and fallback.is_file():
        return str(fallback), None
    return None, "nvcc not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"


def probe_nvcc(os_name: str, environ: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    path, why = find_nvcc(os_name, environ)
    if path is None:
        return None, why
    out, err = _run_tool([path, "--version"])
    if out is None:
        return None, err
    version = parse_nvcc_version(out)
    return (version, None) if version else (None, f"{path} --version names no release")


def probe_host_compiler(environ: Mapping[str, str]) -> Tuple[Optional[str], Optional[str]]:
    cxx = environ.get("CXX", "").strip()
    try:
        argv = shlex.split(cxx) if cxx else ["c++"]  # CXX may be 'ccache g++'
    except ValueError:
        return None, f"CXX={cxx!r} cannot be split into a command"
    if not argv:
        return None, "CXX is empty"
    found = shutil.which(argv[0], path=environ.get("PATH", os.defpath))
    if found is None:
        return None, f"host compiler {argv[0]} not found" + (" (from CXX)" if cxx else "")
    out, err = _run_tool([found, *argv[1:], "--version"])
    if out is None:
        return None, err
    return parse_compiler_version(out), None


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


def _apply_driver_override(env: TargetEnv, driver_cuda: Optional[str]) -> TargetEnv:
    if driver_cuda is None:
        return env
    seen = f"{env.driver_cuda[0]}.{env.driver_cuda[1]}" if env.driver_cuda else "none"
    override = None if driver_cuda == "cpu" else tuple(int(x) for x in driver_cuda.split("."))
    note = f"driver CUDA {driver_cuda} set by CUDELTA_DRIVER_CUDA (the driver seen: {seen})"
    return replace(env, driver_cuda=override, driver_overridden=True, notes=env.notes + (note,))


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
