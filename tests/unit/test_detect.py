import json
import os
import stat
import sys
import time
import venv
from pathlib import Path

import pytest

from installer.core import cuda
from installer.core.settings import Settings
from installer.core.target import Gpu, TargetEnv
from installer.detect import detect as d
from installer.detect import driver, interpreter, toolchain, torch_files

# The base venv with torch 2.14.1+cu130 that the build and e2e tests make (tests/envs.py base_cu),
# when a previous run left it in the cache; this test does not make it.
CU_PYTHON = (Path(os.environ.get("CUDELTA_TEST_CACHE", Path(__file__).resolve().parents[2] / ".ci-cache"))
             / "venvs" / f"cu-py{sys.version_info.major}.{sys.version_info.minor}" / "bin" / "python")

VERSION_PY = """\
from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.14.1+cu130'
debug = False
cuda: Optional[str] = '13.0'
git_version = '5c4886908584029761b579af026dcfb627c84070'
hip: Optional[str] = None
"""

NVCC_OUT = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""


# --- pure parsing ----------------------------------------------------------------------------


def test_parse_driver_version():
    assert driver.parse_driver_version(13000) == (13, 0)
    assert driver.parse_driver_version(12080) == (12, 8)
    assert driver.parse_driver_version(13020) == (13, 2)
    assert driver.parse_driver_version(0) is None


def test_parse_nvcc_version():
    assert toolchain.parse_nvcc_version(NVCC_OUT) == "13.0"
    assert toolchain.parse_nvcc_version("Cuda compilation tools, release 12.8, V12.8.93") == "12.8"
    assert toolchain.parse_nvcc_version("command not found") is None


def test_parse_torch_version_py():
    assert torch_files.parse_torch_version_py(VERSION_PY) == ("2.14.1+cu130", "13.0", None)
    cpu = "__version__ = '2.14.1+cpu'\ncuda = None\nhip = None\n"
    assert torch_files.parse_torch_version_py(cpu) == ("2.14.1+cpu", None, None)
    rocm = "__version__ = '2.9.0+rocm6.4'\ncuda = None\nhip = '6.4.1'\n"
    assert torch_files.parse_torch_version_py(rocm) == ("2.9.0+rocm6.4", None, "6.4.1")
    assert torch_files.parse_torch_version_py("def (") == (None, None, None)


def test_parse_torch_version_py_never_executes():
    text = "raise SystemExit('executed')\n__version__ = '2.14.1'\ncuda = '13.0'\n"
    assert torch_files.parse_torch_version_py(text) == ("2.14.1", "13.0", None)


def test_parse_torch_cmake_abi():
    assert torch_files.parse_torch_cmake_abi('set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=1")') is True
    assert torch_files.parse_torch_cmake_abi('set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=0")') is False
    assert torch_files.parse_torch_cmake_abi("set(TORCH_INCLUDE_DIRS x)") is None


def test_parse_libc10_abi():
    assert torch_files.parse_libc10_abi(b"\x7fELF....._ZN3c10NSt7__cxx1112basic_stringIcE...") is True
    assert torch_files.parse_libc10_abi(b"\x7fELF....._ZN3c106detail4SsE...") is False
    assert torch_files.parse_libc10_abi(b"not an elf") is None


def test_parse_glibc():
    assert interpreter.parse_glibc("glibc 2.36") == (2, 36)
    assert interpreter.parse_glibc("glibc 2.17") == (2, 17)
    assert interpreter.parse_glibc(None) is None
    assert interpreter.parse_glibc("musl 1.2") is None


def test_cuda_from_local_label():
    assert torch_files.cuda_from_local_label("2.14.1+cu130") == "13.0"
    assert torch_files.cuda_from_local_label("2.8.0+cu128") == "12.8"
    assert torch_files.cuda_from_local_label("2.14.1+cpu") is None
    assert torch_files.cuda_from_local_label("2.14.1") is None


def test_parse_nvidia_smi():
    text = "0, NVIDIA H200, 9.0\n1, NVIDIA RTX PRO 6000 Blackwell, Server Edition, 12.0\n\nNo devices were found\n"
    assert driver.parse_nvidia_smi(text) == (
        Gpu(0, "NVIDIA H200", 9, 0),
        Gpu(1, "NVIDIA RTX PRO 6000 Blackwell, Server Edition", 12, 0),
    )
    assert driver.parse_nvidia_smi("") == ()


