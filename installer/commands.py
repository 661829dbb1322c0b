"""setuptools commands: `bdist_wheel` runs detect -> choose -> fetch -> verify -> install, else build.

pip's build_wheel hook and the release matrix both end up here. What happens is decided once,
up front (`Plan`), and said in one line; every user-facing failure is an InstallerError, printed
without a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from setuptools import Extension
from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
from setuptools.command.sdist import sdist as _sdist

from . import native, platform_tag
from .errors import InstallerError, VerificationError
from .log import say
from .settings import Settings
from .wheel_version import public_version, retag_version, with_local_label

MANIFEST_NAME = "manifest.json"
RELEASE_PLATFORM = "manylinux_2_28_x86_64"


@dataclass(frozen=True)
class Plan:
    kind: str  # "pure" | "fetch" | "compile"
    reason: str


def plan_for(settings: Settings, target) -> Plan:
    """The first decision: no native code at all, try a prebuilt wheel, or compile."""
    from .choose import pure_python_reason

    pure = pure_python_reason(target)
    if pure is not None:
        return Plan("pure", pure)
    if settings.release_build:
        return Plan("compile", "CUDELTA_RELEASE_BUILD=1: compiling the release fat binary")
    if settings.force_build:
        return Plan("compile", "FORCE_BUILD=1: compiling locally, no download")
    return Plan("fetch", "looking for a prebuilt wheel")


def torch_importable_here() -> bool:
    # Under pip's build isolation the target's site-packages are hidden from this process.
    return importlib.util.find_spec("torch") is not None


def compile_archs(settings: Settings, target) -> tuple[list[str], str]:
    if settings.cuda_archs:
        return list(settings.cuda_archs), "from CUDELTA_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST"
    if settings.release_build:
        return list(native.RELEASE_ARCHS), "release archs"
    if target.gpus:
        return native.archs_for_gpus([(g.major, g.minor) for g in target.gpus]), "the GPUs present"
    return list(native.RELEASE_ARCHS), "no GPU visible, so all release archs (set TORCH_CUDA_ARCH_LIST to build fewer)"


class bdist_wheel(_bdist_wheel):
    user_options = _bdist_wheel.user_options + [
        ("compile-here", None, "internal: compile in this process (the target's torch is importable)"),
    ]
    boolean_options = _bdist_wheel.boolean_options + ["compile-here"]

    def initialize_options(self) -> None:
        super().initialize_options()
        self.compile_here = False
        self._plan: Optional[Plan] = None

    def finalize_options(self) -> None:
        try:
            self._settings = Settings.from_env()
            self._target = _detect(self._settings)
            self._plan = Plan("compile", "compiling") if self.compile_here else plan_for(self._settings, self._target)
        except InstallerError as exc:
            _fail(exc)
        if self._plan.kind == "pure":
            self.distribution.ext_modules = []
        else:
            # A placeholder keeps the wheel platform-specific; the real CUDAExtension replaces it
            # only if we compile in this process (it needs torch).
            self.distribution.ext_modules = [Extension("cudelta._C", sources=[])]
            self.py_limited_api = native.PY_LIMITED_API_TAG
            if self._settings.release_build:
                self.plat_name = RELEASE_PLATFORM
        super().finalize_options()

    def run(self) -> None:
        try:
            self._run()
        except InstallerError as exc:
            _fail(exc)

    def _run(self) -> None:
        plan = self._plan
        assert plan is not None
        if not self.compile_here:
            say(f"target: {self._target.summary()}")
            for note in self._target.notes:
                say(f"note: {note}")
        if plan.kind == "pure":
            say(plan.reason)
            super().run()
            return
        if plan.kind == "fetch":
            why_not = self._try_prebuilt()
            if why_not is None:
                return
            if self._settings.no_build:
                raise InstallerError(f"no prebuilt wheel: {why_not}. CUDELTA_NO_BUILD=1 forbids compiling; "
                                     "unset it to build from source.")
            say(f"no prebuilt wheel ({why_not}): building from source")
        elif not self.compile_here:
            say(plan.reason)
        if torch_importable_here():
            self._compile()
        else:
            self._compile_in_target_interpreter()

    # --- fetch path ---------------------------------------------------------------------------
    def _try_prebuilt(self) -> Optional[str]:
        """Install a verified prebuilt wheel (or the pure-Python one) into dist_dir; or return why
        none was used."""
        from .choose import choose
        from .errors import FetchError
        from .fetch import Fetcher, asset_url, display_url

        version = self.distribution.get_version()
        base = self._settings.release_url(version)
        fetcher = Fetcher(self._settings)
        try:
            manifest, trusted = _trusted_manifest(self._settings, fetcher, base)
        except FetchError as exc:
            return f"release manifest unavailable: {exc}"
        choice = choose(manifest, self._target, version)
        say(choice.reason)
        if choice.pure_python:
            self._become_pure()
            super().run()
            return None
        if choice.asset is None:
            return "no asset matches"
        asset = choice.asset
        try:
            path = fetcher.fetch_asset(base, asset.name, asset.sha256, asset.size)
        except VerificationError:
            raise  # a corrupt or tampered asset is an error, never a reason to quietly compile
        except FetchError as exc:
            return f"download failed: {exc}"
        source = {"asset": asset.name, "sha256": asset.sha256, "url": display_url(asset_url(base, asset.name)),
                  "manifest": trusted}
        out = retag_version(Path(path), public_version(version), Path(self.dist_dir), extra_dist_info=source)
        say(f"installing prebuilt {asset.name} (sha256 verified against the {trusted}) as {out.name}")
        return None

    def _become_pure(self) -> None:
        """No CUDA build exists for this platform: the same wheel as a CPU-only system gets."""
        self.distribution.ext_modules = []
        self.root_is_pure = True
        self.py_limited_api = False
        self.plat_name_supplied = False

    # --- compile path -------------------------------------------------------------------------
    def _compile(self) -> None:
        home = native.cuda_home()
        if home and "CUDA_HOME" not in os.environ:
            os.environ["CUDA_HOME"] = home  # read when torch.utils.cpp_extension is imported
        import torch.utils.cpp_extension as cpp

        from .detect import probe_nvcc

        settings, target = self._settings, self._target
        archs_text, why = compile_archs(settings, target)
        archs = native.parse_archs(archs_text)
        torch_cuda = cpp.torch.version.cuda
        if torch_cuda is None:
            raise InstallerError(f"torch {cpp.torch.__version__} has no CUDA; cannot compile the CUDA extension")
        # Check the nvcc this build will run (the CUDA_HOME just chosen), which need not be the
        # one detection found first on PATH.
        nvcc_version, _why = probe_nvcc(target.os_name, os.environ)
        native.check_toolchain(torch_cuda, nvcc_version, native.gcc_major_of(target.host_compiler))
        jobs = settings.max_jobs or native.default_jobs(os.cpu_count() or 1, native.mem_available_bytes())
        os.environ["MAX_JOBS"] = str(jobs)  # read by torch's BuildExtension for ninja -j
        toolkit = nvcc_version or torch_cuda
        record = native.build_record(
            version=self.distribution.get_version(), toolkit=toolkit, archs=archs,
            torch_version=cpp.torch.__version__, kind="release" if settings.release_build else "local",
            compressed=True)
        header_dir = Path(self.bdist_dir).resolve().parent / "cudelta-generated"
        native.write_build_info(record, header_dir)
        self.distribution.ext_modules[:] = [native.extension(archs, compress=True, jobs=jobs, header_dir=header_dir)]
        self.distribution.cmdclass["build_ext"] = _build_ext_class(cpp.BuildExtension, record)
        self.distribution.command_obj.pop("build_ext", None)
        names = ", ".join(record["archs"] + record["ptx"])
        say(f"compiling for {names} ({why}) with {jobs} job(s), nvcc {toolkit}, torch {cpp.torch.__version__}; "
            f"about 10 s per arch on 2 cores")
        started = time.monotonic()
        super().run()
        say(f"compiled in {time.monotonic() - started:.0f} s")
        if settings.release_build:
            self._label_release_wheel(record["variant"])

    def _label_release_wheel(self, variant: str) -> None:
        """Add the +cuXYZ label, and the manylinux tag the library's glibc needs allow."""
        dist = Path(self.dist_dir)
        version = self.distribution.get_version()
        build_lib = Path(self.get_finalized_command("build_ext").build_lib)
        libraries = list((build_lib / "cudelta").glob("_C*.so"))
        glibc = platform_tag.required_glibc(libraries)
        platform = platform_tag.manylinux_tag(glibc, "x86_64") if glibc else None
        if platform != RELEASE_PLATFORM:
            say(f"the library needs glibc {glibc[0]}.{glibc[1]}: tagged {platform}, not {RELEASE_PLATFORM}; "
                "build in a manylinux_2_28 image for the wider tag" if glibc else
                "objdump not found: cannot check the glibc the library needs; keeping " + RELEASE_PLATFORM)
        for wheel in dist.glob(f"cudelta-{version}-*.whl"):
            labelled = retag_version(wheel, with_local_label(version, variant), dist, platform=platform)
            wheel.unlink()
            say(f"release wheel: {labelled.name}")

    def _compile_in_target_interpreter(self) -> None:
        """pip's isolation hides torch from us; compile in a child of the same interpreter that sees
        the target's site-packages plus our build requirements."""
        env = _unisolated_env()
        with tempfile.TemporaryDirectory(prefix="cudelta-build-") as tmp:
            cmd = [sys.executable, "setup.py", "bdist_wheel", "--compile-here", "--dist-dir", tmp]
            probe = subprocess.run([sys.executable, "-c", "import torch.utils.cpp_extension"], env=env,
                                   capture_output=True, text=True)
            if probe.returncode != 0:
                raise InstallerError(
                    "cannot compile cudelta: torch is not importable by this build"
                    f" ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'not found'}), "
                    "and a local compile needs it. Install torch first (pip install torch), then cudelta "
                    "again; or set CUDELTA_TARGET_PYTHON to the interpreter that has torch."
                )
            result = subprocess.run(cmd, env=env, cwd=os.getcwd())
            if result.returncode != 0:
                raise InstallerError(f"the local compile failed (exit {result.returncode}); its output is above")
            for wheel in Path(tmp).glob("*.whl"):
                Path(self.dist_dir).mkdir(parents=True, exist_ok=True)
                shutil.move(str(wheel), str(Path(self.dist_dir) / wheel.name))


