"""CUDELTA_EXPLAIN=1 through the real fetch path: a `file://` wheelhouse, the downloaded manifest,
the verified asset retagged with its install record."""

from __future__ import annotations

import hashlib
import json
import zipfile

from installer.core.settings import Settings
from installer.core.target import Gpu, TargetEnv
from installer.fetch import prebuilt
from test_wheel_version import make_wheel

TARGET = TargetEnv(python_version=(3, 11), implementation="cpython", os_name="linux", machine="x86_64",
                   glibc=(2, 36), driver_cuda=(13, 0), gpus=(Gpu(0, "NVIDIA H100", 9, 0),))


def wheelhouse(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    assets = []
    for label, cuda in (("cu129", "12.9"), ("cu130", "13.0")):
        wheel = make_wheel(house, f"0.1.0+{label}")
        assets.append({"name": wheel.name, "size": wheel.stat().st_size,
                       "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(), "cuda": cuda,
                       "platform": "manylinux_2_28_x86_64", "archs": ["sm_80", "sm_90a"], "ptx": [],
                       "torch_floor": "2.10", "python_floor": "3.10", "driver_floor": cuda.split(".")[0] + ".0"})
    (house / "manifest.json").write_text(json.dumps({"schema": 1, "version": "0.1.0", "assets": assets}))
    return house, [a["name"] for a in assets]


def install(tmp_path, capsys, explain: str):
    house, names = wheelhouse(tmp_path)
    settings = Settings.from_env({"CUDELTA_WHEEL_URL": house.as_uri(), "CUDELTA_CACHE_DIR": str(tmp_path / "cache"),
                                  "CUDELTA_EXPLAIN": explain})
    outcome = prebuilt.install_prebuilt(settings, TARGET, "0.1.0", tmp_path / "dist")
    assert outcome.kind == "installed"
    return names, capsys.readouterr().err.splitlines()


def test_explain_prints_every_asset_with_its_verdict_into_the_build_log(tmp_path, capsys):
    (cu129, cu130), lines = install(tmp_path, capsys, "1")
    start = lines.index(next(line for line in lines if line.startswith("cudelta: CUDELTA_EXPLAIN: 2 asset(s)")))
    assert lines[start + 1:start + 3] == [
        f"cudelta:   fits     {cu129}: matches too; {cu130} comes first (the newest toolkit this driver runs)",
        f"cudelta:   chosen   {cu130}: matches: driver CUDA 13.0, GPU 0 sm_90 via sm_90a cubin, manylinux_2_36_x86_64",
    ]


def test_without_explain_the_log_has_the_choice_only(tmp_path, capsys):
    _, lines = install(tmp_path, capsys, "0")
    assert not any("CUDELTA_EXPLAIN" in line or line.startswith("cudelta:   ") for line in lines)


def test_the_installed_wheel_carries_the_record_of_the_choice(tmp_path, capsys):
    (cu129, cu130), _ = install(tmp_path, capsys, "0")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        record = json.loads(zf.read("cudelta-0.1.0.dist-info/cudelta_source.json"))
    assert record["kind"] == "prebuilt" and record["asset"] == cu130 and record["chosen"]["name"] == cu130
    assert record["machine"]["driver_cuda"] == "13.0" and record["machine"]["gpus"] == ["9.0"]
    assert record["rejected"] == [[cu129, f"matches too; {cu130} comes first (the newest toolkit this driver runs)"]]
