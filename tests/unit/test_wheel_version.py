import json
import zipfile

import pytest
from packaging.version import InvalidVersion
from wheel.wheelfile import WheelFile

from installer.core.wheel_version import retag_version, with_local_label


def make_wheel(tmp_path, version="0.1.0+cu130"):
    path = tmp_path / f"cudelta-{version}-cp310-abi3-manylinux_2_28_x86_64.whl"
    info = f"cudelta-{version}.dist-info"
    with WheelFile(path, "w") as wf:
        wf.writestr("cudelta/__init__.py", "x = 1\n")
        wf.writestr("cudelta/_C.abi3.so", b"\x7fELF fake")
        wf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.4\nName: cudelta\nVersion: {version}\n")
        wf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp310-abi3-manylinux_2_28_x86_64\n")
    return path


def test_dropping_the_label_renames_file_dist_info_and_metadata(tmp_path):
    src = make_wheel(tmp_path)
    out = retag_version(src, "0.1.0", tmp_path / "out", extra_dist_info={"asset": src.name, "sha256": "ab" * 32})
    assert out.name == "cudelta-0.1.0-cp310-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(out) as zf:
        names = zf.namelist()
        assert "cudelta-0.1.0.dist-info/METADATA" in names
        assert not any("+cu130" in n for n in names)
        assert "Version: 0.1.0\n" in zf.read("cudelta-0.1.0.dist-info/METADATA").decode()
        assert json.loads(zf.read("cudelta-0.1.0.dist-info/cudelta_source.json"))["asset"] == src.name
        assert zf.read("cudelta/_C.abi3.so") == b"\x7fELF fake"
    with WheelFile(out) as wf:  # RECORD hashes are checked on read
        for name in wf.namelist():
            wf.read(name)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [out.name]  # no temporaries left


def test_adding_the_label_is_the_inverse(tmp_path):
    plain = retag_version(make_wheel(tmp_path), "0.1.0", tmp_path / "a")
    labelled = retag_version(plain, with_local_label("0.1.0", "cu130"), tmp_path / "b")
    assert labelled.name == "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"


def test_an_invalid_version_writes_nothing(tmp_path):
    with pytest.raises(InvalidVersion, match="Invalid version: 'not a version'"):
        retag_version(make_wheel(tmp_path), "not a version", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_wheel_whose_metadata_has_no_version_leaves_no_file_behind(tmp_path):
    src = tmp_path / "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
    with WheelFile(src, "w") as wf:
        wf.writestr("cudelta-0.1.0+cu130.dist-info/METADATA", "Metadata-Version: 2.4\nName: cudelta\n")
        wf.writestr("cudelta-0.1.0+cu130.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n")
    with pytest.raises(ValueError, match="^wheel METADATA has no Version field$"):
        retag_version(src, "0.1.0", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # neither the wheel nor its temporary folder
