"""Every setting against values no one can mean: each parses to a sane value or is refused in one
line that starts with the variable's name. Nothing else may come out: no other exception, no
value that crashes later (an infinite timeout overflowing the socket's, a URL with a space failing
as "invalid URL" without the variable, a driver CUDA 0.0 turned into "update your driver")."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import pytest

from installer.core import cuda
from installer.core.errors import SettingsError
from installer.core.settings import Settings

FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
THIS_FILE = str(Path(__file__).resolve())  # a regular file, not executable

# Tried on every variable of every setting.
HOSTILE_FOR_ALL = [
    "", " ", "\t\r\n", "\u3000",                                  # empty and whitespace only
    "inf", "-inf", "+Infinity", "nan", "NaN", "1e10", "-1e10", "1e309", "1e-320",
    "-1", "0", "-0", "0.0", "1", "4", " 4 ", "4.5", "0x10", "1_000", "9" * 40, "9" * 5000,
    "\x00", "1\x00", "a\x00b", "\x1b[31mred", "a\nb", "1\n", "\x7f", "\u202e1", "\u200b", "\ud800", "\udcff",
    "é", "١٢", "１", "😀", "x" * 10_000, "/", ".", "..", "~", "$HOME", "None", "null", "true",
    "-", "'", '"', "%00", "\\", "http://", "cpu",
]

BOOLEAN_CASES = ["maybe", "2", "ＴＲＵＥ", "yes please", "y", "t"]

# Field -> the values that probe its own edges. Every field must have an entry: a new setting
# without one fails test_every_setting_has_hostile_cases_and_a_sanity_rule.
HOSTILE: dict[str, list[str]] = {
    "force_build": BOOLEAN_CASES,
    "no_build": BOOLEAN_CASES,
    "offline": BOOLEAN_CASES,
    "release_build": BOOLEAN_CASES,
    "trust_downloaded_manifest": BOOLEAN_CASES,
    "explain": BOOLEAN_CASES,
    "wheel_url": [
        "http://exa mple.com/r", "https://h.example/a b", "http://h/\x00", "http://h/\x7f", "https://h/\u00a0x",
        "https://h/\u200bx", "http://[::1", "http://h:99999/", "http://h:-1/", "http://h:port/", "http://",
        "https:///path", "file://", "file:///", "file://server/share", "file:///srv/%00x", "ftp://h/x",
        "javascript:alert(1)", "http://h/x?sig=1", "http://h/x#frag", "http://h/x?", "http://" + "a" * 70 + ".com/",
        "http://😀.example/", "http://xn--.example/", "https://h/" + "a" * 9000, " https://h.example/r/ ",
        "https://user:pass@h.example/r", "http://[::1]:8000/r", "https://bücher.example/r", "releases/v0.1.0",
        "//h/x", "HTTP://H.EXAMPLE/R",
    ],
    "cache_dir": [
        "/tmp/a\x00b", "/tmp/a\nb", "/" + "a" * 300, "/a" * 2100, "~", "~/c", "relative/dir", "./c", "../c",
        "/tmp/\udcff", "/tmp/with space", "/tmp/\u202e",
    ],
    "driver_cuda": [
        "0.0", "0", "cu0", "9.2", "cu92", "13.10", "100.0", "99.9", "999", "cu1000", "13", "13.0.0", "-13.0",
        "13.-1", "1e1", "cpu ", "CPU", "none", "gpu", "cu13.0", "10.0", "12.8",
    ],
    "cuda_archs": [
        "0.0", "8.0a", "9.0f", "8.12", "100.0", "8.0;;", ";", " ; , ", "8.0+ptx+ptx", "sm_90", "Ampere", "8.0;8.0",
        "8.0,9.0a 10.0f+PTX", "-8.0", "8", "8.0" + ";8.0" * 5000, "12.0F+ptx",
    ],
    "max_jobs": ["0", "1025", "1024", "99999999999", "4.5", "1e3", "4 jobs", "-4", "+4"],
    "target_python": ["/", "/dev/null", "/nonexistent/python", THIS_FILE, sys.executable, sys.executable + "\x00",
                      "~/no-such-python", "/" + "p" * 5000],
    "release_manifest": ["/", "/dev/null", "/nonexistent/manifest.json", THIS_FILE, THIS_FILE + "\n\x00"],
    "http_timeout": ["0", "0.01", "0.1", "3600", "3601", "1e10", "30s", "-30"],
    "http_retries": ["-1", "100", "101", "1e2", "2.5", "99999999999999999999"],
    "http_deadline": ["0.5", "1", "86400", "86401", "1e10", "5min", "300 "],
    "http_min_rate": ["-1", "1e10", "1000000", "1000001", "32KB/s", "-0.0"],
    **{ca: ["/nonexistent/ca.pem", "relative/ca.pem", "/tmp/ca\x00.pem", "~nosuchuser/ca.pem", "/" + "c" * 5000,
            THIS_FILE, "/", "/etc/ssl/certs"] for ca in ("pip_cert", "ca_bundle", "ssl_cert_file")},
    **{proxy: ["proxy:3128", "http://proxy.example:3128", "http://user:s3cret@proxy:3128", "http://proxy:99999",
               "http://user:s3cret@proxy:99999", "http://user:s3cret@pro xy:1",
               "http://proxy:port", "http://[::1", "ftp://proxy:21", "http://pro xy:3128", "http://proxy\x00:3128",
               "socks5h://127.0.0.1:1080", "http://", "://", "https://proxy.example"]
       for proxy in ("http_proxy", "https_proxy", "all_proxy", "pip_proxy")},
    "no_proxy": ["*", "localhost,.corp.example,10.0.0.0/8", ",,,", "a\x00b", "host:8080", "\u202ehost", " , "],
    "github_token": ["ghp_ a", "ghp_\x00x", "ghp_é", "t" * 256, "t" * 255, "Bearer ghp_x", "ghp_ok123"],
}


def _finite_in(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, float) and math.isfinite(v) and low <= v <= high


def _int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= high


def _clean(text: str) -> bool:
    return text.isprintable() and "\x00" not in text


def _sane_url(v: Any) -> bool:
    p = urlparse(v)
    return (_clean(v) and " " not in v and len(v) <= 8000 and p.scheme in ("http", "https", "file")
            and not p.query and not p.fragment and bool(p.hostname or (p.scheme == "file" and p.path.strip("/"))))


def _sane_path(v: Any) -> bool:
    return isinstance(v, Path) and v.is_absolute() and _clean(str(v)) and len(os.fsencode(str(v))) < 4096


def _sane_driver(v: Any) -> bool:
    if not isinstance(v, cuda.DriverOverride):
        return False
    if v.cpu:
        return str(v) == "cpu"
    major, minor = v.version
    return type(major) is int and type(minor) is int and (10, 0) <= v.version <= (99, 9) and minor <= 9


def _sane_archs(v: Any) -> bool:
    return (isinstance(v, tuple) and 0 < len(v) == len(set(v))
            and all(isinstance(t, cuda.ArchTarget) and 1 <= t.major <= 99 and t.minor <= 9 for t in v))


def _or_unset(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


# Field -> what a parsed value must be to be usable where it is consumed.
SANE: dict[str, Callable[[Any], bool]] = {
    **{name: (lambda v: type(v) is bool) for name in
       ("force_build", "no_build", "offline", "release_build", "trust_downloaded_manifest", "explain")},
    "wheel_url": _or_unset(_sane_url),
    "cache_dir": _or_unset(_sane_path),
    "driver_cuda": _or_unset(_sane_driver),
    "cuda_archs": _or_unset(_sane_archs),
    "max_jobs": _or_unset(_int_in(1, 1024)),
    "target_python": _or_unset(lambda v: _sane_path(v) and v.is_file() and os.access(v, os.X_OK)),
    "release_manifest": _or_unset(lambda v: _sane_path(v) and v.is_file()),
    "http_timeout": _finite_in(0.1, 3600),
    "http_retries": _int_in(0, 100),
    "http_deadline": _finite_in(1, 86400),
    "http_min_rate": _finite_in(0, 1e6),
    "github_token": _or_unset(lambda v: bool(re.fullmatch(r"[\x21-\x7e]{1,255}", v))),
    **{ca: _or_unset(lambda v: _sane_path(v) and v.exists()) for ca in ("pip_cert", "ca_bundle", "ssl_cert_file")},
    **{proxy: _or_unset(lambda v: _clean(v) and " " not in v and bool(urlparse(v).hostname))
       for proxy in ("http_proxy", "https_proxy", "all_proxy", "pip_proxy")},
    "no_proxy": _or_unset(lambda v: isinstance(v, tuple) and all(e and _clean(e) and " " not in e for e in v)),
}

# A proxy URL is shown in a refusal (it names the host to fix), its password never.
PROXIES = ("http_proxy", "https_proxy", "all_proxy", "pip_proxy")
VARIABLES = [(field, name) for field, f in FIELDS.items() for name in f.metadata["env"]]


def _random_values(seed: str, count: int = 60) -> list[str]:
    """Strings drawn from digits, signs, separators, letters and the awkward characters above."""
    alphabet = "0123456789.+-eE;:/ ,_xaf\t\n\x00\x7fé١😀%?#[]@~" + "inf" + "nan" + "cu" + "PTX"
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def test_every_setting_has_hostile_cases_and_a_sanity_rule():
    assert set(HOSTILE) == set(FIELDS), f"fields without hostile cases: {set(FIELDS) - set(HOSTILE)}"
    assert set(SANE) == set(FIELDS), f"fields without a sanity rule: {set(FIELDS) - set(SANE)}"
    assert all(HOSTILE.values())


def test_the_defaults_are_sane():
    defaults = Settings()
    for field, sane in SANE.items():
        assert sane(getattr(defaults, field)), field


@pytest.mark.parametrize("field,name", VARIABLES, ids=[name for _, name in VARIABLES])
def test_each_value_parses_to_a_sane_value_or_is_refused_in_one_line_naming_the_variable(field, name):
    problems = []
    for raw in HOSTILE_FOR_ALL + HOSTILE[field] + _random_values(name):
        try:
            value = getattr(Settings.from_env({name: raw}), field)
        except SettingsError as exc:
            message = str(exc)
            if not message.startswith(name + (" " if FIELDS[field].metadata["secret"] else "")):
                problems.append(f"{raw!r}: the message does not start with {name}: {message!r}")
            elif not (message.isascii() and message.isprintable() and len(message) < 500):
                problems.append(f"{raw!r}: not one short printable ASCII line: {message!r}")
            elif field in PROXIES and "s3cret" in message:
                problems.append(f"{raw!r}: the proxy's password is shown: {message!r}")
            elif (FIELDS[field].metadata["secret"] and field not in PROXIES and len(raw.strip()) > 2
                  and raw.strip() in message):
                problems.append(f"{raw!r}: the secret is shown: {message!r}")
        else:
            if not SANE[field](value):
                problems.append(f"{raw!r}: accepted as {value!r}, which is not sane")
    assert not problems, "\n".join(problems)


# What issue 15 found, refused with the accepted range.
@pytest.mark.parametrize("name,raw,message", [
    ("CUDELTA_HTTP_TIMEOUT", "inf",
     "CUDELTA_HTTP_TIMEOUT='inf' is not accepted; expected a number of seconds from 0.1 to 3600"),
    ("CUDELTA_HTTP_DEADLINE", "inf",
     "CUDELTA_HTTP_DEADLINE='inf' is not accepted; expected a number of seconds from 1 to 86400"),
    ("CUDELTA_HTTP_DEADLINE", "1e10",
     "CUDELTA_HTTP_DEADLINE='1e10' is not accepted; expected a number of seconds from 1 to 86400"),
    ("CUDELTA_HTTP_TIMEOUT", "1e10",
     "CUDELTA_HTTP_TIMEOUT='1e10' is not accepted; expected a number of seconds from 0.1 to 3600"),
    ("CUDELTA_WHEEL_URL", "https://mirror .example/r",
     "CUDELTA_WHEEL_URL='https://mirror .example/r' is not accepted (it holds a space (U+0020) at position 15); "
     "expected an http://, https:// or file:// URL of the folder that holds the release assets"),
    ("CUDELTA_WHEEL_URL", "https://mirror.example/my releases",
     "CUDELTA_WHEEL_URL='https://mirror.example/my releases' is not accepted (it holds a space (U+0020) at "
     "position 26)"),
    ("CUDELTA_WHEEL_URL", "https://mirror.example/r\x07",
     "CUDELTA_WHEEL_URL='https://mirror.example/r\\x07' is not accepted (it holds a control character (U+0007) "
     "at position 25)"),
    ("CUDELTA_DRIVER_CUDA", "0.0",
     "CUDELTA_DRIVER_CUDA='0.0' is not a CUDA version an NVIDIA driver reports; accepted: 10.0 to 99.9, the CUDA "
     "version the target's NVIDIA driver supports as nvidia-smi prints it (13.0, also 130 or cu130), or cpu"),
    ("MAX_JOBS", "99999999999", "MAX_JOBS='99999999999' is not accepted; expected a whole number of compile jobs "
     "from 1 to 1024"),
    ("CUDELTA_HTTP_RETRIES", "1000000", "CUDELTA_HTTP_RETRIES='1000000' is not accepted; expected a whole number "
     "of retries from 0 to 100"),
    ("CUDELTA_HTTP_MIN_RATE", "1e10", "CUDELTA_HTTP_MIN_RATE='1e10' is not accepted; expected a number of kilobytes "
     "per second from 0 to 1000000 (e.g. 32; 0 turns the check off)"),
    ("CUDELTA_CACHE_DIR", "/srv/cache\x00", "CUDELTA_CACHE_DIR='/srv/cache\\x00' holds a NUL (U+0000) at position "
     "11; expected a directory path"),
    ("CUDELTA_CACHE_DIR", "~no-such-user-here/cache", "CUDELTA_CACHE_DIR='~no-such-user-here/cache' names the home "
     "folder of a user this machine does not know ('~no-such-user-here'); expected a directory path"),
    ("CUDELTA_CACHE_DIR", "cudelta-cache", "CUDELTA_CACHE_DIR='cudelta-cache' is a relative path, which pip and uv "
     "would resolve in their temporary build folder; expected a directory path, absolute (or starting with ~/)"),
    ("CUDELTA_TARGET_PYTHON", "/", "CUDELTA_TARGET_PYTHON='/' is a directory; expected the path of a Python "
     "interpreter (e.g. .venv/bin/python)"),
    ("CUDELTA_TARGET_PYTHON", THIS_FILE, f"CUDELTA_TARGET_PYTHON={THIS_FILE!r} is not executable"),
    ("TORCH_CUDA_ARCH_LIST", "8.0;0.0", "TORCH_CUDA_ARCH_LIST has '0.0', not a compute capability; accepted:"),
    ("TORCH_CUDA_ARCH_LIST", "8.0a", "TORCH_CUDA_ARCH_LIST has '8.0a', an 'a' target below 9.0, which no GPU has"),
    ("CUDELTA_CUDA_ARCHS", "8.10", "CUDELTA_CUDA_ARCHS has '8.10', not a compute capability"),
    ("GITHUB_TOKEN", "ghp_abc\ndef", "GITHUB_TOKEN is not accepted (its value is not shown: 11 characters, a space, "
     "control or non-ASCII character among them)"),
])
def test_what_no_one_can_mean_is_refused_with_what_is_accepted(name, raw, message):
    with pytest.raises(SettingsError) as err:
        Settings.from_env({name: raw})
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("name,raw,field,expected", [
    ("CUDELTA_HTTP_TIMEOUT", "0.1", "http_timeout", 0.1),
    ("CUDELTA_HTTP_DEADLINE", "86400", "http_deadline", 86400.0),
    ("CUDELTA_HTTP_RETRIES", "100", "http_retries", 100),
    ("MAX_JOBS", " 64 ", "max_jobs", 64),
    ("CUDELTA_DRIVER_CUDA", "cu100", "driver_cuda", cuda.DriverOverride((10, 0))),
    ("CUDELTA_DRIVER_CUDA", "12.9", "driver_cuda", cuda.DriverOverride((12, 9))),
    ("CUDELTA_WHEEL_URL", "http://[::1]:8000/releases/", "wheel_url", "http://[::1]:8000/releases"),
    ("CUDELTA_WHEEL_URL", "https://bücher.example/r", "wheel_url", "https://bücher.example/r"),
    ("CUDELTA_WHEEL_URL", "file:///srv/wheel%20house/", "wheel_url", "file:///srv/wheel%20house"),
    ("CUDELTA_CACHE_DIR", "/srv/my cache", "cache_dir", Path("/srv/my cache")),
    ("CUDELTA_TARGET_PYTHON", sys.executable, "target_python", Path(sys.executable)),
    ("CUDELTA_CACHE_DIR", "~/.cache/cudelta", "cache_dir", Path.home() / ".cache" / "cudelta"),
])
def test_the_edges_of_each_range_and_real_world_spellings_are_accepted(name, raw, field, expected):
    assert getattr(Settings.from_env({name: raw}), field) == expected


def test_a_repeated_arch_is_compiled_once():
    archs = Settings.from_env({"TORCH_CUDA_ARCH_LIST": "8.0;9.0a;8.0"}).cuda_archs
    assert [str(a) for a in archs] == ["8.0", "9.0a"]
