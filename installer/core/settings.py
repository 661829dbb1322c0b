"""Every environment variable the installer reads, parsed and validated in one place.

Each setting is declared once, with its variable names, default and documentation; README's
table is checked against this list by the tests. A bad value raises `SettingsError` naming the
variable, the value and what is accepted, in one line; a value no one can mean (an infinite
timeout, a URL with a space, a driver CUDA 0.0) is refused here, before any work. Nothing else
in `installer/` reads `os.environ` for configuration.
"""

from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional
from urllib.parse import unquote, urlparse

from . import cuda
from .errors import SettingsError

DEFAULT_RELEASE_URL = "https://github.com/cudelta/cudelta/releases/download/v{version}"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# The ranges below are what a person can mean; a value outside one is a typo or a unit mix-up
# (ms for s, B/s for KB/s), and it is refused before any work rather than met half-way later.
# The read timeout: a server silent for an hour is dead, and under 0.1 s a healthy one times out.
TIMEOUT_RANGE_S = (0.1, 3600.0)
# One file's deadline: under 1 s nothing downloads; a day is more than any install waits.
# (inf or 1e10 would overflow the socket timeout: `timestamp out of range for platform time_t`.)
DEADLINE_RANGE_S = (1.0, 86400.0)
# The minimum rate: 1 GB/s (8 Gbit/s) sustained for one file is beyond most links to GitHub.
MIN_RATE_MAX_KBPS = 1_000_000.0
# Retries back off exponentially within one deadline: past a few dozen they cannot happen.
MAX_HTTP_RETRIES = 100
# An nvcc job of this build peaks near 1.5 GiB (installer/compile/native.py): 1024 jobs need 1.5 TiB.
MAX_JOBS_LIMIT = 1024
# Drivers report their CUDA version (nvidia-smi's header, cuDriverGetVersion) since 10.0 (R410),
# and the version's minor is one digit: the wheel label cu130 is 13.0 (installer/core/cuda.py).
DRIVER_CUDA_FLOOR = (10, 0)
DRIVER_CUDA_MAJOR_MAX = 99
# A URL's length: RFC 9110 asks servers to take at least 8000 octets in the request line.
MAX_URL_CHARS = 8000
# Linux's PATH_MAX (with the NUL) and NAME_MAX, in bytes of the filesystem encoding.
MAX_PATH_BYTES, MAX_NAME_BYTES = 4095, 255
# GitHub's tokens are ASCII letters, digits and '_' (ghp_..., github_pat_...), at most 255 long.
MAX_TOKEN_CHARS = 255


def shown(raw: str) -> str:
    """The value as an error message shows it: quoted, escaped to ASCII (no newline, no control
    character, no encoding error on a plain terminal) and cut short when long."""
    if len(raw) <= 80:
        return ascii(raw)
    return f"{ascii(raw[:60])}... ({len(raw)} characters)"


def _bad_character(text: str, *, space_ok: bool = False) -> Optional[str]:
    """'a space (U+0020) at position 9' for the first whitespace, control or format character."""
    for i, ch in enumerate(text):
        category = unicodedata.category(ch)
        if (ch.isspace() and not space_ok) or category in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            what = "a space" if ch == " " else "a NUL" if ch == "\0" else "a whitespace" if ch.isspace() else (
                "a control character" if category == "Cc" else "an invisible character")
            return f"{what} (U+{ord(ch):04X}) at position {i + 1}"
    return None


def _number(raw: str, kind: Callable[[str], float]) -> Optional[float]:
    try:
        return kind(raw.strip())
    except (ValueError, OverflowError):  # int() refuses over 4300 digits with ValueError
        return None


def parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(
        f"{name}={shown(raw)} is not a boolean; accepted (any case): 1, 0, true, false, yes, no, on, off"
    )


def _int_in(name: str, raw: str, low: int, high: int, what: str) -> int:
    value = _number(raw, int)
    if value is None or not low <= value <= high:
        raise SettingsError(f"{name}={shown(raw)} is not accepted; expected {what} from {low} to {high}")
    return int(value)


def parse_max_jobs(name: str, raw: str) -> int:
    return _int_in(name, raw, 1, MAX_JOBS_LIMIT, "a whole number of compile jobs")


def parse_retries(name: str, raw: str) -> int:
    return _int_in(name, raw, 0, MAX_HTTP_RETRIES, "a whole number of retries")


