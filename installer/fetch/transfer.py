"""One HTTP body read within the fetch's bounds, the retry policy, and errors in words.

installer/fetch/fetch.py drives these: `Transfer` reads a response body against the deadline and the
minimum rate, printing progress; `CappedRetry` is urllib3's retry with GitHub's rate limits in
mind; `describe_error` turns any requests/urllib3 exception into one line a person can act on.
"""

from __future__ import annotations

import re
import socket
import ssl
import time
from collections import deque
from contextlib import suppress
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlparse

import requests
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

from .network import CA_HINT, DEFAULT_HINTS, NetworkHints
from .urls import TOKEN_HOSTS

# The minimum rate is judged over this sliding window, and only once a body has flowed this long
# (TCP slow start, a storage host's first byte): a short stall is not a stuck server.
RATE_WINDOW_S = 20.0
# Progress lines: the first once a download has lasted this long, then one per interval.
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 10.0
# Small reads hand control back often enough to check the deadline and the rate on a trickle.
READ_SIZE = 64 * 1024
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
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
        if error is not None and any(isinstance(c, ssl.SSLCertVerificationError) for c in _causes(error)):
            # A certificate not trusted now is not trusted in a second: say so at once, as 1 attempt.
            raise error
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



class TransferStopped(Exception):
    """A body abandoned by the fetcher's own bounds (deadline, minimum rate); `reason` in words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def amount(n: float) -> str:
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
            return f"{amount(self.received)} of {amount(self.total)} ({100 * self.received // self.total}%)"
        return amount(self.received)

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


def describe_error(
    exc: BaseException, connect_timeout: float, read_timeout: float, hints: NetworkHints = DEFAULT_HINTS
) -> str:
    """A network exception in words, e.g. 'timed out after 30 s waiting for data'; proxy and TLS
    failures name the variables that matter for the URL's scheme and what was trusted."""
    causes = list(_causes(exc))

    def find(*types: type) -> Optional[BaseException]:
        return next((c for c in causes if isinstance(c, types)), None)

    # Order matters: a TLS failure inside a proxy's tunnel is about certificates, not the proxy;
    # urllib3's NewConnectionError subclasses ConnectTimeoutError.
    if find(requests.exceptions.SSLError, ssl.SSLError) is not None:
        found = find(ssl.SSLError)
        detail = f" {getattr(found, 'reason', None) or ''}".rstrip() if found is not None else ""
        if isinstance(found, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(found):
            return (f"TLS certificate not trusted ({detail.strip() or 'CERTIFICATE_VERIFY_FAILED'}): checked against {hints.trust}; for a private or "
                    f"corporate CA set {CA_HINT} to its PEM file")
        return f"TLS error{detail} (checked against {hints.trust}; a private CA: set {CA_HINT})"
    if find(requests.exceptions.ProxyError) is not None:
        via = f"the proxy {hints.proxy.shown} from {hints.proxy.variable}" if hints.proxy else "the proxy"
        inner = find(NewConnectionError) or next(
            (c for c in causes if isinstance(c, OSError) and not isinstance(c, (requests.RequestException, ssl.SSLError))),
            None)
        why = f": {_reason_text(inner)}" if inner is not None else ""
        return f"could not go through {via}{why} (check {hints.proxy_variables})"
    if (found := find(NewConnectionError)) is not None:
        words = f"could not connect ({_reason_text(found)})"
        if hints.no_proxy_bypassed:
            words += "; reached directly, as NO_PROXY says"
        elif hints.proxy is None:
            words += f"; behind a proxy, set {hints.proxy_variables.split(' / ')[0]}"
        return words
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


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def megabytes(size: Optional[int]) -> str:
    return "size unknown" if size is None else f"{size / 1e6:.1f} MB"


def status_hint(response: requests.Response, url: str, has_token: bool, network: NetworkHints = DEFAULT_HINTS) -> str:
    retry_after = response.headers.get("Retry-After")
    hints = []
    if response.status_code == 407:
        variable = network.proxy.variable if network.proxy else network.proxy_variables.split(" ")[0]
        hints.append(f"the proxy wants credentials: give them in {variable} as http://user:password@host:port")
    if retry_after and response.status_code in (403, 429, 503):
        hints.append(f"the server asks to retry after {retry_after} s")
    if response.status_code in (403, 429) and urlparse(url).hostname in TOKEN_HOSTS and not has_token:
        hints.append("GitHub may be rate limiting this address; set GITHUB_TOKEN to raise the limit")
    if response.status_code == 404:
        hints.append("no such file at that address")
    return "".join(f"; {h}" for h in hints)
