import re
from pathlib import Path

import pytest

from installer.core import cuda
from installer.core.errors import SettingsError
from installer.core.settings import Settings, documented_variables

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("raw,expected", [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                                          ("0", False), ("false", False), ("No", False), ("", False)])
def test_force_build_accepts_the_usual_booleans_in_any_case(raw, expected):
    assert Settings.from_env({"FORCE_BUILD": raw}).force_build is expected


def test_cudelta_force_build_is_an_alias():
    assert Settings.from_env({"CUDELTA_FORCE_BUILD": "1"}).force_build


@pytest.mark.parametrize("name", ["FORCE_BUILD", "CUDELTA_NO_BUILD", "CUDELTA_OFFLINE"])
def test_a_bad_boolean_names_the_variable_the_value_and_what_is_accepted(name):
    with pytest.raises(SettingsError) as err:
        Settings.from_env({name: "maybe"})
    assert name in str(err.value) and "'maybe'" in str(err.value) and "true, false" in str(err.value)


def test_release_build_implies_force_build():
    s = Settings.from_env({"CUDELTA_RELEASE_BUILD": "1"})
    assert s.release_build and s.force_build


@pytest.mark.parametrize("raw", ["13.0", "130", "cu130", "CU130"])
@pytest.mark.parametrize("name", ["CUDELTA_DRIVER_CUDA", "CUDELTA_CUDA_VERSION"])
def test_driver_cuda_spellings_under_the_new_and_the_old_name(name, raw):
    assert Settings.from_env({name: raw}).driver_cuda == cuda.DriverOverride((13, 0))


def test_driver_cuda_cpu_and_bad_value():
    assert Settings.from_env({"CUDELTA_DRIVER_CUDA": "cpu"}).driver_cuda == cuda.DriverOverride(None)
    assert str(Settings.from_env({"CUDELTA_DRIVER_CUDA": "none"}).driver_cuda) == "cpu"
    with pytest.raises(SettingsError,
                       match="CUDELTA_DRIVER_CUDA='thirteen' is not a CUDA version; accepted: 10.0 to 99.9.*"
                             "13.0, also 130 or cu130"):
        Settings.from_env({"CUDELTA_DRIVER_CUDA": "thirteen"})


def test_arch_list_in_torch_syntax_and_the_cudelta_name_wins():
    s = Settings.from_env({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a 12.0f+ptx", "CUDELTA_CUDA_ARCHS": "9.0a"})
    assert tuple(map(str, s.cuda_archs)) == ("9.0a",)
    parsed = Settings.from_env({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a 12.0f+ptx"}).cuda_archs
    assert tuple(map(str, parsed)) == ("8.0", "9.0a", "12.0f+PTX")
    with pytest.raises(SettingsError, match="'sm_90'"):
        Settings.from_env({"TORCH_CUDA_ARCH_LIST": "8.0;sm_90"})


@pytest.mark.parametrize("name,raw", [("MAX_JOBS", "0"), ("MAX_JOBS", "many"), ("CUDELTA_HTTP_TIMEOUT", "-1"),
                                      ("CUDELTA_HTTP_RETRIES", "-2"), ("CUDELTA_WHEEL_URL", "ftp://x/y"),
                                      ("CUDELTA_WHEEL_URL", "releases/v0.1.0")])
def test_bad_numbers_and_urls_are_refused_by_name(name, raw):
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: raw})


def test_wheel_url_accepts_mirrors_and_wheelhouses():
    assert Settings.from_env({"CUDELTA_WHEEL_URL": "file:///srv/wheels/"}).release_url("0.1.0") == "file:///srv/wheels"
    assert Settings.from_env({}).release_url("0.1.0") == (
        "https://github.com/cudelta/cudelta/releases/download/v0.1.0")


def test_the_token_never_shows_in_repr():
    s = Settings.from_env({"GITHUB_TOKEN": "ghp_secret123"})
    assert s.github_token == "ghp_secret123"
    assert "ghp_secret123" not in repr(s) and "***" in repr(s)


def test_every_setting_is_documented_in_the_readme_table():
    text = README.read_text()
    for names, _default, _doc in documented_variables():
        for name in names.split(" / "):
            assert re.search(rf"^\| [^|]*`{name}`", text, re.M), f"{name} missing from README's table"


def test_download_bounds_defaults_and_values():
    s = Settings.from_env({})
    assert (s.http_deadline, s.http_min_rate) == (300.0, 32.0)
    s = Settings.from_env({"CUDELTA_HTTP_DEADLINE": "45.5", "CUDELTA_HTTP_MIN_RATE": "0"})
    assert (s.http_deadline, s.http_min_rate) == (45.5, 0.0)  # 0: no rate check


@pytest.mark.parametrize("name,raw,accepted", [
    ("CUDELTA_HTTP_DEADLINE", "0", "a number of seconds from 1 to 86400"),
    ("CUDELTA_HTTP_DEADLINE", "5min", "a number of seconds from 1 to 86400"),
    ("CUDELTA_HTTP_MIN_RATE", "-1",
     "a number of kilobytes per second from 0 to 1000000 (e.g. 32; 0 turns the check off)"),
    ("CUDELTA_HTTP_MIN_RATE", "32KB/s", "a number of kilobytes per second from 0 to 1000000"),
    ("CUDELTA_HTTP_MIN_RATE", "nan", "a number of kilobytes per second from 0 to 1000000"),
    ("CUDELTA_HTTP_MIN_RATE", "inf", "a number of kilobytes per second from 0 to 1000000"),
])
def test_bad_download_bounds_name_the_variable_the_value_and_what_is_accepted(name, raw, accepted):
    with pytest.raises(SettingsError) as err:
        Settings.from_env({name: raw})
    assert f"{name}={raw!r} is not accepted; expected {accepted}" in str(err.value)
