"""The workflows' invariants that no linter checks (actionlint and zizmor run in scripts/lint.sh).

Each rule is a function returning its violations; every rule is run on the real workflows (no
violation) and on a mutated copy that breaks it (a violation found), so no rule can pass vacuously.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import yaml  # scripts/test.sh's runner venv has pyyaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
SHA_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$")
PUBLISHING_ACTIONS = ("pypa/gh-action-pypi-publish", "actions/attest-build-provenance", "actions/deploy-pages")
PR_TRIGGERS = ("pull_request", "pull_request_target", "workflow_run")


from release import matrix  # noqa: E402


def load_all() -> Dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(WORKFLOWS.glob("*.yml"))}


@pytest.fixture
def wfs() -> Dict[str, dict]:
    return load_all()


def triggers(wf: dict) -> dict:
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as the boolean True
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return {name: None for name in on}
    return dict(on or {})


def jobs(wfs: Dict[str, dict]) -> Iterator[Tuple[str, str, dict]]:
    for name, wf in wfs.items():
        for job_id, job in (wf.get("jobs") or {}).items():
            yield name, job_id, job


def steps_using(job: dict, action: str) -> List[dict]:
    return [s for s in job.get("steps", []) if str(s.get("uses", "")).split("@")[0] == action]


def render(text: str, cell: dict) -> str:
    """Substitute ${{ matrix.KEY }} with the cell's value (what GitHub does per cell)."""
    def sub(m):
        key = m.group(1)
        if key not in cell:
            raise KeyError(f"matrix.{key} is not a key of release/matrix.py's cells")
        return str(cell[key])
    return re.sub(r"\$\{\{\s*matrix\.([A-Za-z0-9_]+)\s*\}\}", sub, text)


# --- the rules -----------------------------------------------------------------------------------

def release_build_job(wfs) -> Tuple[str, dict]:
    release = wfs["release.yml"]["jobs"]
    (job_id,) = [j for j, job in release.items() if "matrix" in (job.get("strategy") or {})]
    return job_id, release[job_id]


def violations_build_cells(wfs) -> List[str]:
    """release.yml builds exactly the 4 cells {12.9, 13.0} x {x86_64, aarch64}, from release/matrix.py."""
    problems = []
    job_id, job = release_build_job(wfs)
    spec = str(job["strategy"]["matrix"])
    plan_id = re.search(r"needs\.([A-Za-z0-9_-]+)\.outputs\.matrix", spec)
    if not plan_id:
        return [f"{job_id}: matrix {spec!r} does not come from the plan job's output"]
    plan = wfs["release.yml"]["jobs"][plan_id.group(1)]
    if not any("release.matrix" in str(s.get("run", "")) for s in plan.get("steps", [])):
        problems.append(f"{plan_id.group(1)} does not run release.matrix")
    cells = {(c["cuda"], c["arch"]) for c in matrix.cells()}
    if cells != {(c, a) for c in ("12.9", "13.0") for a in ("x86_64", "aarch64")} or len(matrix.cells()) != 4:
        problems.append(f"release/matrix.py cells are {sorted(cells)}")
    for c in matrix.cells():
        if c["platform"] != f"manylinux_2_28_{c['arch']}" or "manylinux" not in c["image"]:
            problems.append(f"cell {c['label']} {c['arch']}: not a manylinux_2_28 build ({c['platform']}, {c['image']})")
        if c["arch"] == "aarch64" and "arm" not in c["runner"]:
            problems.append(f"cell {c['label']} aarch64 runs on {c['runner']}, not an arm64 runner")
    if str(job.get("runs-on")) != "${{ matrix.runner }}" or "matrix.image" not in str(job.get("container")):
        problems.append(f"{job_id}: runner/container are not the cell's")
    runs = " ".join(str(s.get("run", "")) for s in job.get("steps", []))
    for script in ("-m release.build_cell", "-m release.check_wheel", "-m release.smoke_install"):
        if script not in runs:
            problems.append(f"{job_id} does not run {script}")
    return problems


def violations_artifact_names(wfs) -> List[str]:
    """Every artifact uploaded by a matrix job has a name unique per cell, naming every axis."""
    problems = []
    for wf_name, job_id, job in jobs(wfs):
        if wf_name != "release.yml" or "matrix" not in (job.get("strategy") or {}):
            continue
        for step in steps_using(job, "actions/upload-artifact"):
            name = str(step.get("with", {}).get("name", ""))
            rendered = [render(name, c) for c in matrix.cells()]
            if len(set(rendered)) != len(rendered):
                problems.append(f"{job_id}: artifact name {name!r} repeats across cells: {rendered}")
            for cell, text in zip(matrix.cells(), rendered):
                if cell["label"] not in text or cell["arch"] not in text:
                    problems.append(f"{job_id}: artifact {text!r} does not name {cell['label']} and {cell['arch']}")
    return problems