def test_normalise_os_and_machine():
    assert interpreter.normalise_os("linux") == "linux" and interpreter.normalise_os("win32") == "windows"
    assert interpreter.normalise_os("darwin") == "darwin"
    assert interpreter.normalise_machine("windows", "AMD64") == "x86_64"
    assert interpreter.normalise_machine("linux", "arm64") == "aarch64"
    assert interpreter.normalise_machine("darwin", "arm64") == "arm64"


def probe_doc(**changes):
    doc = {
        "probe": 1, "python_version": [3, 11], "implementation": "cpython", "abiflags": "",
        "gil_disabled": False, "executable": "/v/bin/python", "prefix": "/v", "platform": "linux",
        "machine": "x86_64", "glibc": "glibc 2.36",
        "torch": {"dir": "/v/lib/torch", "version_py": VERSION_PY, "dist_version": None},
        "torch_imported": False,
    }
    doc.update(changes)
    return json.dumps(doc)


def test_parse_probe_json():
    facts = interpreter.parse_probe_json(probe_doc())
    assert facts.python_version == (3, 11) and facts.glibc == (2, 36)
    assert facts.torch_dir == "/v/lib/torch" and not facts.free_threaded
    ft = interpreter.parse_probe_json(probe_doc(python_version=[3, 13], abiflags="t", gil_disabled=True, torch=None))
    assert ft.free_threaded and ft.abiflags == "t" and ft.torch_dir is None
    for bad, why in [("", "probe printed no JSON"), ("not json", "probe printed no JSON"),
                     (json.dumps({"probe": 2}), "probe printed an unexpected document"),
                     (probe_doc(python_version="3.11"), "probe output lacks")]:
        with pytest.raises(ValueError, match=why):
            interpreter.parse_probe_json(bad)


def test_torch_facts_from_files_fallbacks():
    facts = torch_files.torch_facts_from_files(VERSION_PY, None, None, b"\x7fELF NSt7__cxx1112basic_string")
    assert (facts.version, facts.cuda, facts.cxx11_abi) == ("2.14.1+cu130", "13.0", True)
    facts = torch_files.torch_facts_from_files(None, "2.8.0+cu128", '-D_GLIBCXX_USE_CXX11_ABI=0', None)
    assert (facts.version, facts.cuda, facts.cxx11_abi) == ("2.8.0+cu128", "12.8", False)
    assert "package metadata" in facts.notes[0]
    rocm = torch_files.torch_facts_from_files("__version__ = '2.9.0+rocm6.4'\ncuda = None\nhip = '6.4'\n", None, None, None)
    assert rocm.cuda is None and "ROCm" in rocm.notes[0]


def test_summary_is_one_line():
    env = TargetEnv(python_version=(3, 11), implementation="cpython", os_name="linux", machine="x86_64",
                    glibc=(2, 36), torch_version="2.14.1+cu130", torch_cuda="13.0", torch_cxx11_abi=True,
                    driver_cuda=(13, 0), gpus=(Gpu(0, "NVIDIA H200", 9, 0),), nvcc_version="13.0")
    assert env.summary() == ("CPython 3.11 linux x86_64 glibc 2.36; torch 2.14.1+cu130 (CUDA 13.0, cxx11 ABI); "
                             "driver CUDA 13.0; GPU 0 NVIDIA H200 (9.0); nvcc 13.0")


# --- I/O with fakes --------------------------------------------------------------------------


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _site_packages(root: Path) -> Path:
    return root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    """A fake target venv with a torch that must never be imported, and a plain one (a stand-in
    for uv's build venv)."""
    base = tmp_path_factory.mktemp("venvs")
    target, plain = base / "target", base / "plain"
    for root in (target, plain):
        venv.create(root, with_pip=False, symlinks=os.name != "nt")
    site = _site_packages(target)
    torch = site / "torch"
    (torch / "share" / "cmake" / "Torch").mkdir(parents=True)
    marker = base / "torch-was-imported"
    (torch / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('cudelta must not import torch')\n")
    (torch / "version.py").write_text(VERSION_PY)
    (torch / "share" / "cmake" / "Torch" / "TorchConfig.cmake").write_text(
        'set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=1")\n')
    dist = site / "torch-2.14.1+cu130.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.1+cu130\n")
    return {"target": target / "bin" / "python", "plain": plain / "bin" / "python", "marker": marker,
            "torch": torch, "target_root": target}