def _seconds_in(name: str, raw: str, bounds: tuple[float, float]) -> float:
    value = _number(raw, float)
    if value is None or not bounds[0] <= value <= bounds[1]:  # also refuses nan
        raise SettingsError(
            f"{name}={shown(raw)} is not accepted; expected a number of seconds from {bounds[0]:g} to {bounds[1]:g}"
        )
    return value


def parse_timeout(name: str, raw: str) -> float:
    return _seconds_in(name, raw, TIMEOUT_RANGE_S)


def parse_deadline(name: str, raw: str) -> float:
    return _seconds_in(name, raw, DEADLINE_RANGE_S)


def parse_kilobytes_per_second(name: str, raw: str) -> float:
    value = _number(raw, float)
    # `not 0 <= value` also refuses nan; a rate no link sustains would fail every download.
    if value is None or not 0 <= value <= MIN_RATE_MAX_KBPS:
        raise SettingsError(
            f"{name}={shown(raw)} is not accepted; expected a number of kilobytes per second from 0 to "
            f"{MIN_RATE_MAX_KBPS:.0f} (e.g. 32; 0 turns the check off)"
        )
    return value


def parse_driver_cuda(name: str, raw: str) -> cuda.DriverOverride:
    """'13.0', '130', 'cu130' -> (13, 0); 'cpu' / 'none' -> cpu (the pure-Python wheel)."""
    value = raw.strip().lower()
    if value in {"cpu", "none"}:
        return cuda.DriverOverride(None)
    accepted = (f"accepted: {cuda.format_version(DRIVER_CUDA_FLOOR)} to {DRIVER_CUDA_MAJOR_MAX}.9, the CUDA "
                "version the target's NVIDIA driver supports as nvidia-smi prints it (13.0, also 130 or cu130), "
                "or cpu")
    try:
        version = cuda.parse_user_version(value)
    except ValueError:
        raise SettingsError(f"{name}={shown(raw)} is not a CUDA version; {accepted}") from None
    if not (DRIVER_CUDA_FLOOR <= version and version[0] <= DRIVER_CUDA_MAJOR_MAX and version[1] <= 9):
        raise SettingsError(f"{name}={shown(raw)} is not a CUDA version an NVIDIA driver reports; {accepted}")
    return cuda.DriverOverride(version)


def _arch_problem(target: cuda.ArchTarget) -> Optional[str]:
    # Compute capabilities run from 1.0 up with a one-digit minor (sm_90 is 9.0); arch-specific
    # 'a' targets exist from 9.0 (sm_90a), family 'f' targets from 10.0 (CUDA 12.9).
    if not 1 <= target.major <= 99 or target.minor > 9:
        return "not a compute capability"
    if target.suffix == "a" and target.major < 9:
        return "an 'a' target below 9.0, which no GPU has"
    if target.suffix == "f" and target.major < 10:
        return "an 'f' target below 10.0, which no GPU has"
    return None


def parse_arch_list(name: str, raw: str) -> tuple[cuda.ArchTarget, ...]:
    """torch's TORCH_CUDA_ARCH_LIST syntax: '8.0;9.0a 10.0f+PTX' -> the three targets, parsed once."""
    items = cuda.split_arch_list(raw)
    targets: list[cuda.ArchTarget] = []
    bad: list[str] = []
    why = "not a compute capability"
    for item in items:
        try:
            target = cuda.ArchTarget.parse(item)
        except ValueError:
            bad.append(item)
            continue
        problem = _arch_problem(target)
        if problem:
            bad.append(item)
            why = problem
        elif target not in targets:  # '8.0;8.0' would ask nvcc for the same cubin twice
            targets.append(target)
    if not items or bad:
        listed = ", ".join(shown(b) for b in bad[:3]) if bad else shown(raw)
        raise SettingsError(
            f"{name} has {listed}, {why}; accepted: a list of MAJOR.MINOR with an optional a/f suffix "
            "and +PTX, separated by ';' or spaces, e.g. '8.0;9.0a;12.0f+PTX'"
        )
    return tuple(targets)