def violations_id_token(wfs) -> List[str]:
    """id-token: write only in jobs that publish or attest, never workflow-wide."""
    problems = []
    for wf_name, wf in wfs.items():
        if "id-token" in str(wf.get("permissions", "")) or wf.get("permissions") == "write-all":
            problems.append(f"{wf_name}: workflow-level permissions grant {wf.get('permissions')}")
    for wf_name, job_id, job in jobs(wfs):
        perms = job.get("permissions")
        if perms is None:
            problems.append(f"{wf_name}:{job_id}: no job-level permissions (least privilege per job)")
            continue
        if perms == "write-all" or (isinstance(perms, dict) and perms.get("id-token") == "write"):
            if not any(steps_using(job, a) for a in PUBLISHING_ACTIONS):
                problems.append(f"{wf_name}:{job_id} holds id-token: write but neither publishes nor attests")
    return problems


def violations_pypi_sdist_only(wfs) -> List[str]:
    """The job publishing to PyPI gets the sdist artifact only, and that artifact is only the sdist."""
    problems = []
    publishers = [(w, j, job) for w, j, job in jobs(wfs) if steps_using(job, "pypa/gh-action-pypi-publish")]
    if len(publishers) != 1:
        return [f"expected one PyPI publishing job, found {[(w, j) for w, j, _ in publishers]}"]
    wf_name, job_id, job = publishers[0]
    downloads = steps_using(job, "actions/download-artifact")
    names = [d.get("with", {}).get("name") for d in downloads]
    if not downloads or any(n is None or "pattern" in d.get("with", {}) for n, d in zip(names, downloads)):
        problems.append(f"{job_id}: downloads {names} / patterns; must name the sdist artifact only")
    for name in names:
        uploads = [s for other in wfs[wf_name]["jobs"].values()
                   for s in steps_using(other, "actions/upload-artifact") if s.get("with", {}).get("name") == name]
        paths = [str(u.get("with", {}).get("path", "")) for u in uploads]
        if not uploads or any(not re.fullmatch(r"\S*\*\.tar\.gz", p.strip()) for p in paths):
            problems.append(f"artifact {name!r} is uploaded from {paths}, not *.tar.gz only")
    other_steps = [s for s in job.get("steps", []) if "run" in s]
    if any(re.search(r"\.whl|wheel", str(s["run"])) and "test" not in str(s["run"]) for s in other_steps):
        problems.append(f"{job_id}: a run step handles wheels")
    return problems


def violations_self_hosted(wfs) -> List[str]:
    """No workflow a pull request can trigger runs a job on a self-hosted runner."""
    problems = []
    for wf_name, wf in wfs.items():
        reachable = [t for t in triggers(wf) if t in PR_TRIGGERS]
        for job_id, job in (wf.get("jobs") or {}).items():
            labels = job.get("runs-on")
            labels = labels if isinstance(labels, list) else [labels]
            if "self-hosted" in map(str, labels) and reachable:
                problems.append(f"{wf_name}:{job_id} runs self-hosted, and {', '.join(reachable)} triggers it")
    return problems


def violations_pinned(wfs) -> List[str]:
    """Every `uses:` is owner/repo[/path]@<40-hex commit>, with the version in a trailing comment."""
    problems = []
    for wf_name, job_id, job in jobs(wfs):
        refs = [job["uses"]] if "uses" in job else []
        refs += [s["uses"] for s in job.get("steps", []) if "uses" in s]
        for ref in refs:
            if str(ref).startswith("./"):
                continue
            if not SHA_RE.match(str(ref)):
                problems.append(f"{wf_name}:{job_id}: {ref} is not pinned to a commit SHA")
    for path in WORKFLOWS.glob("*.yml"):
        for line in path.read_text().splitlines():
            if re.search(r"uses:\s*\S+@[0-9a-f]{40}", line) and not re.search(r"#\s*v\d", line):
                problems.append(f"{path.name}: {line.strip()} has no '# vX.Y.Z' comment")
    return problems


SUITE_LISTS = ("scripts/test.sh", "tests/envs.py")  # the package lists the test venvs are made from
CI_RUN = ROOT / ".ci" / "run"


def suite_jobs(wfs) -> List[Tuple[str, str, dict]]:
    """Jobs of pull-request workflows whose step runs `.ci/run`, the CI machine's command."""
    return [(w, j, job) for w, j, job in jobs(wfs) if "pull_request" in triggers(wfs[w])
            and any(str(s.get("run", "")).strip() == ".ci/run" for s in job.get("steps", []))]


