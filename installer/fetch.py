"""Download release files (the manifest and wheels) from GitHub Releases, a mirror or a wheelhouse.

Everything that can go wrong on the network ends here as a `FetchError` or `VerificationError`
whose message says what was fetched, what happened and how many attempts were made, so the
pipeline can print one line and fall back to a local build. Raw requests/urllib3 exceptions
never escape: their text and tracebacks mean nothing to someone running `pip install`.

Wheels land in a content-addressed cache, `<cache_dir>/<sha256>/<name>`: the digest comes from
the release manifest, so two releases (or a mirror and GitHub) can never hand each other a file,
and a file only ever appears under its final name after its digest has been checked.

Nothing waits without a bound or in silence: one file's fetch, retries included, ends at
CUDELTA_HTTP_DEADLINE; a body slower than CUDELTA_HTTP_MIN_RATE over a sliding window is dropped;
a body is never read past the manifest's size + 1 byte; a download lasting more than a few seconds
prints its progress; and waiting on another process's cache lock is announced (whose lock) and
bounded, after which the file is fetched into a private temporary folder instead. A redirect to
plain http on another machine is refused before connecting (the sha256 guards the bytes, but a
downgrade hands the request, and what it reveals, to anyone on the path).
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import shutil
import socket
import ssl
import tempfile
import time
from collections import deque
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional
from urllib.parse import quote, urljoin, urlparse, urlunparse
from urllib.request import url2pathname

import filelock
import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
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
# How long to wait for another process's cache lock. A healthy download of the release wheel
# (~1.4 MB) takes seconds; a lock held longer belongs to a slow or stuck install (itself bounded by
# CUDELTA_HTTP_DEADLINE), and fetching a second copy privately costs less than waiting it out.
LOCK_WAIT_S = 30.0
LOCK_NAME = ".lock"
# Beside the lock, not in it: waiting processes open the lock file too, and may truncate it.
LOCK_OWNER_NAME = ".lock.owner"
# The minimum rate is judged over this sliding window, and only once a body has flowed this long
# (TCP slow start, a storage host's first byte): a short stall is not a stuck server.
RATE_WINDOW_S = 20.0
# Progress lines: the first once a download has lasted this long, then one per interval.
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 10.0
# Small reads hand control back often enough to check the deadline and the rate on a trickle.
READ_SIZE = 64 * 1024
# A release manifest is a few KB; anything this large is not one, and is not read to its end.
MAX_JSON_BYTES = 16 * 1000 * 1000
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
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

    def __init__(
        self, *args: Any, max_retry_after: float = 60.0, deadline: Optional[float] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_retry_after = max_retry_after
        # time.monotonic() after which no further try starts (CUDELTA_HTTP_DEADLINE); None: none.
        self.deadline = deadline

    def new(self, **kw: Any) -> "CappedRetry":
        # urllib3 copies the policy on every attempt through new(); keep our fields across it.
        kw.setdefault("max_retry_after", self.max_retry_after)
        kw.setdefault("deadline", self.deadline)
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
        retry = super().increment(method, url, response, error, _pool, _stacktrace)
        if self.deadline is not None and time.monotonic() + retry.next_wait(response) >= self.deadline:
            # A try that could only start after the deadline is not waited for.
            raise MaxRetryError(_pool, url, error or ResponseError("no time left before the download deadline"))
        return retry

    def next_wait(self, response: Any = None) -> float:
        """The sleep urllib3's sleep() is about to take: Retry-After if any, else the backoff."""
        after = self.get_retry_after(response) if response is not None and self.respect_retry_after_header else None
        return after if after else self.get_backoff_time()

    def parse_retry_after(self, retry_after: str) -> float:
        try:
            seconds = super().parse_retry_after(retry_after)
        except InvalidHeader:
            # 0 makes sleep() fall back to the exponential backoff instead of raising mid-request.
            return 0.0
        return min(seconds, self.max_retry_after)


def make_retry(
    retries: int, backoff_factor: float, max_retry_after: float, deadline: Optional[float] = None
) -> CappedRetry:
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
        deadline=deadline,
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