EMBEDDED_MANIFEST = native.ROOT / "installer" / "release_manifest.json"


def _trusted_manifest(settings: Settings, fetcher, base: str):
    """The manifest downloads are verified against, and which one it is (said in the log).

    The release's sdist embeds it: PyPI served and hashed that file, so a replaced GitHub asset
    or a hostile mirror cannot pass. A downloaded one is trusted only where there is no embedded
    one (a git checkout) or the user opts in for a private mirror of their own builds.
    """
    from .manifest import loads_manifest, parse_manifest

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


def _build_ext_class(base, record: dict):
    class build_ext(base):  # type: ignore[misc, valid-type]
        def run(self) -> None:
            super().run()
            # The loader reads this before dlopen, to refuse a mismatched torch with a clear message.
            out = Path(self.build_lib) / "cudelta" / "_build_info.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    return build_ext


def _unisolated_env() -> dict:
    """The environment for a child that must see both the target's site-packages and the
    build requirements pip installed for us (setuptools, wheel, ...)."""
    env = dict(os.environ)
    default = subprocess.run([sys.executable, "-I", "-c", "import json, sys; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, check=True)
    target_paths = set(json.loads(default.stdout))
    extra = [p for p in sys.path
             if p and p not in target_paths and os.path.isdir(p)
             and not os.path.isfile(os.path.join(p, "sitecustomize.py"))]
    env["PYTHONPATH"] = os.pathsep.join(extra)
    return env


def _detect(settings: Settings):
    from .detect import detect

    return detect(settings)


def _fail(exc: InstallerError) -> None:
    say(f"error: {exc}")
    raise SystemExit(1)


class sdist(_sdist):
    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        # An sdist has no .git: stamp the revision so a local build can still report it.
        stamp = Path(base_dir) / "installer" / "GIT_REVISION"
        stamp.unlink(missing_ok=True)  # may be a hard link into the source tree
        stamp.write_text(native.git_revision() + "\n")
        self._embed_release_manifest(Path(base_dir) / "installer" / EMBEDDED_MANIFEST.name)

    def _embed_release_manifest(self, dest: Path) -> None:
        """The release fan-in builds the sdist after the wheels, naming their manifest: it ships
        inside the sdist, so installs verify against what PyPI served."""
        from .manifest import loads_manifest

        try:
            settings = Settings.from_env()
            dest.unlink(missing_ok=True)
            if settings.release_manifest is None:
                return
            manifest = loads_manifest(settings.release_manifest.read_text())
        except InstallerError as exc:
            _fail(exc)
        version = self.distribution.get_version()
        if manifest.version != version:
            _fail(InstallerError(f"CUDELTA_RELEASE_MANIFEST {settings.release_manifest} is the manifest of release "
                                 f"{manifest.version}, not of {version}; build the sdist of the same version"))
        dest.write_text(manifest.to_json())
        say(f"embedded the release manifest of {version} ({len(manifest.assets)} assets) in the sdist")


def build_requirements() -> list[str]:
    """Extra build requirements (pip asks before building): ninja when a compile is planned up front.

    A bad setting is not reported here but by bdist_wheel, which says it without a traceback.
    """
    try:
        settings = Settings.from_env()
    except InstallerError:
        return []
    return ["ninja"] if settings.force_build else []


def cmdclass() -> dict:
    return {"bdist_wheel": bdist_wheel, "sdist": sdist}
