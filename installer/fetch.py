"""Download release files (the manifest and wheels) from GitHub Releases, a mirror or a wheelhouse.

Everything that can go wrong on the network ends here as a `FetchError` or `VerificationError`
whose message says what was fetched, what happened and how many attempts were made, so the
pipeline can print one line and fall back to a local build. Raw requests/urllib3 exceptions
never escape: their text and tracebacks mean nothing to someone running `pip install`.

Wheels land in a content-addressed cache, `<cache_dir>/<sha256>/<name>`: the digest comes from
the release manifest, so two releases (or a mirror and GitHub) can never hand each other a file,
and a file only ever appears under its final name after its digest has been checked.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional
from urllib.parse import quote, urlparse, urlunparse
from urllib.request import url2pathname

import filelock
import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import (
    ConnectTimeoutError,
    InvalidHeader,
    MaxRetryError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    ResponseError,
)
from urllib3.util.retry import Retry

from .errors import FetchError, VerificationError
from .log import say
from .settings import Settings
from .verify import CHUNK_SIZE, require_sha256, verify_file

CONNECT_TIMEOUT_S = 10.0
# Long enough for another pip process to finish downloading a large wheel over a slow link.
LOCK_TIMEOUT_S = 600.0
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# The token raises GitHub's rate limit; any other host (a mirror, the storage host GitHub
# redirects to) must never see it.
TOKEN_HOSTS = frozenset({"github.com", "api.github.com"})
PARTIAL_PREFIX = ".partial-"
# "<urllib3.connection.HTTPConnection object at 0x...>: " or "HTTPSConnection(host='h', port=443): "
_URLLIB3_PREFIX = re.compile(r"^(<[^>]*>|HTTPS?Connection(Pool)?\([^)]*\)): ")


class CappedRetry(Retry):
    """urllib3's Retry with GitHub's rate limiting in mind.

    GitHub answers a (secondary) rate limit with 403 + Retry-After, so 403 is retried, but only
    when that header is there: a plain 403 is a permission problem that retrying cannot fix.
    A Retry-After up to `max_retry_after` seconds is waited for; a longer one ends the retries at
    once, so a limit that resets in an hour makes the install fall back in seconds, not hang pip.
    """

    RETRY_AFTER_STATUS_CODES = Retry.RETRY_AFTER_STATUS_CODES | frozenset({403})

    def __init__(self, *args: Any, max_retry_after: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_retry_after = max_retry_after

    def new(self, **kw: Any) -> "CappedRetry":
        # urllib3 copies the policy on every attempt through new(); keep our field across it.
        kw.setdefault("max_retry_after", self.max_retry_after)
        return super().new(**kw)

    def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
        # A limit that resets later than the cap is not waited for at all: the caller gets this
        # response now and falls back (or says GITHUB_TOKEN) instead of sleeping through retries.
        header = response.headers.get("Retry-After") if response is not None else None
        if header is not None:
            try:
                wait = super().parse_retry_after(header)
            except InvalidHeader:
                wait = 0.0
            if wait > self.max_retry_after:
                raise MaxRetryError(_pool, url, ResponseError(
                    f"Retry-After {wait:.0f} s is longer than the {self.max_retry_after:.0f} s we wait"))
        return super().increment(method, url, response, error, _pool, _stacktrace)

    def parse_retry_after(self, retry_after: str) -> float:
        try:
            seconds = super().parse_retry_after(retry_after)
        except InvalidHeader:
            # 0 makes sleep() fall back to the exponential backoff instead of raising mid-request.
            return 0.0
        return min(seconds, self.max_retry_after)


def make_retry(retries: int, backoff_factor: float, max_retry_after: float) -> CappedRetry:
    """The retry policy of every request: bounded, idempotent methods only, final response kept."""
    return CappedRetry(
        total=retries,
        connect=retries,
        read=retries,
        status=retries,
        status_forcelist=RETRY_STATUSES,
        allowed_methods=frozenset({"GET", "HEAD"}),
        backoff_factor=backoff_factor,
        respect_retry_after_header=True,
        # After the last retry we want the response itself, to report its status.
        raise_on_status=False,
        max_retry_after=max_retry_after,
    )


def asset_url(base_url: str, name: str) -> str:
    # '+' (the wheel's local version label) must be escaped: S3-style hosts read it as a space.
    return base_url.rstrip("/") + "/" + quote(name, safe="")


def is_file_url(url: str) -> bool:
    return urlparse(url).scheme == "file"


def file_url_path(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise FetchError(
            f"{url} names the host {parsed.netloc!r}; a file:// URL must be a local folder "
            "(file:///path/to/wheelhouse)"
        )
    return Path(url2pathname(parsed.path))


def display_url(url: str) -> str:
    """The URL as messages show it: no user:password, no query (signed URLs carry secrets there)."""
    parsed = urlparse(url)
    host = parsed.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parsed.port:
        host += f":{parsed.port}"
    return urlunparse((parsed.scheme, host, parsed.path, "", "", ""))


def auth_headers(url: str, token: Optional[str]) -> dict[str, str]:
    """The bearer token, for an https github.com URL only; requests drops it on a redirect elsewhere."""
    parsed = urlparse(url)
    if token and parsed.scheme == "https" and parsed.hostname in TOKEN_HOSTS and parsed.port in (None, 443):
        return {"Authorization": f"Bearer {token}"}
    return {}


def check_asset_name(name: str) -> None:
    """The manifest is remote data and the name becomes a path: allow a plain file name only."""
    if (
        not name
        or name.startswith(".")
        or any(sep in name for sep in ("/", "\\", "\0"))
    ):
        raise FetchError(f"the release manifest names an asset {name!r}, which is not a plain file name; refusing it")


def write_verified(
    chunks: Iterable[bytes], target: Path, sha256: str, size: Optional[int], what: str
) -> None:
    """Write `chunks` beside `target`, verify, then rename into place.

    The rename is atomic within a folder, so `target` either does not exist or holds a verified
    file; whatever fails (network, disk, checksum, Ctrl-C) removes the partial file.
    """
    tmp = tempfile.NamedTemporaryFile(dir=target.parent, delete=False, prefix=PARTIAL_PREFIX)
    tmp_path = Path(tmp.name)
    try:
        with tmp:
            for chunk in chunks:
                tmp.write(chunk)
            tmp.flush()
            os.fsync(tmp.fileno())
        verify_file(tmp_path, sha256, size, what)
        # NamedTemporaryFile is 0600; a cache shared between users must stay readable.
        os.chmod(tmp_path, 0o644)
        os.replace(tmp_path, target)
    except BaseException:
        with suppress(OSError):
            tmp_path.unlink()
        raise


def remove_partials(folder: Path) -> None:
    """Partial files of processes that were killed; safe only while holding the folder's lock."""
    for path in folder.glob(PARTIAL_PREFIX + "*"):
        with suppress(OSError):
            path.unlink()


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and everything it wraps: requests keeps urllib3's error in args, urllib3 in .reason."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        wrapped = [getattr(current, "reason", None), current.__cause__, current.__context__, *current.args]
        stack.extend(w for w in wrapped if isinstance(w, BaseException))