def _url_problem(value: str) -> Optional[str]:
    """Why `value` cannot be the URL of a release folder; None if it can."""
    if len(value) > MAX_URL_CHARS:
        return f"it is {len(value)} characters long, more than {MAX_URL_CHARS}"
    bad = _bad_character(value)
    if bad:
        return f"it holds {bad}"
    try:
        parsed = urlparse(value)
        parsed.port  # noqa: B018  (raises ValueError for a port that is not one)
    except ValueError as exc:
        return f"it does not parse: {exc}"
    if parsed.scheme not in {"http", "https", "file"}:
        return f"its scheme {parsed.scheme!r} is not http, https or file" if parsed.scheme else "it has no scheme"
    if parsed.query or parsed.fragment or "?" in value or "#" in value:
        return "asset names are appended to its path, so it cannot carry a ?query or #fragment"
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            return f"a file:// URL names a local folder, not the host {ascii(parsed.netloc)}"
        if not parsed.path.strip("/"):
            return "it names no folder"
        if _bad_character(unquote(parsed.path), space_ok=True):
            return "its path decodes to a control character"
        return None
    if not parsed.hostname:
        return "it names no host"
    return _host_problem(parsed.hostname)


def _host_problem(host: str) -> Optional[str]:
    if host.isascii():
        return None
    # requests sends a non-ASCII host IDNA-encoded (IDNA 2008 with UTS 46 mapping), with this
    # package; a name it cannot encode would fail later as "invalid URL", without the variable.
    try:
        import idna

        idna.encode(host, uts46=True)
    except ImportError:
        return f"write the host {ascii(host)} in its ASCII (xn--) form"
    except (idna.IDNAError, UnicodeError, ValueError):
        return f"{ascii(host)} is not a valid host name"
    return None


def parse_url(name: str, raw: str) -> str:
    value = raw.strip().rstrip("/")
    problem = _url_problem(value)
    if problem:
        raise SettingsError(
            f"{name}={shown(raw)} is not accepted ({problem}); expected an http://, https:// or file:// URL of "
            "the folder that holds the release assets"
        )
    return value


def _path_problem(value: str) -> Optional[str]:
    bad = _bad_character(value, space_ok=True)
    if bad:
        return f"holds {bad}"
    try:
        encoded = os.fsencode(value)
    except UnicodeError:
        return "cannot be written in the filesystem's encoding"
    if len(encoded) > MAX_PATH_BYTES:
        return f"is {len(encoded)} bytes long, more than a path can be ({MAX_PATH_BYTES})"
    if any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        return f"has a name longer than a file name can be ({MAX_NAME_BYTES} bytes)"
    return None


def _checked_path(name: str, raw: str, expected: str) -> Path:
    value = raw.strip()
    problem = "is empty" if not value else _path_problem(value)
    if problem:
        raise SettingsError(f"{name}={shown(raw)} {problem}; expected {expected}")
    # pathlib raises RuntimeError for '~user' of an unknown user; os.path leaves it as it is.
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise SettingsError(f"{name}={shown(raw)} names the home folder of a user this machine does not know "
                            f"({shown(value.split('/')[0])}); expected {expected}")
    if not os.path.isabs(expanded):
        # pip and uv run the build in a temporary copy of the sdist: a relative path would name a
        # folder inside it, gone after the install, not the one the user sees.
        raise SettingsError(f"{name}={shown(raw)} is a relative path, which pip and uv would resolve in their "
                            f"temporary build folder; expected {expected}, absolute (or starting with ~/)")
    return Path(expanded)


def parse_path(name: str, raw: str) -> Path:
    return _checked_path(name, raw, "a directory path")


def parse_existing_file(name: str, raw: str) -> Path:
    expected = "the path of a Python interpreter"
    path = _checked_path(name, raw, expected)
    if path.is_dir():
        raise SettingsError(f"{name}={shown(raw)} is a directory; expected {expected} (e.g. .venv/bin/python)")
    if not path.is_file():
        raise SettingsError(f"{name}={shown(raw)} is not an existing file; expected {expected}")
    if not os.access(path, os.X_OK):
        raise SettingsError(f"{name}={shown(raw)} is not executable; expected {expected}")
    return path


def parse_manifest_file(name: str, raw: str) -> Path:
    expected = "the path of a release manifest.json"
    path = _checked_path(name, raw, expected)
    if not path.is_file():
        raise SettingsError(f"{name}={shown(raw)} is not an existing file; expected {expected}")
    if not os.access(path, os.R_OK):
        raise SettingsError(f"{name}={shown(raw)} is not readable; expected {expected}")
    return path


