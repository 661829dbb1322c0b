"""Every environment variable the installer reads, parsed and validated in one place.

Each setting is declared once, with its variable names, default and documentation; README's
table is checked against this list by the tests. A bad value raises `SettingsError` naming the
variable, the value and what is accepted. Nothing else in `installer/` reads `os.environ` for
configuration.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional
from urllib.parse import urlparse

from . import cuda
from .errors import SettingsError

DEFAULT_RELEASE_URL = "https://github.com/cudelta/cudelta/releases/download/v{version}"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(
        f"{name}={raw!r} is not a boolean; accepted (any case): 1, 0, true, false, yes, no, on, off"
    )


def parse_positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise SettingsError(f"{name}={raw!r} is not accepted; expected a whole number >= 1")
    return value


def parse_non_negative_int(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise SettingsError(f"{name}={raw!r} is not accepted; expected a whole number >= 0")
    return value


def parse_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SettingsError(f"{name}={raw!r} is not accepted; expected a number of seconds > 0")
    return value


def parse_kilobytes_per_second(name: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = -1.0
    # `not value >= 0` also refuses nan; inf would make every download too slow.
    if not value >= 0 or value == float("inf"):
        raise SettingsError(
            f"{name}={raw!r} is not accepted; expected a number of kilobytes per second >= 0 "
            "(e.g. 32; 0 turns the check off)"
        )
    return value


def parse_driver_cuda(name: str, raw: str) -> str:
    """'13.0', '130', 'cu130' -> '13.0'; 'cpu' / 'none' -> 'cpu' (pure-Python wheel)."""
    value = raw.strip().lower()
    if value in {"cpu", "none"}:
        return "cpu"
    try:
        return cuda.format_version(cuda.parse_user_version(value))
    except ValueError:
        raise SettingsError(
            f"{name}={raw!r} is not a CUDA version; accepted: 13.0, 130, cu130 (the CUDA version "
            "the target's NVIDIA driver supports, as nvidia-smi prints it) or cpu"
        ) from None


def parse_arch_list(name: str, raw: str) -> tuple[cuda.ArchTarget, ...]:
    """torch's TORCH_CUDA_ARCH_LIST syntax: '8.0;9.0a 10.0f+PTX' -> the three targets, parsed once."""
    items = cuda.split_arch_list(raw)
    targets, bad = [], []
    for item in items:
        try:
            targets.append(cuda.ArchTarget.parse(item))
        except ValueError:
            bad.append(item)
    if not items or bad:
        shown = ", ".join(repr(b) for b in bad) if bad else repr(raw)
        raise SettingsError(
            f"{name} has {shown}, which is not a compute capability; accepted: a list of "
            "MAJOR.MINOR with an optional a/f suffix and +PTX, separated by ';' or spaces, "
            "e.g. '8.0;9.0a;12.0f+PTX'"
        )
    return tuple(targets)


def parse_url(name: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    parsed = urlparse(value)
    if parsed.scheme not in {"http", "https", "file"} or (parsed.scheme != "file" and not parsed.netloc):
        raise SettingsError(
            f"{name}={raw!r} is not accepted; expected an http://, https:// or file:// URL of "
            "the folder that holds the release assets"
        )
    return value


def parse_path(name: str, raw: str) -> Path:
    if not raw.strip():
        raise SettingsError(f"{name} is empty; expected a directory path")
    return Path(raw.strip()).expanduser()


def parse_existing_file(name: str, raw: str) -> Path:
    path = Path(raw.strip()).expanduser()
    if not path.is_file():
        raise SettingsError(f"{name}={raw!r} is not an existing file; expected the path of a Python interpreter")
    return path


def parse_manifest_file(name: str, raw: str) -> Path:
    path = Path(raw.strip()).expanduser()
    if not path.is_file():
        raise SettingsError(f"{name}={raw!r} is not an existing file; expected the path of a release manifest.json")
    return path


def parse_ca_path(name: str, raw: str) -> Path:
    """A CA bundle (PEM file) or a folder of hashed certificates, as pip, requests and OpenSSL take."""
    try:
        path = Path(raw.strip()).expanduser()
        exists = path.exists()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a name too long, ~nosuchuser
        exists = False
    if not exists:
        raise SettingsError(
            f"{name}={raw!r} is not an existing file or folder; expected the path of a PEM file of CA "
            "certificates (or a folder of them)"
        )
    return path


def parse_proxy_url(name: str, raw: str) -> str:
    """'proxy:3128' (http:// assumed, as pip and requests do) or an http(s)/socks URL with a host."""
    value = raw.strip()
    if "://" not in value:
        value = "http://" + value
    try:
        parsed = urlparse(value)
        parsed.port  # noqa: B018  (raises on a port that is not a number or out of range)
        usable = parsed.scheme in {"http", "https", "socks4", "socks4a", "socks5", "socks5h"} and bool(parsed.hostname)
    except ValueError:  # also '[::1' and other broken hosts
        usable = False
    if not usable or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in value):
        raise SettingsError(
            f"{name} is not accepted ({_without_password(raw)!r}); expected a proxy URL such as "
            "http://proxy.example:3128 or http://user:password@proxy.example:3128"
        )
    return value