def _env(**extra):
    return {"PATH": os.environ.get("PATH", os.defpath), **extra}


def test_run_probe_sees_the_fake_torch_without_importing_it(venvs):
    facts, err = interpreter.run_probe(str(venvs["target"]))
    assert err is None
    assert facts.torch_dir == str(venvs["torch"]) and "__version__ = '2.14.1+cu130'" in facts.torch_version_py
    assert facts.python_version == tuple(sys.version_info[:2])
    assert not facts.torch_imported and not venvs["marker"].exists()


def test_detect_with_target_python_override(venvs):
    env = d.detect(Settings(target_python=venvs["target"]), environ=_env())
    assert env.torch_version == "2.14.1+cu130"
    assert env.torch_cuda == "13.0" and env.torch_cxx11_abi is True and env.driver_override is None
    assert env.python_version == tuple(sys.version_info[:2]) and env.implementation == "cpython"
    assert env.executable == str(venvs["target"])
    assert env.source == f"CUDELTA_TARGET_PYTHON {venvs['target']} (child python -I)"
    assert not any("not visible" in n for n in env.notes)
    assert not venvs["marker"].exists()


def test_detect_falls_back_to_dist_metadata(venvs, tmp_path):
    version_py = venvs["torch"] / "version.py"
    saved = version_py.read_text()
    version_py.unlink()
    try:
        env = d.detect(Settings(target_python=venvs["target"]), environ=_env())
    finally:
        version_py.write_text(saved)
    assert env.torch_version == "2.14.1+cu130" and env.torch_cuda == "13.0"
    assert any("package metadata" in n for n in env.notes)
    assert not venvs["marker"].exists()


def test_detect_build_interpreter_without_torch_notes_it(venvs):
    env = d.detect(Settings(), executable=str(venvs["plain"]), environ=_env())
    assert env.torch_version is None and env.torch_cuda is None
    assert env.source == f"target interpreter {venvs['plain']} (child python -I)"
    assert d.TORCH_UNSEEN in env.notes


def test_detect_uses_virtual_env_when_the_build_sees_no_torch(venvs):
    env = d.detect(Settings(), executable=str(venvs["plain"]),
                   environ=_env(VIRTUAL_ENV=str(venvs["target_root"])))
    assert env.torch_version == "2.14.1+cu130"
    assert env.source.startswith(f"VIRTUAL_ENV {venvs['target']}")
    assert d.TORCH_UNSEEN not in env.notes


def test_virtual_env_naming_the_build_venv_is_not_reprobed(venvs):
    # uv sets VIRTUAL_ENV to its own build venv: nothing new to see there.
    env = d.detect(Settings(), executable=str(venvs["plain"]),
                   environ=_env(VIRTUAL_ENV=str(venvs["plain"].parent.parent)))
    assert env.torch_version is None and d.TORCH_UNSEEN in env.notes
    assert env.source.startswith("target interpreter")


def test_virtual_env_of_another_python_is_not_used(venvs, tmp_path):
    other = tmp_path / "other"
    (other / "bin").mkdir(parents=True)
    doc = json.loads(json.dumps({
        "probe": 1, "python_version": [3, 99], "implementation": "cpython", "abiflags": "",
        "gil_disabled": False, "executable": str(other / "bin" / "python"), "prefix": str(other),
        "platform": "linux", "machine": "x86_64", "glibc": "glibc 2.36",
        "torch": {"dir": "/nowhere/torch", "version_py": VERSION_PY, "dist_version": None},
    }))
    _script(other / "bin" / "python", f"cat <<'EOF'\n{json.dumps(doc)}\nEOF\n")
    env = d.detect(Settings(), executable=str(venvs["plain"]), environ=_env(VIRTUAL_ENV=str(other)))
    assert env.torch_version is None
    assert any("Python 3.99" in n and "not used" in n for n in env.notes)


def test_driver_override_replaces_the_driver_and_leaves_torch_alone(venvs):
    env = d.detect(Settings(target_python=venvs["target"], driver_cuda=cuda.DriverOverride((12, 8))), environ=_env())
    assert env.driver_cuda == (12, 8) and env.driver_override == cuda.DriverOverride((12, 8))
    assert env.torch_cuda == "13.0"  # reported as seen
    assert any("CUDELTA_DRIVER_CUDA" in n for n in env.notes)
    cpu = d.detect(Settings(target_python=venvs["target"], driver_cuda=cuda.DriverOverride(None)), environ=_env())
    assert cpu.driver_cuda is None and cpu.driver_override.cpu