def _reason_text(exc: BaseException) -> str:
    """urllib3 prefixes messages with a pool or connection repr; keep only the words after it."""
    return _URLLIB3_PREFIX.sub("", str(exc), count=1)


def describe_error(exc: BaseException, connect_timeout: float, read_timeout: float) -> str:
    """A network exception in words, e.g. 'timed out after 30 s waiting for data'."""
    causes = list(_causes(exc))

    def find(*types: type) -> Optional[BaseException]:
        return next((c for c in causes if isinstance(c, types)), None)

    # Order matters: urllib3's NewConnectionError subclasses ConnectTimeoutError.
    if find(requests.exceptions.SSLError, ssl.SSLError) is not None:
        found = find(ssl.SSLError)
        detail = f" {getattr(found, 'reason', None) or ''}".rstrip() if found is not None else ""
        return f"TLS error{detail} (check the CA certificates, or REQUESTS_CA_BUNDLE behind a proxy)"
    if find(requests.exceptions.ProxyError) is not None:
        return "could not reach the proxy (check HTTPS_PROXY / NO_PROXY)"
    if (found := find(NewConnectionError)) is not None:
        return f"could not connect ({_reason_text(found)})"
    if find(requests.exceptions.ConnectTimeout, ConnectTimeoutError) is not None:
        return f"connection timed out after {connect_timeout:g} s"
    if find(requests.exceptions.ReadTimeout, ReadTimeoutError, TimeoutError) is not None:
        return f"timed out after {read_timeout:g} s waiting for data"
    if (found := find(requests.exceptions.ChunkedEncodingError, ProtocolError)) is not None:
        inner = next((c for c in causes if not isinstance(c, (requests.RequestException, ProtocolError))), found)
        return f"connection broken while reading the response ({_reason_text(inner)})"
    if find(requests.exceptions.ContentDecodingError) is not None:
        return "could not decode the response body"
    if find(requests.exceptions.TooManyRedirects) is not None:
        return "too many redirects"
    if find(requests.exceptions.InvalidURL, requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema) is not None:
        return "invalid URL"
    if find(requests.exceptions.ConnectionError) is not None:
        return "connection error"
    return f"network error ({type(exc).__name__})"