def cache_steps_keyed_on_lists(job: dict) -> List[dict]:
    keyed = []
    for step in steps_using(job, "actions/cache"):
        key = str(step.get("with", {}).get("key", ""))
        hashed = re.search(r"hashFiles\(([^)]*)\)", key)
        if hashed and all(f"'{name}'" in hashed.group(1) for name in SUITE_LISTS):
            keyed.append(step)
    return keyed


def violations_pr_runs_the_suite(wfs) -> List[str]:
    """A pull request runs what .ci/run runs (e2e included), with the test venvs and pip's cache
    restored under keys that change with the package lists; no PR step deselects e2e."""
    problems = []
    found = suite_jobs(wfs)
    if len(found) != 1:
        return [f"expected one pull-request job running .ci/run, found {[(w, j) for w, j, _ in found]}"]
    _, job_id, job = found[0]
    test_cache = str((job.get("env") or {}).get("CUDELTA_TEST_CACHE", ""))
    prefix = "${{ github.workspace }}/"
    if not test_cache.startswith(prefix):
        problems.append(f"{job_id}: CUDELTA_TEST_CACHE is {test_cache!r}, not a folder of the workspace")
    paths = [str(s["with"].get("path", "")).strip() for s in cache_steps_keyed_on_lists(job)]
    venvs = test_cache[len(prefix):] + "/venvs"
    if venvs not in paths:
        problems.append(f"{job_id}: no actions/cache of {venvs} keyed on {SUITE_LISTS} (cached: {paths})")
    if "~/.cache/pip" not in paths:
        problems.append(f"{job_id}: no actions/cache of ~/.cache/pip keyed on {SUITE_LISTS} (cached: {paths})")
    for wf_name, other_id, other in jobs(wfs):
        if "pull_request" not in triggers(wfs[wf_name]):
            continue
        for step in other.get("steps", []):
            if re.search(r"not\s+e2e", str(step.get("run", ""))):
                problems.append(f"{wf_name}:{other_id} deselects the e2e tests: {step['run'].strip()!r}")
    return problems


RULES = [violations_build_cells, violations_artifact_names, violations_id_token, violations_pypi_sdist_only,
         violations_self_hosted, violations_pinned, violations_pr_runs_the_suite]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_the_workflows_keep_the_rule(rule, wfs):
    assert rule(wfs) == []


# --- each rule fails on a copy that breaks it ---------------------------------------------------

def _build(w):
    return release_build_job(w)[1]


def _job(w, wf, job_id):
    return w[wf]["jobs"][job_id]


def mutate_cells(w):
    _build(w)["strategy"]["matrix"] = {"cuda": ["13.0"], "arch": ["x86_64"]}


def mutate_cells_script(w, monkeypatch):
    monkeypatch.setattr(matrix, "CUDA_VERSIONS", ("13.0",))


def mutate_artifact_name(w):
    for step in steps_using(_build(w), "actions/upload-artifact"):
        step["with"]["name"] = "wheel-${{ matrix.label }}"  # two arches collide


def mutate_id_token(w):
    _job(w, "release.yml", "fan-in")["permissions"]["id-token"] = "write"


def mutate_workflow_id_token(w):
    w["ci.yml"]["permissions"] = {"id-token": "write"}


def mutate_pypi_gets_wheels(w):
    for step in steps_using(_job(w, "release.yml", "pypi"), "actions/download-artifact"):
        step["with"]["name"] = "release-assets"


def mutate_sdist_artifact_holds_wheels(w):
    for step in steps_using(_job(w, "release.yml", "fan-in"), "actions/upload-artifact"):
        if step["with"]["name"] == "sdist":
            step["with"]["path"] = "release/"


def mutate_self_hosted_on_pr(w):
    w["gpu-tests.yml"]["on"] = {"pull_request": None, "push": {"branches": ["main"]}}


def mutate_unpinned(w):
    _job(w, "ci.yml", "lint")["steps"][0]["uses"] = "actions/checkout@v5"


def mutate_tag_pinned(w):
    _job(w, "release.yml", "pypi")["steps"][-1]["uses"] = "pypa/gh-action-pypi-publish@release/v1"


def _suite(w):
    return suite_jobs(w)[0][2]


def mutate_suite_skips_e2e(w):
    for step in _suite(w)["steps"]:
        if str(step.get("run", "")).strip() == ".ci/run":
            step["run"] = 'scripts/test.sh -m "not gpu and not e2e"'


def mutate_suite_extra_job_skips_e2e(w):
    w["ci.yml"]["jobs"]["quick"] = {"runs-on": "ubuntu-24.04", "permissions": {"contents": "read"},
                                    "steps": [{"run": 'scripts/test.sh -m "not gpu and not e2e" -q'}]}