def parse_token(name: str, raw: str) -> Optional[str]:
    """A GitHub token; its value is never shown, not even in the refusal."""
    value = raw.strip()
    if not value:
        return None
    if len(value) > MAX_TOKEN_CHARS or not re.fullmatch(r"[\x21-\x7e]+", value):
        why = "too many" if len(value) > MAX_TOKEN_CHARS else "a space, control or non-ASCII character among them"
        raise SettingsError(
            f"{name} is not accepted (its value is not shown: {len(value)} characters, {why}); expected a "
            f"GitHub token (ASCII letters, digits and _, at most {MAX_TOKEN_CHARS} characters) or unset"
        )
    return value


def parse_ca_path(name: str, raw: str) -> Path:
    """A CA bundle (PEM file) or a folder of hashed certificates, as pip, requests and OpenSSL take."""
    expected = "the path of a PEM file of CA certificates (or a folder of them)"
    path = Path(_checked_path(name, raw, expected))
    if not path.exists():
        raise SettingsError(f"{name}={shown(raw)} is not an existing file or folder; expected {expected}")
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
    if not usable or _bad_character(value) is not None:
        raise SettingsError(
            f"{name} is not accepted ({shown(_without_password(raw))}); expected a proxy URL such as "
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
    bad = [e for e in entries if _bad_character(e) is not None]
    if bad:
        raise SettingsError(
            f"{name}={shown(raw)} is not accepted; expected host names, domains, IP addresses or networks "
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
        doc="Download cache, an absolute path or `~/...` (default: the user cache dir, e.g. "
        "`~/.cache/cudelta`).",
    )
    driver_cuda: Optional[cuda.DriverOverride] = _setting(
        "CUDELTA_DRIVER_CUDA", "CUDELTA_CUDA_VERSION", parse=parse_driver_cuda,
        doc="The driver CUDA version to choose a prebuilt wheel for (`12.8`, `13.0`, `cu130`; 10.0 to "
        "99.9, as nvidia-smi prints it), instead of the driver this build sees (none in an image "
        "build); `cpu`: the pure-Python wheel. `CUDELTA_CUDA_VERSION` is its old name.",
    )
    cuda_archs: Optional[tuple[cuda.ArchTarget, ...]] = _setting(
        "CUDELTA_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", parse=parse_arch_list,
        doc="Archs of a local build, e.g. `8.0;9.0a+PTX` (`a` from 9.0, `f` from 10.0; default: the GPUs "
        "present; all release archs when none is).",
    )
    max_jobs: Optional[int] = _setting(
        "MAX_JOBS", parse=parse_max_jobs,
        doc="Parallel compile jobs of a local build, 1 to 1024 (default: bounded by cores and free memory).",
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
        "CUDELTA_HTTP_TIMEOUT", parse=parse_timeout, default=30.0,
        doc="Read timeout in seconds for each download request, 0.1 to 3600 (connect timeout: 10 s).",
    )
    http_retries: int = _setting(
        "CUDELTA_HTTP_RETRIES", parse=parse_retries, default=4,
        doc="Retries on connection errors, 5xx, 429 and 403-with-Retry-After, with backoff; 0 to 100.",
    )
    # 300 s: the release wheel (~1.4 MB) arrives in seconds on any working link and in under a
    # minute at the minimum rate below; 300 s still fetches ~10 MB at that rate, and is the most
    # an install waits before it compiles instead (retries, Retry-After waits and redirects included).
    http_deadline: float = _setting(
        "CUDELTA_HTTP_DEADLINE", parse=parse_deadline, default=300.0,
        doc="Overall limit in seconds on fetching one file, retries and waits included, 1 to 86400; then "
        "the download fails and the install compiles instead.",
    )
    # 32 KB/s: a fifth of a slow mobile link; a server below it (1 KB/s takes 23 min for the wheel)
    # is stuck, not slow. Judged over a sliding 20 s window, once the body has flowed for 20 s.
    http_min_rate: float = _setting(
        "CUDELTA_HTTP_MIN_RATE", parse=parse_kilobytes_per_second, default=32.0,
        doc="Minimum download rate in KB/s (0 to 1000000), over any 20 s once a body has flowed for 20 s; "
        "a slower download fails (the install compiles instead). 0 turns the check off.",
    )
    explain: bool = _setting(
        "CUDELTA_EXPLAIN", parse=parse_bool, default=False,
        doc="Print every release asset with its verdict (chosen, fits, or the rule it failed) into "
        "the build log; `python -m cudelta` shows the same after the install.",
    )
    # pip's and the networking libraries' own variables, read here so that the downloader reaches
    # the release the way pip reaches PyPI (installer/fetch/network.py holds the policy).
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
        "GITHUB_TOKEN", parse=parse_token, secret=True,
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