def test_broken_override_falls_back_with_a_note(tmp_path):
    broken = _script(tmp_path / "python", "echo boom >&2; exit 3\n")
    env = d.detect(Settings(target_python=broken), environ=_env())
    assert env.python_version == tuple(sys.version_info[:2])
    assert any(n.startswith("CUDELTA_TARGET_PYTHON:") and "boom" in n for n in env.notes)


def test_probe_timeout_is_a_note_not_an_exception(tmp_path):
    slow = _script(tmp_path / "python", "sleep 5\n")
    facts, err = interpreter.run_probe(str(slow), timeout=0.2)
    assert facts is None and "did not answer" in err
    facts, err = interpreter.run_probe(str(tmp_path / "missing"))
    assert facts is None and "could not be run" in err


def test_in_process_probe_matches_this_interpreter():
    facts = interpreter.probe_in_process()
    assert facts.python_version == tuple(sys.version_info[:2]) and facts.torch_dir is None


def test_nvcc_and_compiler_discovery(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "lib64").mkdir()
    (home / "lib64" / "libcudart.so").write_bytes(b"")
    _script(home / "bin" / "nvcc", "echo 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    none = str(tmp_path / "no-cuda")
    assert toolchain.probe_nvcc("linux", {"CUDA_HOME": str(home), "PATH": ""}, none) == ("12.8", None)
    assert toolchain.probe_nvcc("linux", {"CUDA_PATH": str(home), "PATH": ""}, none) == ("12.8", None)
    version, note = toolchain.probe_nvcc("linux", {"CUDA_HOME": str(tmp_path), "PATH": str(home / "bin")}, none)
    assert version is None and "has no bin/nvcc" in note
    assert toolchain.probe_nvcc("linux", {"PATH": str(home / "bin")}, none) == ("12.8", None)
    # A wrapper on PATH (no runtime beside it): the default root is what the compile uses, so
    # detection reports that one too.
    wrapper = tmp_path / "wrapper-bin"
    wrapper.mkdir()
    _script(wrapper / "nvcc", "echo 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    assert toolchain.find_cuda("linux", {"PATH": str(wrapper)}, str(home))[0] == toolchain.CudaToolkit(
        str(home / "bin" / "nvcc"), str(home))
    assert toolchain.probe_nvcc("linux", {"PATH": str(wrapper)}, str(home)) == ("12.8", None)
    assert toolchain.find_cuda("linux", {"PATH": str(wrapper)}, none)[0] == toolchain.CudaToolkit(
        str(wrapper / "nvcc"), None)

    cxx = _script(tmp_path / "g++-13", 'echo "g++-13 (GCC) 13.2.0 args: $*"\necho second line\n')
    assert toolchain.probe_host_compiler({"CXX": f"{cxx} -m64", "PATH": ""}) == ("g++-13 (GCC) 13.2.0 args: -m64 --version", None)
    compiler, note = toolchain.probe_host_compiler({"PATH": str(tmp_path / "empty")})
    assert compiler is None and "c++ not found" in note


def test_driver_probe_without_libcuda_is_a_note():
    facts = driver.probe_driver("darwin")
    assert facts.driver_cuda is None and facts.gpus == () and not facts.failed


@pytest.mark.e2e  # needs the torch 2.14.1+cu130 base venv (tests/envs.py), made once for the slow tests
def test_detect_real_torch_venv_is_fast():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import envs

    assert Path(envs.base_cu().python) == CU_PYTHON
    d.detect(Settings(target_python=CU_PYTHON))  # warm the page cache
    started = time.perf_counter()
    env = d.detect(Settings(target_python=CU_PYTHON))
    elapsed = time.perf_counter() - started
    assert (env.torch_version, env.torch_cuda, env.torch_cxx11_abi) == ("2.14.1+cu130", "13.0", True)
    assert elapsed < 0.5, f"detection took {elapsed:.3f} s"


def test_override_without_torch_says_so(venvs):
    env = d.detect(Settings(target_python=venvs["plain"]), environ=_env())
    assert env.torch_version is None
    assert f"CUDELTA_TARGET_PYTHON {venvs['plain']} has no torch installed" in env.notes