def attempts_for_error(exc: BaseException, retry: Retry) -> int:
    # urllib3 raises MaxRetryError only once the policy is used up, i.e. after total + 1 tries.
    if any(isinstance(c, MaxRetryError) for c in _causes(exc)):
        return int(retry.total or 0) + 1
    return 1


def attempts_for_response(response: requests.Response, retry: Retry) -> int:
    """Tries made on the final hop: urllib3 records retries in the response's history; a status
    the policy retries on that still came back means the policy was used up."""
    history = getattr(getattr(response.raw, "retries", None), "history", ()) or ()
    made = len(history) + 1
    if retry.is_retry("GET", response.status_code, bool(response.headers.get("Retry-After"))):
        made = max(made, int(retry.total or 0) + 1)
    return made


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _megabytes(size: Optional[int]) -> str:
    return "size unknown" if size is None else f"{size / 1e6:.1f} MB"


def _status_hint(response: requests.Response, url: str, has_token: bool) -> str:
    retry_after = response.headers.get("Retry-After")
    hints = []
    if retry_after and response.status_code in (403, 429, 503):
        hints.append(f"the server asks to retry after {retry_after} s")
    if response.status_code in (403, 429) and urlparse(url).hostname in TOKEN_HOSTS and not has_token:
        hints.append("GitHub may be rate limiting this address; set GITHUB_TOKEN to raise the limit")
    if response.status_code == 404:
        hints.append("no such file at that address")
    return "".join(f"; {h}" for h in hints)


