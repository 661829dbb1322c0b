"""Wall time of `pip install cudelta-<v>.tar.gz` on the fetch path vs a forced local compile, and
the time detection takes, in one run, on this machine.

    .ci-cache/venvs/runner/bin/python benchmarks/install_time.py [--repeat 3] [--out benchmarks/results-install-time.md]

(the runner venv of scripts/test.sh has the release checks' tools that release/dry_run.py runs)

Uses the end-to-end test machinery: a base venv with torch 2.14.1+cu130 (made once, cached in
CUDELTA_TEST_CACHE), the sdist and release assets built from this tree, the local GitHub-like
release server. Each install goes into a fresh venv that already has torch (as a user's would), and
the fresh-venv rows into an empty one where torch comes as cudelta's dependency;
pip's own cache is warm after the first run, as on any machine that has installed anything.
Targets: fetch path <= 10 s with torch present; detection <= 0.5 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "e2e"), str(ROOT / "tests"), str(ROOT)]

import envs as e2e  # noqa: E402
from release_server import ReleaseServer  # noqa: E402


def build_inputs(base: e2e.Venv, work: Path) -> tuple[Path, Path]:
    """The release as the fan-in makes it (release/dry_run.py): the wheel, its manifest, the sdist
    carrying it."""
    release = work / "release"
    e2e.run([sys.executable, "-m", "release.dry_run", "--out", release, "--python", base.python],
            cwd=ROOT, timeout=2400)
    (sdist,) = release.glob("cudelta-*.tar.gz")
    return sdist, release


def _log_seconds(line: str) -> float:
    """pip --log lines start with an ISO timestamp: '2026-11-23T12:00:01,234 ...'."""
    from datetime import datetime

    return datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S,%f").timestamp()


def fresh_venv_times(sdist: Path, env: dict, work: Path) -> tuple[float, float]:
    """(`pip install cudelta` in an empty venv, torch arriving as its dependency; the sdist's share
    of it). The share is read off pip's timestamped log, from its first line about cudelta (the lookup) to
    `Created wheel for cudelta` (finding it, the isolated build env, metadata, the build: detect, fetch, verify);
    the rest is torch and its dependencies. pip's cache is warm, as after any earlier install."""
    import shutil

    index = work / "pypi"
    index.mkdir(exist_ok=True)
    shutil.copy2(sdist, index / sdist.name)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        venv = e2e.make_venv(Path(tmp) / "venv")
        log = Path(tmp) / "pip.log"
        started = time.perf_counter()
        venv.pip("install", "-q", "--log", log, "--find-links", index, "cudelta", env=env, timeout=1800)
        total = time.perf_counter() - started
        lines = log.read_text().splitlines()
    begin = next(_log_seconds(x) for x in lines if "versions of cudelta" in x)  # pip starts looking for it
    end = next(_log_seconds(x) for x in lines if "Created wheel for cudelta" in x)
    return total, end - begin


def timed_install(base: e2e.Venv, sdist: Path, env: dict, extra: list[str], work: Path, pip: str) -> float:
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        venv = e2e.make_venv(Path(tmp) / "venv")
        if pip != "bundled":
            venv.pip("install", "-q", "-U", pip)
        venv.pip("uninstall", "-q", "-y", "setuptools", check=False)
        (venv.site_packages / "_base_torch.pth").write_text(str(base.site_packages) + "\n")
        if "--no-build-isolation" in extra:
            venv.pip("install", "-q", *e2e.BUILD_REQS)
        started = time.perf_counter()
        venv.pip("install", *extra, sdist, env=env)
        return time.perf_counter() - started


def pip_version(spec: str) -> str:
    if spec == "bundled":
        import ensurepip

        return ensurepip.version() + " (ensurepip)"
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip"], capture_output=True, text=True)
    latest = out.stdout.split("(", 1)[1].split(")", 1)[0] if "(" in out.stdout else "latest"
    return latest


