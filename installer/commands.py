"""setuptools commands: `bdist_wheel` runs detect -> choose -> fetch -> verify -> install, else build.

pip's build_wheel hook and the release matrix both end up here. This module is the setuptools
glue only: what happens is decided once, up front (installer/choose/plan.py), and said in one line; the
fetch path is installer/fetch/prebuilt.py, the compile installer/compile/local_build.py. Every user-facing
failure is an InstallerError, printed without a traceback.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional

from setuptools import Extension
from setuptools.errors import BaseError as SetuptoolsError  # distutils' DistutilsError
from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
from setuptools.command.sdist import sdist as _sdist

from . import dead_end
from .choose import install_record
from .choose.plan import Plan, plan_for
from .compile import local_build, native, platform_tag
from .compile.build_record import git_revision
from .core.errors import InstallerError
from .core.log import say
from .core.settings import Settings
from .dead_end import NoPrebuilt


class bdist_wheel(_bdist_wheel):
    user_options = _bdist_wheel.user_options + [
        ("compile-here", None, "internal: compile in this process (the target's torch is importable)"),
        ("compile-reason=", None, "internal: why the parent compiles (kept in the install record)"),
    ]
    boolean_options = _bdist_wheel.boolean_options + ["compile-here"]

    def initialize_options(self) -> None:
        super().initialize_options()
        self.compile_here = False
        self.compile_reason: Optional[str] = None
        self._plan: Optional[Plan] = None
        self._install_record: Optional[dict] = None  # pure and local wheels; a prebuilt carries its own

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
                self.plat_name = platform_tag.release_platform(self._target.machine)
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
            if self._settings.explain:
                say("CUDELTA_EXPLAIN: no release asset looked at (the pure-Python wheel is decided first)")
            self._install_record = install_record.pure(self._target, plan.reason)
            super().run()
            return
        if plan.kind == "fetch":
            missed = self._try_prebuilt()
            if missed is None:
                return
            if self._settings.no_build or self._compile_blockers():
                raise self._dead_end(missed)  # before a compile that cannot start (or may not)
            reason = f"no prebuilt wheel ({missed.why}): building from source"
            say(reason)
        else:
            missed = NoPrebuilt("FORCE_BUILD=1", "not-tried")
            reason = self.compile_reason or plan.reason
            if not self.compile_here:
                # The release matrix's own toolchain failing is its maintainers' business, said as is.
                if not self._settings.release_build and self._compile_blockers():
                    raise self._dead_end(missed)
                say(plan.reason)
        try:
            if local_build.torch_importable_here():
                self._compile(reason)
            else:
                local_build.compile_in_target_interpreter(Path(self.dist_dir), reason)
        except InstallerError as exc:
            if self.compile_here or self._settings.release_build:
                raise  # the parent, which ran us, says the ways out
            raise self._dead_end(missed, compile_failure=str(exc)) from None

    def _compile_blockers(self) -> list[str]:
        return local_build.compile_blockers(self._target, torch_here=local_build.torch_importable_here())

    def _dead_end(self, missed: NoPrebuilt, compile_failure: Optional[str] = None) -> InstallerError:
        return InstallerError(dead_end.final_line(self._settings, self._target, missed, self._compile_blockers(),
                                                  compile_failure))

    def _try_prebuilt(self) -> Optional[NoPrebuilt]:
        """Install a verified prebuilt wheel (or the pure-Python one) into dist_dir; or return why
        none was used."""
        from .fetch.prebuilt import install_prebuilt  # the download stack only where a download is planned

        outcome = install_prebuilt(self._settings, self._target, self.distribution.get_version(),
                                   Path(self.dist_dir))
        if outcome.kind == "pure":
            self._become_pure()
            self._install_record = install_record.pure(self._target, outcome.reason)
            super().run()
        if outcome.why_not is None:
            return None
        return NoPrebuilt(outcome.why_not, outcome.cause)

    def _become_pure(self) -> None:
        """No CUDA build exists for this platform: the same wheel as a CPU-only system gets."""
        self.distribution.ext_modules = []
        self.root_is_pure = True
        self.py_limited_api = False
        self.plat_name_supplied = False

    def _compile(self, reason: str) -> None:
        version = self.distribution.get_version()
        job = local_build.prepare(self._settings, self._target, version, Path(self.bdist_dir).resolve().parent)
        if not self._settings.release_build:  # a release asset gets its record where it is installed
            self._install_record = install_record.local(self._target, reason, job.record, self.get_tag()[2])
        self.distribution.ext_modules[:] = [job.extension]
        self.distribution.cmdclass["build_ext"] = job.build_ext
        self.distribution.command_obj.pop("build_ext", None)
        say(job.announcement)
        started = time.monotonic()
        try:
            super().run()
        except (SetuptoolsError, RuntimeError, subprocess.CalledProcessError) as exc:
            # torch's BuildExtension raises RuntimeError when ninja fails: said as one line, the
            # compiler's output being above it.
            raise InstallerError(f"the local compile failed ({exc}); its output is above") from None
        say(f"compiled in {time.monotonic() - started:.0f} s")
        if self._settings.release_build:
            build_lib = Path(self.get_finalized_command("build_ext").build_lib)
            local_build.label_release_wheel(Path(self.dist_dir), version, (build_lib / "cudelta").glob("_C*.so"),
                                            job.record["cuda_label"])

    def write_wheelfile(self, wheelfile_base: str, *args, **kwargs) -> None:
        # Called with the dist-info folder whether it came from egg-info or, under PEP 517, from
        # pip's prepare_metadata step; RECORD is written after, so it lists the file.
        super().write_wheelfile(wheelfile_base, *args, **kwargs)
        if self._install_record is not None:
            (Path(wheelfile_base) / install_record.FILENAME).write_text(install_record.dumps(self._install_record))


def _detect(settings: Settings):
    from .detect.detect import detect

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
        stamp.write_text(git_revision() + "\n")
        from .fetch.prebuilt import EMBEDDED_MANIFEST

        self._embed_release_manifest(Path(base_dir) / "installer" / EMBEDDED_MANIFEST.name)

    def _embed_release_manifest(self, dest: Path) -> None:
        """The release fan-in builds the sdist after the wheels, naming their manifest: it ships
        inside the sdist, so installs verify against
        what PyPI served."""
        from .choose.manifest import loads_manifest

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