class Fetcher:
    """Fetches release files, holding the HTTP session and the retry policy of one install.

    A `session` given by the caller (proxies, certificates, tests) gets the retrying adapters
    mounted for http and https, so the policy holds whatever the session.
    """

    def __init__(
        self,
        settings: Settings,
        session: Optional[requests.Session] = None,
        *,
        backoff_factor: float = 0.5,
        max_retry_after: float = 60.0,
        log: Callable[[str], None] = say,
    ) -> None:
        self.settings = settings
        self.backoff_factor = backoff_factor
        self.retry = make_retry(settings.http_retries, backoff_factor, max_retry_after)
        self.session = session if session is not None else requests.Session()
        adapter = HTTPAdapter(max_retries=self.retry)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._log = log

    @property
    def timeout(self) -> tuple[float, float]:
        return (CONNECT_TIMEOUT_S, self.settings.http_timeout)

    # -- the manifest ---------------------------------------------------------------------------

    def fetch_json(self, base_url: str, name: str) -> dict[str, Any]:
        """The parsed JSON object `name` under `base_url`, always fetched afresh (never cached:
        an old manifest would point at old wheels)."""
        url = asset_url(base_url, name)
        if is_file_url(url):
            path = file_url_path(url)
            try:
                raw = path.read_bytes()
            except OSError as exc:
                raise FetchError(f"could not read {display_url(url)}: {exc.strerror or type(exc).__name__}") from None
        else:
            response = self._get(url, stream=False)
            with response:
                raw = response.content
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FetchError(f"{display_url(url)} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise FetchError(f"{display_url(url)} holds JSON but not an object ({type(data).__name__})")
        return data

    # -- assets ---------------------------------------------------------------------------------

    def fetch_asset(self, base_url: str, name: str, sha256: str, size: Optional[int]) -> Path:
        """Path of a verified copy of asset `name` in the cache, downloading it if needed."""
        digest = require_sha256(sha256, name)
        check_asset_name(name)
        folder = self.settings.effective_cache_dir / digest
        target = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FetchError(
                f"cannot create the download cache folder {folder} ({exc.strerror}); "
                "set CUDELTA_CACHE_DIR to a writable folder"
            ) from None
        lock = filelock.FileLock(str(folder / ".lock"), timeout=LOCK_TIMEOUT_S)
        try:
            # Held across check + download: a second pip process waits, then finds the file.
            with lock:
                remove_partials(folder)
                if not self._cached(target, digest, size, name):
                    self._download(base_url, name, target, digest, size)
        except filelock.Timeout:
            raise FetchError(
                f"waited {LOCK_TIMEOUT_S:g} s for another process downloading {name} "
                f"(lock {folder / '.lock'}); retry once it has finished"
            ) from None
        except OSError as exc:  # the lock file itself (downloads convert their own OSErrors)
            raise FetchError(
                f"cannot use the download cache folder {folder} ({exc.strerror or type(exc).__name__}); "
                "set CUDELTA_CACHE_DIR to a writable folder"
            ) from None
        return target

    def _cached(self, target: Path, sha256: str, size: Optional[int], name: str) -> bool:
        if not target.is_file():
            return False
        try:
            verify_file(target, sha256, size, f"cached {name}")
        except (VerificationError, OSError) as exc:
            self._log(f"cached {name} is unusable ({type(exc).__name__}); downloading it again")
            with suppress(OSError):
                target.unlink()
            return False
        self._log(f"using cached {name} ({target}; sha256 verified)")
        return True

    def _download(self, base_url: str, name: str, target: Path, sha256: str, size: Optional[int]) -> None:
        url = asset_url(base_url, name)
        try:
            if is_file_url(url):
                self._copy_file(url, name, target, sha256, size)
            else:
                self._download_http(url, name, target, sha256, size)
        except OSError as exc:
            if isinstance(exc, requests.RequestException):
                raise
            raise FetchError(
                f"could not save {name} to {target.parent}: {exc.strerror or type(exc).__name__}; "
                "set CUDELTA_CACHE_DIR to a folder with free space"
            ) from None

    def _copy_file(self, url: str, name: str, target: Path, sha256: str, size: Optional[int]) -> None:
        source = file_url_path(url)
        try:
            f = open(source, "rb")
        except OSError as exc:
            raise FetchError(f"could not read {display_url(url)}: {exc.strerror or type(exc).__name__}") from None
        self._log(f"copying {name} ({_megabytes(size)}) from {source.parent}")
        with f:
            write_verified(iter(lambda: f.read(CHUNK_SIZE), b""), target, sha256, size, name)

    def _download_http(self, url: str, name: str, target: Path, sha256: str, size: Optional[int]) -> None:
        # urllib3 retries connecting and the response headers; a body that breaks off half way
        # (a reset, a truncated transfer) is retried here, with the same bound and backoff.
        attempts = self.settings.http_retries + 1
        host = urlparse(url).hostname
        for attempt in range(1, attempts + 1):
            # Identity encoding: the bytes hashed must be the file's bytes, not a re-encoding.
            response = self._get(url, stream=True, headers={"Accept-Encoding": "identity"})
            with response:
                length = size if size is not None else _content_length(response.headers)
                self._log(f"downloading {name} ({_megabytes(length)}) from {host}")
                started = time.monotonic()
                try:
                    write_verified(response.iter_content(CHUNK_SIZE), target, sha256, size, name)
                except requests.RequestException as exc:
                    reason = describe_error(exc, *self.timeout)
                    if attempt == attempts:
                        raise self._fetch_error(url, reason, attempts) from None
                    self._log(f"download of {name} failed ({reason}); retrying")
                    self._sleep_backoff(attempt)
                    continue
            self._log(f"downloaded {name} in {time.monotonic() - started:.1f} s")
            return

    def _sleep_backoff(self, attempt: int) -> None:
        delay = min(self.backoff_factor * 2 ** (attempt - 1), float(self.retry.backoff_max))
        if delay > 0:
            time.sleep(delay)

    # -- HTTP -----------------------------------------------------------------------------------

    def _get(self, url: str, *, stream: bool, headers: Optional[Mapping[str, str]] = None) -> requests.Response:
        """A 200 response or a FetchError; retries and redirects happen inside."""
        if self.settings.offline:
            raise FetchError(
                f"CUDELTA_OFFLINE=1: not downloading {display_url(url)}; point CUDELTA_WHEEL_URL "
                "at a file:// wheelhouse or unset CUDELTA_OFFLINE"
            )
        try:
            response = self.session.get(
                url,
                headers={**(headers or {}), **auth_headers(url, self.settings.github_token)},
                timeout=self.timeout,
                stream=stream,
                allow_redirects=True,
            )
        except requests.RequestException as exc:
            reason = describe_error(exc, *self.timeout)
            raise self._fetch_error(url, reason, attempts_for_error(exc, self.retry)) from None
        if response.status_code != 200:
            with response:
                reason = f"HTTP {response.status_code} {response.reason or ''}".rstrip()
                final_host = urlparse(response.url).hostname
                if final_host and final_host != urlparse(url).hostname:
                    reason += f" from {final_host}"
                reason += _status_hint(response, url, bool(self.settings.github_token))
                raise self._fetch_error(url, reason, attempts_for_response(response, self.retry))
        return response

    def _fetch_error(self, url: str, reason: str, attempts: int) -> FetchError:
        message = f"could not download {display_url(url)}: {reason} ({_plural(attempts, 'attempt')})"
        token = self.settings.github_token
        if token:
            message = message.replace(token, "***")
        return FetchError(message)


def _content_length(headers: Mapping[str, str]) -> Optional[int]:
    try:
        return int(headers.get("Content-Length", ""))
    except ValueError:
        return None
