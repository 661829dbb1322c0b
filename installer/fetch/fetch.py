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

The cache only saves a download: a cache that cannot hold the file (CUDELTA_CACHE_DIR under a
regular file, a full or read-only disk, a folder at the file's path) costs one line naming the
cause and the fix, and the file is installed from a private temporary folder, never compiled
instead (`_fetch_uncached`). Only when that folder cannot hold it either does the fetch fail.
"""

from __future__ import annotations

import errno
import json
import shutil
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional
from urllib.parse import urljoin, urlparse

import filelock
import requests
from urllib3.exceptions import HTTPError

from ..core.errors import FetchError, VerificationError
from ..core.log import say
from ..core.settings import Settings
from .cache import (
    LOCK_NAME,
    DiskError,
    Holder,
    LockOwner,
    check_room,
    lock_holder,
    move_out,
    private_folder,
    remove_partials,
    unusable_words,
    write_verified,
)
from .network import NetworkAdapter, policy_from
from .transfer import (
    PROGRESS_AFTER_S,
    PROGRESS_EVERY_S,
    RATE_WINDOW_S,
    Transfer,
    TransferStopped,
    amount,
    attempts_for_error,
    attempts_for_response,
    describe_error,
    make_retry,
    megabytes,
    plural,
    status_hint,
)
from .urls import asset_url, auth_headers, check_asset_name, check_redirect, display_url, file_url_path, is_file_url
from .verify import CHUNK_SIZE, require_sha256, verify_file

CONNECT_TIMEOUT_S = 10.0
# How long to wait for another process's cache lock. A healthy download of the release wheel
# (~1.4 MB) takes seconds; a lock held longer belongs to a slow or stuck install (itself bounded by
# CUDELTA_HTTP_DEADLINE), and fetching a second copy privately costs less than waiting it out.
LOCK_WAIT_S = 30.0
# A release manifest is a few KB; anything this large is not one, and is not read to its end.
MAX_JSON_BYTES = 16 * 1000 * 1000


def _quiet(phase: str, *, throttle: bool = False) -> None:
    """The phase sink of a download nobody waits on (a private one)."""


class Fetcher:
    """Fetches release files, holding the HTTP session and the retry policy of one install.

    A `session` given by the caller (tests) gets the retrying network adapter mounted for http and
    https and its trust_env turned off, so the retry policy, the proxies and the certificates of
    installer/fetch/network.py hold whatever the session. The keyword arguments
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
        # Proxies and CA files come from settings.py through the policy, never from requests'
        # own reading of the environment (trust_env), which has its own order and no PIP_* names.
        self.session.trust_env = False
        self.network = policy_from(settings)
        self._adapter = NetworkAdapter(self.network, max_retries=self.retry)
        self._announced: set[tuple[str, Optional[str]]] = set()
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
                return FetchError(f"{display_url(url)} is larger than {amount(MAX_JSON_BYTES)}, so not a "
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
        private temporary folder when another process holds the cache's lock for too long, or
        when the cache cannot hold it (the cache saves a download; it is never a reason to compile)."""
        digest = require_sha256(sha256, name)
        check_asset_name(name)
        cache_dir = self.settings.effective_cache_dir
        try:
            return self._fetch_cached(base_url, name, digest, size, cache_dir / digest)
        except DiskError as failure:
            return self._fetch_uncached(base_url, name, digest, size, failure, cache_dir)

    def _fetch_cached(self, base_url: str, name: str, sha256: str, size: Optional[int], folder: Path) -> Path:
        """The cached copy, downloaded first if needed; DiskError when the cache cannot hold it."""
        target = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskError(exc, folder) from None
        lock = filelock.FileLock(str(folder / LOCK_NAME))
        try:
            locked = self._lock(lock, folder, name)
        except OSError as exc:  # the lock file itself: a read-only or foreign folder
            raise DiskError(exc, folder / LOCK_NAME) from None
        if not locked:
            return self._fetch_private(base_url, name, sha256, size)
        # Held across check + download: a second pip process waits, then finds the file.
        owner = LockOwner(folder)
        try:
            owner.doing(f"verifying its cached copy of {name}" if target.is_file() else f"about to download {name}")
            remove_partials(folder)
            if not self._cached(target, sha256, size, name):
                check_room(target, size)
                owner.doing(f"downloading {name}")
                try:
                    self._download(base_url, name, target, sha256, size, owner.doing)
                except DiskError as failure:
                    failure.mid_download = True
                    if failure.verified is not None:
                        # Out of the cache while the lock keeps others' remove_partials off it.
                        try:
                            failure.verified = move_out(failure.verified, name)
                        except OSError as exc:
                            raise self._no_room(name, exc, unusable_words(failure, folder.parent)) from None
                    raise
        finally:
            owner.remove()
            lock.release()
        return target

    def _fetch_uncached(
        self, base_url: str, name: str, sha256: str, size: Optional[int], failure: DiskError, cache_dir: Path
    ) -> Path:
        """The fallback when the cache cannot hold `name`: a verified copy already downloaded (and
        moved out of the cache) is used; else a verified copy the cache already has (a read-only cache); else a
        download into a private folder. Said in one line, with the cause and how to fix it."""
        why = unusable_words(failure, cache_dir)
        if failure.verified is not None:  # already moved out of the cache, under its lock
            self._log(f"not caching {name}: {why}; installing the verified download from a private "
                      "temporary folder instead")
            return failure.verified
        cached = cache_dir / sha256 / name
        if self._readable_copy(cached, sha256, size, name):
            self._log(f"using cached {name} ({cached}; sha256 verified) without the cache's lock: {why}")
            return cached
        # A disk that failed mid-download lost bytes that were not verified yet: they come again.
        again = "again " if failure.mid_download else ""
        self._log(f"not caching {name}: {why}; downloading it {again}into a private temporary folder instead")
        return self._fetch_private(base_url, name, sha256, size, why)

    def _readable_copy(self, path: Path, sha256: str, size: Optional[int], name: str) -> bool:
        """A verified file at `path`, left as it is whatever it holds (a cache we cannot write)."""
        if not path.is_file():
            return False
        try:
            verify_file(path, sha256, size, f"cached {name}")
        except (VerificationError, OSError):
            return False
        return True

    def _lock(self, lock: filelock.FileLock, folder: Path, name: str) -> bool:
        """Take the cache folder's lock; False when another process still holds it after lock_wait s."""
        try:
            lock.acquire(timeout=0)
            return True
        except filelock.Timeout:
            pass
        path = folder / LOCK_NAME
        self._log(f"waiting up to {self.lock_wait:g} s for the download cache lock {path}, held by "
                  f"{_holder_words(lock_holder(folder))}")
        started = time.monotonic()
        try:
            lock.acquire(timeout=self.lock_wait)
        except filelock.Timeout:
            self._log(f"{path} is still held after {self.lock_wait:g} s (by {_holder_words(lock_holder(folder))}); "
                      f"downloading {name} into a private temporary folder instead (the cache is left to "
                      "the other install)")
            return False
        self._log(f"got the download cache lock after {time.monotonic() - started:.1f} s")
        return True

    def _fetch_private(
        self, base_url: str, name: str, sha256: str, size: Optional[int], cache_why: Optional[str] = None
    ) -> Path:
        """A verified copy of `name` in a folder of this process's own, never seen by the cache;
        removed when the process exits (the caller copies the wheel out before that)."""
        try:
            private = private_folder()
        except OSError as exc:
            raise self._no_room(name, exc, cache_why) from None
        try:
            self._download(base_url, name, private / name, sha256, size)
        except DiskError as failure:
            shutil.rmtree(private, ignore_errors=True)
            raise self._no_room(name, failure.error, cache_why) from None
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        return private / name

    def _no_room(self, name: str, error: OSError, cache_why: Optional[str]) -> FetchError:
        """Neither the cache nor a private temporary folder could hold `name`: the one case left to compile."""
        code = errno.errorcode.get(error.errno or 0, type(error).__name__)
        cache = f"; the download cache could not hold it either: {cache_why}" if cache_why else ""
        return FetchError(
            f"could not save {name} to a private temporary folder under {tempfile.gettempdir()}: "
            f"{error.strerror or type(error).__name__} ({code}); set TMPDIR to a folder with free space{cache}"
        )

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

    def _download(
        self, base_url: str, name: str, target: Path, sha256: str, size: Optional[int],
        doing: Callable[..., None] = _quiet,
    ) -> None:
        """Download (or copy) `name` to `target`, verified; DiskError when the disk fails, FetchError
        or VerificationError when the source does. `doing(phase, throttle=...)` hears the progress."""
        url = asset_url(base_url, name)
        try:
            if is_file_url(url):
                self._copy_file(url, name, target, sha256, size, doing)
            else:
                self._download_http(url, name, target, sha256, size, doing)
        except OSError as exc:  # reading the source: writes are DiskError, HTTP is handled inside
            if isinstance(exc, requests.RequestException):
                raise
            raise FetchError(f"could not read {display_url(url)}: {exc.strerror or type(exc).__name__}") from None

    def _copy_file(
        self, url: str, name: str, target: Path, sha256: str, size: Optional[int], doing: Callable[..., None]
    ) -> None:
        source = file_url_path(url)
        try:
            f = open(source, "rb")
        except OSError as exc:
            raise FetchError(f"could not read {display_url(url)}: {exc.strerror or type(exc).__name__}") from None
        self._log(f"copying {name} ({megabytes(size)}) from {source.parent}")
        doing(f"copying {name} from {source.parent}")
        with f:
            write_verified(iter(lambda: f.read(CHUNK_SIZE), b""), target, sha256, size, name)

    def _download_http(
        self, url: str, name: str, target: Path, sha256: str, size: Optional[int], doing: Callable[..., None]
    ) -> None:
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
                self._log(f"downloading {name} ({megabytes(length)}) from {host}")
                limit = size + 1 if size is not None else None

                def too_long() -> VerificationError:
                    return _overlong(name, size or 0, f"the server sent more; stopped reading at {limit} bytes")

                transfer = self._transfer(name, length, limit, too_long, deadline)
                try:
                    chunks = _reporting(transfer, transfer.chunks(response.raw), doing)
                    write_verified(chunks, target, sha256, size, name)
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
        request = getattr(exc, "request", None)
        url = getattr(request, "url", None) or ""
        return describe_error(exc, *self.timeout, hints=self.network.hints(url))

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
        self._announce_route(url)
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
                reason += status_hint(response, url, bool(self.settings.github_token), self.network.hints(url))
                raise self._fetch_error(url, reason, attempts_for_response(response, self.retry))
        return response

    def _announce_route(self, url: str) -> None:
        """Say once per host how it is reached when that is not the plain default: through which
        proxy, and for https which certificates are trusted (a corporate network's two knobs)."""
        parsed = urlparse(url)
        proxy = self.network.proxy_for(url)
        key = (parsed.scheme, parsed.hostname)
        if key in self._announced:
            return
        self._announced.add(key)
        words = []
        if proxy is not None:
            words.append(f"through the proxy {proxy.shown} ({proxy.variable})")
        trust = self.network.trust
        if parsed.scheme == "https" and (trust.ca_file is not None or trust.store != "system"):
            words.append(f"trusting {trust.words()}")
        if words:
            self._log(f"reaching {parsed.hostname} " + ", ".join(words))

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
        message = f"could not download {display_url(url)}: {reason} ({plural(attempts, 'attempt')})"
        token = self.settings.github_token
        if token:
            message = message.replace(token, "***")
        return FetchError(message)


def _reporting(transfer: Transfer, chunks: Iterator[bytes], doing: Callable[..., None]) -> Iterator[bytes]:
    """`chunks`, telling `doing` how far the download is (for the lock's waiters)."""
    for chunk in chunks:
        total = f" of {amount(transfer.total)}" if transfer.total else ""
        doing(f"downloading {transfer.name} ({amount(transfer.received)}{total})", throttle=True)
        yield chunk
    doing(f"verifying its download of {transfer.name}")


def _holder_words(holder: Holder) -> str:
    """'pid 1 on host since 10:00:00, which is downloading x.whl (0.3 MB of 1.4 MB)'."""
    if not holder.doing:
        return f"{holder.who} (it does not say what it is doing)"
    return f"{holder.who}, which is {holder.doing}"


def _overlong(name: str, size: int, what: str) -> VerificationError:
    return VerificationError(
        f"{name} is not the released file: the release manifest says {size} bytes, {what}. "
        "The file was not installed. Retry the install to download it again, or set FORCE_BUILD=1 "
        "to compile from source instead."
    )


def _content_length(headers: Mapping[str, str]) -> Optional[int]:
    try:
        return int(headers.get("Content-Length", ""))
    except ValueError:
        return None
