import copy
import json

import pytest
from packaging.tags import Tag
from packaging.version import Version

from installer.choose.manifest import Manifest, asset_to_dict, loads_manifest, parse_asset, parse_manifest
from installer.core.errors import InstallerError

NAME = "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"
ASSET = {
    "name": NAME,
    "size": 123,
    "sha256": "a" * 64,
    "cuda": "13.0",
    "platform": "manylinux_2_28_x86_64",
    "archs": ["sm_80", "sm_90a", "sm_100f", "sm_120f"],
    "ptx": ["compute_120"],
    "torch_floor": "2.10",
    "python_floor": "3.10",
    "driver_floor": "13.0",
}
DOC = {"schema": 1, "version": "0.1.0", "assets": [ASSET]}


def doc_with(**changes):
    doc = copy.deepcopy(DOC)
    for key, value in changes.items():
        if value is KeyError:
            del doc["assets"][0][key]
        else:
            doc["assets"][0][key] = value
    return doc


def test_parses_the_documented_example():
    manifest = parse_manifest(copy.deepcopy(DOC))
    assert manifest.version == "0.1.0" and manifest.schema == 1
    (asset,) = manifest.assets
    assert asset.archs == ("sm_80", "sm_90a", "sm_100f", "sm_120f")
    assert asset.ptx == ("compute_120",)
    assert asset.version == Version("0.1.0+cu130")
    assert asset.public_version == "0.1.0"
    assert asset.tags == frozenset({Tag("cp310", "abi3", "manylinux_2_28_x86_64")})
    assert asset.cuda_tuple == (13, 0) and asset.driver_floor_tuple == (13, 0)
    assert asset.python_floor_tuple == (3, 10)
    assert asset.describe_archs() == "sm_80, sm_90a, sm_100f, sm_120f + compute_120"
    assert manifest.find(NAME) is asset and manifest.find("nope.whl") is None


def test_round_trips_through_json():
    manifest = parse_manifest(copy.deepcopy(DOC))
    assert json.loads(manifest.to_json()) == DOC
    assert loads_manifest(manifest.to_json()) == manifest
    assert asset_to_dict(manifest.assets[0]) == ASSET


def test_unknown_keys_are_ignored():
    doc = doc_with(signature="later")
    doc["published"] = "2026-11-22"
    assert parse_manifest(doc).assets[0].name == NAME


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"sha256": KeyError}, "assets[0].sha256 is missing"),
        ({"sha256": "A" * 64}, "assets[0].sha256"),
        ({"sha256": "ab"}, "assets[0].sha256"),
        ({"size": -1}, "assets[0].size"),
        ({"size": True}, "assets[0].size"),
        ({"size": "123"}, "assets[0].size"),
        ({"name": "cudelta-0.1.0.tar.gz"}, "assets[0].name"),
        ({"name": "cudelta-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.zip"}, "assets[0].name"),
        ({"cuda": "13"}, "assets[0].cuda"),
        ({"cuda": "12.8"}, "assets[0].cuda"),  # disagrees with the +cu130 label
        ({"platform": "manylinux_2_17_x86_64"}, "assets[0].platform"),
        ({"archs": ["sm_9x"]}, "assets[0].archs[0]"),
        ({"archs": "sm_80"}, "assets[0].archs"),
        ({"ptx": ["sm_120"]}, "assets[0].ptx[0]"),
        ({"archs": [], "ptx": []}, "assets[0].archs"),
        ({"torch_floor": "two"}, "assets[0].torch_floor"),
        ({"python_floor": 3.1}, "assets[0].python_floor"),
        ({"driver_floor": "13"}, "assets[0].driver_floor"),
        ({"name": "cudelta-0.2.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl"}, "assets[0].name"),
    ],
)
def test_bad_fields_are_named(changes, field):
    with pytest.raises(InstallerError) as info:
        parse_manifest(doc_with(**changes))
    assert field in str(info.value)
    assert str(info.value).startswith("release manifest: ")


def test_document_level_errors():
    for doc, field in [
        ({**DOC, "schema": 2}, "schema"),
        ({k: v for k, v in DOC.items() if k != "schema"}, "manifest.schema is missing"),
        ({**DOC, "version": "not a version"}, "version"),
        ({**DOC, "assets": {}}, "assets"),
        ({**DOC, "assets": [ASSET, ASSET]}, "assets[1].name"),
        ({**DOC, "assets": ["x"]}, "assets[0]"),
        ([DOC], "the document"),
    ]:
        with pytest.raises(InstallerError, match=r"release manifest: .*" + field.replace("[", r"\[").replace("]", r"\]")):
            parse_manifest(copy.deepcopy(doc))


def test_invalid_json_is_an_installer_error():
    with pytest.raises(InstallerError, match="not valid JSON"):
        loads_manifest("{")


def test_parse_asset_standalone_and_manifest_builds_back():
    asset = parse_asset(copy.deepcopy(ASSET))
    manifest = Manifest(version="0.1.0", assets=(asset,))
    assert parse_manifest(manifest.to_dict()) == manifest