def is_loopback(host: Optional[str]) -> bool:
    """127.0.0.0/8, ::1 and localhost: this machine, where plain http reveals nothing."""
    if not host:
        return False
    host = host.strip("[]").lower().rstrip(".")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_redirect(start_url: str, location: str) -> None:
    """FetchError unless a redirect from a fetch of `start_url` to `location` may be followed.

    https anywhere, and plain http to this machine (local mirrors, tests) are fine; plain http to
    another host only when the user chose plain http for that very host. Anything else is a
    downgrade that a hostile network (or mirror) could use, and is refused before connecting.
    """
    start, target = urlparse(start_url), urlparse(location)
    if target.scheme == "https":
        return
    if target.scheme == "http" and (
        is_loopback(target.hostname)
        or (start.scheme == "http" and (start.hostname, start.port) == (target.hostname, target.port))
    ):
        return
    raise FetchError(
        f"refusing the redirect of {display_url(start_url)} to {display_url(location)}: "
        f"{target.scheme or 'no'} scheme on {target.hostname or 'no host'}, not https; only https, or "
        "plain http to this machine (127.0.0.1, ::1, localhost), is followed"
    )


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


class TransferStopped(Exception):
    """A body abandoned by the fetcher's own bounds (deadline, minimum rate); `reason` in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _amount(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def _socket_of(raw: Any) -> Optional[socket.socket]:
    # urllib3 keeps the connection of a streamed response; http.client's `sock` is its socket.
    sock = getattr(getattr(raw, "connection", None), "sock", None)
    return sock if isinstance(sock, socket.socket) else None


class Transfer:
    """One response body, read within the fetch's bounds, with progress lines on the way.

    Reads with read1 (whatever has arrived, up to READ_SIZE), so a trickling server hands control
    back every few bytes and the bounds are checked as data comes, not once per megabyte:
    - past `limit` bytes, `too_long()` is raised: the body is never read further;
    - past `deadline` (time.monotonic()), or below `min_rate` bytes/s over the last `window`
      seconds once the body has flowed for `window` seconds, TransferStopped is raised;
    - a server that sends nothing at all is cut off by the socket's read timeout, shortened to
      what is left of the deadline and, with a minimum rate, to `window` seconds of silence (a
      rate of 0): TransferStopped too, never the slow path of read timeouts and retries.
    """

    def __init__(
        self,
        name: str,
        total: Optional[int],
        *,
        limit: Optional[int],
        too_long: Callable[[], Exception],
        deadline: float,
        deadline_s: float,
        min_rate: float,
        window: float,
        read_timeout: float,
        log: Callable[[str], None],
        progress_after: float = PROGRESS_AFTER_S,
        progress_every: float = PROGRESS_EVERY_S,
    ) -> None:
        self.name, self.total, self.limit, self.too_long = name, total, limit, too_long
        self.deadline, self.deadline_s = deadline, deadline_s
        self.min_rate, self.window, self.read_timeout = min_rate, window, read_timeout
        self.log, self.progress_after, self.progress_every = log, progress_after, progress_every
        self.started = time.monotonic()
        self.received = 0
        self._last_data = self.started
        self._next_progress = self.started + progress_after
        # (time, bytes so far): the first entry is the newest one at least `window` old.
        self._samples: deque[tuple[float, int]] = deque([(self.started, 0)])

    def chunks(self, raw: Any) -> Iterator[bytes]:
        read = getattr(raw, "read1", None) or raw.read  # read1: urllib3 >= 2
        while True:
            want = READ_SIZE if self.limit is None else min(READ_SIZE, self.limit - self.received)
            chunk = self._read(raw, read, want)
            if not chunk:
                return
            self._last_data = time.monotonic()
            self.received += len(chunk)
            if self.limit is not None and self.received >= self.limit:
                raise self.too_long()
            yield chunk
            self._check(time.monotonic())

    def rate(self, now: float) -> float:
        """Bytes per second over the sliding window (since the start, before a window has passed)."""
        t0, b0 = self._samples[0]
        return (self.received - b0) / max(now - t0, 1e-6)

    def _check(self, now: float) -> None:
        self._samples.append((now, self.received))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        if now >= self.deadline:
            raise TransferStopped(self.deadline_words())
        if self.min_rate > 0 and now - self.started >= self.window and self.rate(now) < self.min_rate:
            raise TransferStopped(
                f"too slow: {self.rate(now) / 1e3:.1f} KB/s over the last {self.window:g} s, below "
                f"the minimum {self.min_rate / 1e3:g} KB/s (CUDELTA_HTTP_MIN_RATE); got {self._so_far()}"
            )
        if now >= self._next_progress:
            self._next_progress = now + self.progress_every
            self.log(f"downloading {self.name}: {self._so_far()} at {self.rate(now) / 1e3:.0f} KB/s, "
                     f"{now - self.started:.0f} s")

    def _so_far(self) -> str:
        if self.total:
            return f"{_amount(self.received)} of {_amount(self.total)} ({100 * self.received // self.total}%)"
        return _amount(self.received)

    def deadline_words(self) -> str:
        return f"not done after the {self.deadline_s:g} s limit (CUDELTA_HTTP_DEADLINE); got {self._so_far()}"

    def silence_words(self) -> str:
        return (f"too slow: nothing for {self.window:g} s, below the minimum {self.min_rate / 1e3:g} KB/s "
                f"(CUDELTA_HTTP_MIN_RATE); got {self._so_far()}")

    def _read(self, raw: Any, read: Callable[..., bytes], want: int) -> bytes:
        sock = _socket_of(raw)
        if sock is not None:
            # A server that stops sending would otherwise hold us a whole read timeout past the
            # deadline, and then be retried: wait only as long as the bounds allow.
            now = time.monotonic()
            wait = min(self.read_timeout, self.deadline - now)
            if self.min_rate > 0:
                wait = min(wait, self._last_data + self.window - now)
            with suppress(OSError):
                sock.settimeout(max(wait, 0.01))
        try:
            return read(want, decode_content=True)
        except ReadTimeoutError:
            now = time.monotonic()
            if now >= self.deadline - 0.005:
                raise TransferStopped(self.deadline_words()) from None
            if self.min_rate > 0 and now - self._last_data >= self.window - 0.005:
                raise TransferStopped(self.silence_words()) from None
            raise


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
    mounted for http and https, so the policy holds whatever the session. The keyword arguments
    after it exist for tests (small bounds, no backoff); an install uses the defaults.
    """

    def __init__(
        self,
        settings: Settings,
        session: Optional[requests.Session] = None,
        *,
        backoff_factor: float = 0.5,
        max_retry_after: float = 60.0,
        log: Callable[[str], None] = say,
        lock_wait: float = LOCK_WAIT_S,
        rate_window: float = RATE_WINDOW_S,
        progress_after: float = PROGRESS_AFTER_S,
        progress_every: float = PROGRESS_EVERY_S,
    ) -> None:
        self.settings = settings
        self.backoff_factor = backoff_factor
        self.retry = make_retry(settings.http_retries, backoff_factor, max_retry_after)
        self.session = session if session is not None else requests.Session()
        self._adapter = HTTPAdapter(max_retries=self.retry)
        self.session.mount("http://", self._adapter)
        self.session.mount("https://", self._adapter)
        self._log = log
        self.lock_wait = lock_wait
        self.rate_window = rate_window
        self.progress_after = progress_after
        self.progress_every = progress_every

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
            raw = self._read_json_body(url, name)
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FetchError(f"{display_url(url)} is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise FetchError(f"{display_url(url)} holds JSON but not an object ({type(data).__name__})")
        return data

    def _read_json_body(self, url: str, name: str) -> bytes:
        deadline = self._deadline()
        response = self._get(url, stream=True, deadline=deadline)
        with response:

            def too_long() -> FetchError:
                return FetchError(f"{display_url(url)} is larger than {_amount(MAX_JSON_BYTES)}, so not a "
                                  "release manifest; stopped reading it")

            transfer = self._transfer(name, _content_length(response.headers), MAX_JSON_BYTES + 1, too_long, deadline)
            try:
                return b"".join(transfer.chunks(response.raw))
            except TransferStopped as stop:
                raise self._fetch_error(url, stop.reason, 1) from None
            except (requests.RequestException, HTTPError) as exc:
                raise self._fetch_error(url, self._describe(exc, deadline, transfer), 1) from None

    # -- assets ---------------------------------------------------------------------------------

    def fetch_asset(self, base_url: str, name: str, sha256: str, size: Optional[int]) -> Path:
        """Path of a verified copy of asset `name`: in the cache, downloading it if needed; in a
        private temporary folder when another process holds the cache's lock for too long."""
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
        lock = filelock.FileLock(str(folder / LOCK_NAME))
        try:
            locked = self._lock(lock, folder, name)
        except OSError as exc:  # the lock file itself (downloads convert their own OSErrors)
            raise FetchError(
                f"cannot use the download cache folder {folder} ({exc.strerror or type(exc).__name__}); "
                "set CUDELTA_CACHE_DIR to a writable folder"
            ) from None
        if not locked:
            return self._fetch_private(base_url, name, digest, size)
        # Held across check + download: a second pip process waits, then finds the file.
        try:
            _write_lock_owner(folder)
            remove_partials(folder)
            if not self._cached(target, digest, size, name):
                self._download(base_url, name, target, digest, size)
        finally:
            with suppress(OSError):
                (folder / LOCK_OWNER_NAME).unlink()
            lock.release()
        return target

    def _lock(self, lock: filelock.FileLock, folder: Path, name: str) -> bool:
        """Take the cache folder's lock; False when another process still holds it after lock_wait s."""
        try:
            lock.acquire(timeout=0)
            return True
        except filelock.Timeout:
            pass
        path = folder / LOCK_NAME
        self._log(f"waiting up to {self.lock_wait:g} s for the download cache lock {path}, held by "
                  f"{_lock_owner(folder)} (another install fetching {name})")
        started = time.monotonic()
        try:
            lock.acquire(timeout=self.lock_wait)
        except filelock.Timeout:
            self._log(f"{path} is still held after {self.lock_wait:g} s; downloading {name} into a "
                      "private temporary folder instead (the cache is left to the other install)")
            return False
        self._log(f"got the download cache lock after {time.monotonic() - started:.1f} s")
        return True

    def _fetch_private(self, base_url: str, name: str, sha256: str, size: Optional[int]) -> Path:
        """A verified copy of `name` in a folder of this process's own, never seen by the cache;
        removed when the process exits (the caller copies the wheel out before that)."""
        private = Path(tempfile.mkdtemp(prefix="cudelta-download-"))
        try:
            self._download(base_url, name, private / name, sha256, size)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        atexit.register(shutil.rmtree, private, True)
        return private / name

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
        # (a reset, a truncated transfer) is retried here, with the same bound and backoff, all
        # within one deadline. A body stopped by our own bounds (deadline, too slow) is not retried.
        attempts = self.settings.http_retries + 1
        deadline = self._deadline()
        host = urlparse(url).hostname
        for attempt in range(1, attempts + 1):
            # Identity encoding: the bytes hashed must be the file's bytes, not a re-encoding.
            response = self._get(url, stream=True, headers={"Accept-Encoding": "identity"}, deadline=deadline)
            with response:
                announced = _content_length(response.headers)
                if size is not None and announced is not None and announced > size:
                    raise _overlong(name, size, f"the server announces {announced} bytes")
                length = size if size is not None else announced
                self._log(f"downloading {name} ({_megabytes(length)}) from {host}")
                limit = size + 1 if size is not None else None

                def too_long() -> VerificationError:
                    return _overlong(name, size or 0, f"the server sent more; stopped reading at {limit} bytes")

                transfer = self._transfer(name, length, limit, too_long, deadline)
                try:
                    write_verified(transfer.chunks(response.raw), target, sha256, size, name)
                except TransferStopped as stop:
                    raise self._fetch_error(url, stop.reason, attempt) from None
                except (requests.RequestException, HTTPError) as exc:
                    reason = self._describe(exc, deadline, transfer)
                    if attempt == attempts or time.monotonic() >= deadline:
                        raise self._fetch_error(url, reason, attempt) from None
                    self._log(f"download of {name} failed ({reason}); retrying")
                    self._sleep_backoff(attempt, deadline, url)
                    continue
            self._log(f"downloaded {name} in {time.monotonic() - transfer.started:.1f} s")
            return

    def _sleep_backoff(self, attempt: int, deadline: float, url: str) -> None:
        delay = min(self.backoff_factor * 2 ** (attempt - 1), float(self.retry.backoff_max))
        if time.monotonic() + delay >= deadline:
            raise self._fetch_error(url, self._deadline_words(), attempt)
        if delay > 0:
            time.sleep(delay)

    # -- bounds ---------------------------------------------------------------------------------

    def _deadline(self) -> float:
        """time.monotonic() at which the fetch of one file, retries included, gives up."""
        return time.monotonic() + self.settings.http_deadline

    def _deadline_words(self) -> str:
        return f"not done after the {self.settings.http_deadline:g} s limit (CUDELTA_HTTP_DEADLINE)"

    def _describe(self, exc: BaseException, deadline: float, transfer: Optional[Transfer] = None) -> str:
        # A read cut short to end at the deadline is the deadline, not a slow server's timeout.
        if time.monotonic() >= deadline - 0.005:
            return transfer.deadline_words() if transfer is not None else self._deadline_words()
        return describe_error(exc, *self.timeout)

    def _transfer(
        self, name: str, total: Optional[int], limit: Optional[int], too_long: Callable[[], Exception], deadline: float
    ) -> Transfer:
        return Transfer(
            name, total, limit=limit, too_long=too_long, deadline=deadline,
            deadline_s=self.settings.http_deadline, min_rate=self.settings.http_min_rate * 1e3,
            window=self.rate_window, read_timeout=self.settings.http_timeout, log=self._log,
            progress_after=self.progress_after, progress_every=self.progress_every,
        )

    # -- HTTP -----------------------------------------------------------------------------------

    def _get(
        self, url: str, *, stream: bool, deadline: float, headers: Optional[Mapping[str, str]] = None
    ) -> requests.Response:
        """A 200 response or a FetchError; retries and (checked) redirects happen inside, and no
        try starts after `deadline`."""
        if self.settings.offline:
            raise FetchError(
                f"CUDELTA_OFFLINE=1: not downloading {display_url(url)}; point CUDELTA_WHEEL_URL "
                "at a file:// wheelhouse or unset CUDELTA_OFFLINE"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._fetch_error(url, self._deadline_words(), 1)
        # The policy of this fetch: the mounted adapter's, with this fetch's deadline.
        self._adapter.max_retries = self.retry.new(deadline=deadline)
        try:
            response = self.session.get(
                url,
                headers={**(headers or {}), **auth_headers(url, self.settings.github_token)},
                timeout=(min(CONNECT_TIMEOUT_S, left), min(self.settings.http_timeout, left)),
                stream=stream,
                allow_redirects=True,
                hooks={"response": self._redirect_guard(url)},
            )
        except requests.RequestException as exc:
            reason = self._describe(exc, deadline)
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

    def _redirect_guard(self, start_url: str) -> Callable[..., requests.Response]:
        """A response hook that vets each redirect before requests follows it (and connects)."""

        def hook(response: requests.Response, *args: Any, **kwargs: Any) -> requests.Response:
            location = self.session.get_redirect_target(response) if response.is_redirect else None
            if location is not None:
                try:
                    check_redirect(start_url, urljoin(response.url, location))
                except FetchError:
                    response.close()
                    raise
            return response

        return hook

    def _fetch_error(self, url: str, reason: str, attempts: int) -> FetchError:
        message = f"could not download {display_url(url)}: {reason} ({_plural(attempts, 'attempt')})"
        token = self.settings.github_token
        if token:
            message = message.replace(token, "***")
        return FetchError(message)


def _overlong(name: str, size: int, what: str) -> VerificationError:
    return VerificationError(
        f"{name} is not the released file: the release manifest says {size} bytes, {what}. "
        "The file was not installed. Retry the install to download it again, or set FORCE_BUILD=1 "
        "to compile from source instead."
    )


def _write_lock_owner(folder: Path) -> None:
    """Who holds the lock, for the message of a process that waits on it."""
    with suppress(OSError):
        (folder / LOCK_OWNER_NAME).write_text(
            f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n")


def _lock_owner(folder: Path) -> str:
    try:
        owner = (folder / LOCK_OWNER_NAME).read_text().strip()
    except OSError:
        owner = ""
    return owner or "a process that did not say"


def _content_length(headers: Mapping[str, str]) -> Optional[int]:
    try:
        return int(headers.get("Content-Length", ""))
    except ValueError:
        return None