def detection_times(base: e2e.Venv, repeat: int) -> tuple[float, float]:
    """(cold: a fresh interpreter importing the installer and detecting, in-process: detect() again)."""
    code = ("import time; t0 = time.perf_counter()\n"
            "from installer.detect.detect import detect; from installer.core.settings import Settings\n"
            "detect(Settings()); t1 = time.perf_counter(); detect(Settings()); t2 = time.perf_counter()\n"
            "print(t1 - t0, t2 - t1)")
    cold, warm = [], []
    for _ in range(repeat):
        out = subprocess.run([base.python, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        a, b = map(float, out.stdout.split())
        cold.append(a)
        warm.append(b)
    return statistics.median(cold), statistics.median(warm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--fresh-only", action="store_true", help="only the fresh-venv rows and detection")
    args = parser.parse_args()

    base = e2e.base_cu()
    with tempfile.TemporaryDirectory(prefix="cudelta-install-bench-") as tmp:
        work = Path(tmp)
        sdist, release = build_inputs(base, work)
        with ReleaseServer(release.parent) as server:
            server.add_release(e2e.TAG, release)
            fetch_env = e2e.clean_env(CUDELTA_WHEEL_URL=server.base_url(e2e.TAG), CUDELTA_CACHE_DIR=str(work / "c"))
            # pip 23.2.1 is what Python 3.11's ensurepip puts in a new venv; "pip" is today's release.
            cases = [
                ("fetch, pip default isolation", fetch_env, [], "bundled"),
                ("fetch, pip default isolation", fetch_env, [], "pip"),
                ("fetch, --no-build-isolation", fetch_env, ["--no-build-isolation"], "bundled"),
                ("FORCE_BUILD=1, GPU arch only (9.0a)", {**fetch_env, "FORCE_BUILD": "1",
                                                         "TORCH_CUDA_ARCH_LIST": "9.0a"}, [], "pip"),
                ("FORCE_BUILD=1, no GPU: all release archs", {**fetch_env, "FORCE_BUILD": "1"}, [], "pip"),
            ]
            rows = []
            timed_install(base, sdist, fetch_env, [], work, "pip")  # warm pip's caches
            fresh_total, sdist_share = fresh_venv_times(sdist, {**fetch_env, "CUDELTA_CACHE_DIR": str(work / "cf")},
                                                        work)
            if args.fresh_only:
                cases = []
            for name, env, extra, pip in cases:
                reps = args.repeat if name.startswith("fetch") else 1
                # a fresh download cache for each fetch, so every run really downloads and verifies
                times = [timed_install(base, sdist, {**env, "CUDELTA_CACHE_DIR": str(work / f"c{i}-{len(rows)}")},
                                       extra, work, pip) for i in range(reps)]
                rows.append((name, pip_version(pip), statistics.median(times), reps))
    cold, warm = detection_times(base, args.repeat)

    lines = ["`pip install cudelta-0.1.0.tar.gz` into a fresh venv that has torch 2.14.1+cu130 (rows 1-5), or into an "
             "empty venv (fresh-venv rows); "
             f"{Path('/proc/cpuinfo').read_text().count('processor')} cores, no GPU; median of the runs", "",
             "| case | pip | wall time (s) | runs | target |", "|---|---|---|---|---|"]
    for name, pip, seconds, reps in rows:
        target = "<= 10 s" if name.startswith("fetch") else ""
        lines.append(f"| {name} | {pip} | {seconds:.1f} | {reps} | {target} |")
    lines += [f"| fresh venv, no torch: `pip install cudelta` (torch 2.14.1+cu130 comes as its dependency) | "
              f"{pip_version('bundled')} | {fresh_total:.1f} | 1 | |",
              f"| of which cudelta's sdist (pip's log: its lookup to `Created wheel`) | "
              f"{pip_version('bundled')} | {sdist_share:.1f} | 1 | |",
              f"| of which torch and its dependencies (the rest) | {pip_version('bundled')} | "
              f"{fresh_total - sdist_share:.1f} | 1 | |",
              f"| detection, fresh interpreter (import + detect) | - | {cold:.3f} | {args.repeat} | <= 0.5 s |",
              f"| detection, in process | - | {warm:.3f} | {args.repeat} | |"]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