def mutate_venv_key_ignores_envs(w):
    for step in steps_using(_suite(w), "actions/cache"):
        step["with"]["key"] = step["with"]["key"].replace(", 'tests/envs.py'", "")


def mutate_no_pip_cache(w):
    _suite(w)["steps"] = [s for s in _suite(w)["steps"] if s.get("with", {}).get("path") != "~/.cache/pip"]


def mutate_suite_not_on_pull_requests(w):
    w["ci.yml"]["on"] = {"push": {"branches": ["main"]}}


MUTATIONS = [
    (violations_build_cells, mutate_cells),
    (violations_artifact_names, mutate_artifact_name),
    (violations_id_token, mutate_id_token),
    (violations_id_token, mutate_workflow_id_token),
    (violations_pypi_sdist_only, mutate_pypi_gets_wheels),
    (violations_pypi_sdist_only, mutate_sdist_artifact_holds_wheels),
    (violations_self_hosted, mutate_self_hosted_on_pr),
    (violations_pinned, mutate_unpinned),
    (violations_pinned, mutate_tag_pinned),
    (violations_pr_runs_the_suite, mutate_suite_skips_e2e),
    (violations_pr_runs_the_suite, mutate_suite_extra_job_skips_e2e),
    (violations_pr_runs_the_suite, mutate_venv_key_ignores_envs),
    (violations_pr_runs_the_suite, mutate_no_pip_cache),
    (violations_pr_runs_the_suite, mutate_suite_not_on_pull_requests),
]


@pytest.mark.parametrize("rule, mutate", MUTATIONS, ids=lambda f: f.__name__)
def test_each_rule_catches_a_workflow_that_breaks_it(rule, mutate, wfs):
    broken = copy.deepcopy(wfs)
    mutate(broken)
    assert rule(broken), f"{rule.__name__} found nothing after {mutate.__name__}"


def test_the_cell_rule_catches_a_matrix_script_with_fewer_cells(wfs, monkeypatch):
    mutate_cells_script(wfs, monkeypatch)
    assert violations_build_cells(wfs)


def test_the_matrix_json_is_what_the_workflow_reads(capsys, tmp_path, monkeypatch):
    out = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    assert matrix.main(["--github-output", "--tag", "v" + re.search(
        r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)]) == 0
    import json

    printed = json.loads(capsys.readouterr().out)
    assert printed == {"include": matrix.cells()}
    lines = dict(line.split("=", 1) for line in out.read_text().splitlines())
    assert json.loads(lines["matrix"]) == printed and lines["version"]
    assert matrix.main(["--tag", "v9.9.9"]) == 2


def test_the_release_runs_scripts_that_exist(wfs):
    for wf_name, job_id, job in jobs(wfs):
        for step in job.get("steps", []):
            for script in re.findall(r"scripts/[A-Za-z0-9_.-]+", str(step.get("run", ""))):
                assert (ROOT / script).is_file(), f"{wf_name}:{job_id} runs missing {script}"


def test_ci_run_is_the_whole_no_gpu_suite():
    # .ci/run hands scripts/test.sh no marker expression, so the suite's default (everything but
    # gpu) is what the CI machine and the pull-request job run.
    commands = [line.strip() for line in CI_RUN.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "exec scripts/test.sh"
    assert 'markers="not gpu"' in (ROOT / "scripts" / "test.sh").read_text()


def test_every_declared_marker_marks_a_test():
    import tomllib

    declared = [m.split(":")[0].strip() for m in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]]
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    unused = [m for m in declared if not re.search(rf"pytest\.mark\.{m}\b", sources)]
    assert declared and unused == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_cell_refuses_a_wheel_tagged_for_another_arch(tmp_path):
    import struct
    import zipfile

    from release import build_cell

    elf_aarch64 = b"\x7fELF\x02\x01\x01" + bytes(11) + struct.pack("<H", 183) + bytes(40)
    wheel = tmp_path / "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("cudelta/_C.abi3.so", elf_aarch64)
    with pytest.raises(build_cell.CellError, match="library for aarch64, cell aarch64"):
        build_cell.check_arch(wheel, "aarch64")  # the name says x86_64
    with pytest.raises(build_cell.CellError, match="library for aarch64, cell x86_64"):
        build_cell.check_arch(wheel, "x86_64")
    good = wheel.with_name(wheel.name.replace("x86_64", "aarch64"))
    wheel.rename(good)
    build_cell.check_arch(good, "aarch64")


def test_the_matrix_refuses_an_unknown_cell():
    with pytest.raises(ValueError, match="no cell CUDA 12.4"):
        matrix.cell("12.4", "x86_64")
    assert matrix.main(["--cell", "13.0", "ppc64le"]) == 2
