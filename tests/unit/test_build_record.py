"""The build record contract (cudelta/_build_record.py): a record from the real writer, through every
reader; and the older spelling the readers still accept."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
from wheel.wheelfile import WheelFile

from installer.choose import plan
from installer.compile import build_record
from installer.core import shipped

POLICY = shipped.load("_release_policy")

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
RELEASE_WHEEL = f"cudelta-{VERSION}+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"


def _script(name: str):
    """A module of the release tooling (release/)."""
    return importlib.import_module(f"release.{name}")


def _release_wheel(folder: Path, record_text: str) -> Path:
    """A release wheel as the release build leaves it, with the record where the build writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RELEASE_WHEEL
    info = f"cudelta-{VERSION}+cu130.dist-info"
    with WheelFile(path, "w") as wf:
        wf.writestr("cudelta/__init__.py", "")
        wf.writestr("cudelta/_C.abi3.so", b"\x7fELF" + bytes(60))
        wf.writestr(f"cudelta/{build_record.FILENAME}", record_text)
        wf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: cudelta\nVersion: {VERSION}+cu130\n")
        wf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                     "Tag: cp310-abi3-manylinux_2_28_x86_64\n")
    return path


def test_a_real_record_passes_every_reader(tmp_path):
    torch = pytest.importorskip("torch")  # the run-time loader imports it
    record = build_record.build_record(
        version=VERSION, toolkit="13.0", archs=plan.release_targets(), torch_version="2.14.1+cu130",
        torch_floor=POLICY.TORCH_FLOOR, kind="release", compressed=True, revision=build_record.git_revision())
    assert record["schema"] == build_record.SCHEMA and record["cuda_label"] == "cu130"
    assert set(record) == set(build_record.reader.FIELDS)  # schema 2 only: no legacy `variant` copy

    # What the build writes: the file beside the library, and the copy compiled into it.
    package = tmp_path / "build_lib" / "cudelta"
    written = build_record.write_file(record, package)
    header = build_record.write_header(record, tmp_path / "generated").read_text()
    embedded = re.search(r'R"cudelta\((.*)\)cudelta"', header).group(1)
    assert build_record.loads(embedded) == record
    # The library's error messages name the same reinstall commands as the loader's, with the
    # build variables before each (as csrc/ops.cpp's fix_command joins the parts).
    parts = json.loads("[" + re.search(r"kReinstallParts\[\] = \{(.*)\};", header).group(1) + "]")
    env = "FORCE_BUILD=1 TORCH_CUDA_ARCH_LIST=9.0"
    assert (env + " ").join(parts) == build_record.reader.reinstall(env)

    # The run-time loader, before dlopen.
    from cudelta import _native

    info = _native.read_build_info(written)
    assert info == record
    assert _native.compatibility_problem(info, "2.14.1+cu130", "13.0", (13, 0)) is None
    assert _native.driver_floor(info) == (13, 0)
    assert "CPU build" in _native.compatibility_problem(info, str(torch.__version__), None, (13, 0))

    # The release tooling: the manifest, validated by the installer's own parser.
    wheel = _release_wheel(tmp_path / "dist", written.read_text())
    manifest = _script("make_release").make_release(VERSION, tmp_path / "release", [wheel])
    (asset,) = manifest.assets
    assert (asset.cuda, asset.cuda_label, asset.driver_floor) == ("13.0", record["cuda_label"], record["driver_floor"])
    assert (list(asset.archs), list(asset.ptx)) == (record["archs"], record["ptx"])
    assert (asset.torch_floor, asset.python_floor) == (record["torch_floor"], record["python_floor"])

    # The wheel checks that read the record.
    cw = _script("check_wheel")
    checker = cw.WheelChecker(wheel, tmp_path / "unpacked", cuobjdump="/nonexistent")
    for check in ("version_label", "build_info"):
        ok, detail, _ = getattr(checker, "check_" + check)()
        assert ok, (check, detail)


def test_schema_1_records_are_read_as_schema_2():
    # Wheels built before the schema field: the CUDA label was under "variant".
    old = {"version": VERSION, "variant": "cu129", "cuda_toolkit": "12.9", "archs": ["sm_80"], "ptx": [],
           "torch_floor": "2.10"}
    record = build_record.parse(old, required=("cuda_label", "cuda_toolkit", "archs"))
    assert record["schema"] == build_record.SCHEMA and record["cuda_label"] == "cu129"


@pytest.mark.parametrize("data,message", [
    ({"schema": 3}, "schema 3"),
    ({"schema": 2, "archs": "sm_80"}, "lacks version"),
    ({"schema": 2}, "lacks version"),
    ([], "not a JSON object"),
])
def test_what_is_not_a_record_is_refused_by_name(data, message):
    with pytest.raises(build_record.BuildRecordError, match=re.escape(message)):
        build_record.parse(data)
    with pytest.raises(build_record.BuildRecordError, match="archs is 'sm_80'"):
        build_record.parse({"archs": "sm_80"}, required=())


def test_the_reinstall_hint_touches_only_cudelta_with_pip_and_with_uv():
    # --force-reinstall without --no-deps reinstalls torch too: gigabytes, and PyPI's default build
    # in place of the user's +cuXYZ one.
    pip, uv = build_record.reader.reinstall_commands("FORCE_BUILD=1")
    assert pip == "FORCE_BUILD=1 pip install --force-reinstall --no-deps --no-cache-dir cudelta"
    assert uv == "FORCE_BUILD=1 uv pip install --reinstall-package cudelta --no-deps --no-cache cudelta"
    assert build_record.reader.REINSTALL == f"{pip[len('FORCE_BUILD=1 '):]} (uv: {uv[len('FORCE_BUILD=1 '):]})"


def test_readme_gives_the_same_reinstall_commands():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for command in build_record.reader.reinstall_commands():
        assert f"`{command}`" in readme