def _without_password(raw: str) -> str:
    # A proxy URL may carry a password; a refusal must not print it.
    head, at, tail = raw.strip().rpartition("@")
    if not at:
        return raw.strip()
    scheme, sep, _userinfo = head.rpartition("://")
    return f"{scheme}{sep}***@{tail}"


def parse_no_proxy(name: str, raw: str) -> tuple[str, ...]:
    """NO_PROXY: hosts, domains ('.corp'), IPs or networks, ':port' optional, separated by ',' or spaces."""
    entries = tuple(e for e in raw.replace(",", " ").split() if e)
    bad = [e for e in entries if any(ord(c) < 32 or ord(c) == 127 for c in e)]
    if bad:
        raise SettingsError(
            f"{name}={raw!r} is not accepted; expected host names, domains, IP addresses or networks "
            "separated by commas, e.g. localhost,.corp.example,10.0.0.0/8"
        )
    return entries


def _default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("cudelta", appauthor=False))


def _setting(
    *names: str,
    parse: Callable[[str, str], object],
    default: object = None,
    doc: str,
    secret: bool = False,
):
    return field(
        default=default,
        metadata={"env": names, "parse": parse, "doc": doc, "secret": secret},
    )


@dataclass(frozen=True)
class Settings:
    force_build: bool = _setting(
        "FORCE_BUILD", "CUDELTA_FORCE_BUILD", parse=parse_bool, default=False,
        doc="Compile locally; never download a prebuilt wheel (offline / air-gapped installs).",
    )
    no_build: bool = _setting(
        "CUDELTA_NO_BUILD", parse=parse_bool, default=False,
        doc="Fail with a clear error instead of compiling when no prebuilt wheel matches.",
    )
    offline: bool = _setting(
        "CUDELTA_OFFLINE", parse=parse_bool, default=False,
        doc="No network at all: only a `file://` CUDELTA_WHEEL_URL or the download cache is used.",
    )
    release_build: bool = _setting(
        "CUDELTA_RELEASE_BUILD", parse=parse_bool, default=False,
        doc="Release matrix: compile the full fat binary for all release archs and label the "
        "wheel `+cuXYZ` (implies FORCE_BUILD).",
    )
    wheel_url: Optional[str] = _setting(
        "CUDELTA_WHEEL_URL", parse=parse_url,
        doc="Replaces `https://github.com/cudelta/cudelta/releases/download/v<version>`: an "
        "http(s) mirror or a `file://` wheelhouse folder holding the assets and manifest.json.",
    )
    cache_dir: Optional[Path] = _setting(
        "CUDELTA_CACHE_DIR", parse=parse_path,
        doc="Download cache (default: the user cache dir, e.g. `~/.cache/cudelta`).",
    )
    driver_cuda: Optional[str] = _setting(
        "CUDELTA_DRIVER_CUDA", "CUDELTA_CUDA_VERSION", parse=parse_driver_cuda,
        doc="The driver CUDA version to choose a prebuilt wheel for (`12.8`, `13.0`, `cu130`), "
        "instead of the driver this build sees (none in an image build); `cpu`: the pure-Python "
        "wheel. `CUDELTA_CUDA_VERSION` is its old name.",
    )
    cuda_archs: Optional[tuple[cuda.ArchTarget, ...]] = _setting(
        "CUDELTA_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", parse=parse_arch_list,
        doc="Archs of a local build, e.g. `8.0;9.0a+PTX` (default: the GPUs present; all "
        "release archs when none is).",
    )
    max_jobs: Optional[int] = _setting(
        "MAX_JOBS", parse=parse_positive_int,
        doc="Parallel compile jobs of a local build (default: bounded by cores and free memory).",
    )
    target_python: Optional[Path] = _setting(
        "CUDELTA_TARGET_PYTHON", parse=parse_existing_file,
        doc="Interpreter the wheel is for, when the build runs under another (uv's build venv): "
        "its Python and glibc pick the wheel's tags, its torch is reported and used by a local compile.",
    )
    release_manifest: Optional[Path] = _setting(
        "CUDELTA_RELEASE_MANIFEST", parse=parse_manifest_file,
        doc="Release fan-in only: the release's `manifest.json`, embedded into the sdist so that "
        "installs verify downloads against what PyPI served, not against the download host.",
    )
    trust_downloaded_manifest: bool = _setting(
        "CUDELTA_TRUST_DOWNLOADED_MANIFEST", parse=parse_bool, default=False,
        doc="Verify against the `manifest.json` downloaded from CUDELTA_WHEEL_URL even when the "
        "sdist embeds one (a private mirror of your own builds).",
    )
    http_timeout: float = _setting(
        "CUDELTA_HTTP_TIMEOUT", parse=parse_seconds, default=30.0,
        doc="Read timeout in seconds for each download request (connect timeout: 10 s).",
    )
    http_retries: int = _setting(
        "CUDELTA_HTTP_RETRIES", parse=parse_non_negative_int, default=4,
        doc="Retries on connection errors, 5xx, 429 and 403-with-Retry-After, with backoff.",
    )
    # 300 s: the release wheel (~1.4 MB) arrives in seconds on any working link and in under a
    # minute at the minimum rate below; 300 s still fetches ~10 MB at that rate, and is the most
    # an install waits before it compiles instead (retries, Retry-After waits and redirects included).
    http_deadline: float = _setting(
        "CUDELTA_HTTP_DEADLINE", parse=parse_seconds, default=300.0,
        doc="Overall limit in seconds on fetching one file, retries and waits included; then the "
        "download fails and the install compiles instead.",
    )
    # 32 KB/s: a fifth of a slow mobile link; a server below it (1 KB/s takes 23 min for the wheel)
    # is stuck, not slow. Judged over a sliding 20 s window, once the body has flowed for 20 s.
    http_min_rate: float = _setting(
        "CUDELTA_HTTP_MIN_RATE", parse=parse_kilobytes_per_second, default=32.0,
        doc="Minimum download rate in KB/s, over any 20 s once a body has flowed for 20 s; a slower "
        "download fails (the install compiles instead). 0 turns the check off.",
    )
    # pip's and the networking libraries' own variables, read here so that the downloader reaches
    # the release the way pip reaches PyPI (installer/network.py holds the policy).
    pip_cert: Optional[Path] = _setting(
        "PIP_CERT", parse=parse_ca_path,
        doc="pip's: a CA bundle to trust for downloads, added to the system trust store (first of "
        "the CA files; pip's `--cert` on the command line does not reach a build, this does).",
    )
    ca_bundle: Optional[Path] = _setting(
        "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", parse=parse_ca_path,
        doc="requests' and curl's: a CA bundle to trust for downloads, when PIP_CERT is unset.",
    )
    ssl_cert_file: Optional[Path] = _setting(
        "SSL_CERT_FILE", parse=parse_ca_path,
        doc="OpenSSL's: a CA bundle to trust for downloads, when neither of the above is set.",
    )
    http_proxy: Optional[str] = _setting(
        "http_proxy", "HTTP_PROXY", parse=parse_proxy_url, secret=True,
        doc="The proxy of http:// downloads (lower case first, as curl reads it).",
    )
    https_proxy: Optional[str] = _setting(
        "https_proxy", "HTTPS_PROXY", parse=parse_proxy_url, secret=True,
        doc="The proxy of https:// downloads (GitHub, https mirrors).",
    )
    all_proxy: Optional[str] = _setting(
        "all_proxy", "ALL_PROXY", parse=parse_proxy_url, secret=True,
        doc="The proxy of downloads whose scheme has no variable of its own.",
    )
    pip_proxy: Optional[str] = _setting(
        "PIP_PROXY", parse=parse_proxy_url, secret=True,
        doc="pip's: the proxy of downloads when none of the above is set (pip's `--proxy` on the "
        "command line does not reach a build, this does).",
    )
    no_proxy: Optional[tuple[str, ...]] = _setting(
        "no_proxy", "NO_PROXY", parse=parse_no_proxy,
        doc="Hosts, domains and networks reached without a proxy. This machine (127.0.0.0/8, ::1, "
        "localhost) and `file://` mirrors are always reached directly.",
    )
    github_token: Optional[str] = _setting(
        "GITHUB_TOKEN", parse=lambda name, raw: raw.strip() or None, secret=True,
        doc="Sent as a bearer token to github.com hosts only (rate limits); never printed.",
    )

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            for name in f.metadata["env"]:
                raw = environ.get(name)
                if raw is not None and (raw.strip() or f.type in ("bool",)):
                    values[f.name] = f.metadata["parse"](name, raw)
                    break
        settings = cls(**values)
        if settings.release_build and not settings.force_build:
            settings = dataclasses.replace(settings, force_build=True)
        return settings

    @property
    def effective_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else _default_cache_dir()

    def release_url(self, version: str) -> str:
        return self.wheel_url or DEFAULT_RELEASE_URL.format(version=version)

    def __repr__(self) -> str:  # keeps the token out of logs and tracebacks
        shown = {
            f.name: ("***" if f.metadata["secret"] and getattr(self, f.name) else getattr(self, f.name))
            for f in dataclasses.fields(self)
        }
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def documented_variables() -> list[tuple[str, str, str]]:
    """(variable names, default, doc) for each setting, in declaration order (README's table)."""
    rows = []
    for f in dataclasses.fields(Settings):
        default = "unset" if f.default is None else repr(f.default)
        rows.append((" / ".join(f.metadata["env"]), default, f.metadata["doc"]))
    return rows
