"""A local HTTP server that behaves like GitHub Releases, for installer tests and manual runs.

    GET /<owner>/<repo>/releases/download/<tag>/<name>
        302 Found, Location: http://127.0.0.1:<port>/storage/<tag>/<name>?sig=<random>
        (GitHub answers the same way, with a signed URL on a storage host); 404 if no such asset
    GET /storage/<tag>/<name>?sig=...
        the file's bytes, Content-Length, application/octet-stream; 403 without a signature
    GET /<owner>/<repo>/releases/download/<tag>/whl/...
        the release folder's PEP 503 index as static files (index.html for a folder), so the
        index's relative links lead back to the download URLs above, through the 302
    GET /whl/..., /<name>
        the latest release added, served as static files like `python -m http.server DIR`

Releases are folders: `add_release(tag, folder)` serves `folder` (live, not copied) as `tag`, and
any `<root>/<tag>/` folder is served as `tag` too. Every request is recorded in `.requests`
(nothing is logged to stderr), and faults can be injected: `fail_next` (a status, e.g. 503 or
403 + Retry-After, for the next N matching requests), `truncate` (a Content-Length larger than
the body, then the connection closes), `replace_bytes` (other bytes than the manifest's),
`trickle` (the body at N bytes/s; 0: headers, then silence), `overlong` (extra bytes after the
file, announced or close-delimited) and `redirect` (the download URL's 302 goes elsewhere, e.g.
to plain http on another host). `bytes_sent` counts the body bytes each file really went out with.

    with ReleaseServer(tmp_path) as server:
        server.add_release("v0.1.0", release_dir)
        Fetcher(Settings(wheel_url=server.base_url("v0.1.0"), ...))

Manual use: `python tests/e2e/release_server.py DIR --tag v0.1.0` prints the URLs and serves until
Ctrl-C.
"""

from __future__ import annotations

import argparse
import mimetypes
import secrets
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Set, Tuple
from urllib.parse import quote, unquote, urlsplit

HOST = "127.0.0.1"
DEFAULT_REPO = "cudelta/cudelta"
# A client that stops talking (an idle keep-alive connection, a stuck test) frees its thread after this.
CONNECTION_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
# A trickle writes this often, so that a client's bounds are met within a fraction of a second.
TRICKLE_TICK_S = 0.05
# Overlong bodies go out in pieces this large, so that bytes_sent shows where the client stopped.
OVERLONG_PIECE = 16 * 1024


class Request(NamedTuple):
    method: str
    path: str  # as sent: quoted, with the query
    headers: Dict[str, str]


@dataclass
class _Overlong:
    extra: int
    announce: bool  # Content-Length of the longer body; else no length, the body ends at close


@dataclass
class _Failure:
    suffix: str
    status: int
    headers: Dict[str, str]
    remaining: int


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: Tuple[str, int], release_server: "ReleaseServer") -> None:
        self.release_server = release_server
        self.open_connections: Set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def finish_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        context = self.release_server.ssl_context
        if context is None:
            super().finish_request(request, client_address)
            return
        # The TLS handshake runs here, in the connection's own thread, bounded: a client that
        # rejects the certificate (or says nothing) never holds up the accept loop.
        request.settimeout(CONNECTION_TIMEOUT_S)
        tls = context.wrap_socket(request, server_side=True)
        try:
            super().finish_request(tls, client_address)
        finally:
            self.shutdown_request(tls)

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        # A client hanging up mid-response (the truncation fault, a cancelled download) is normal
        # here; keep it off stderr and inspectable.
        self.release_server._record_error(sys.exc_info()[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as GitHub; every response carries Content-Length
    timeout = CONNECTION_TIMEOUT_S
    server: _HTTPServer

    def version_string(self) -> str:
        return "release-server"

    def setup(self) -> None:
        super().setup()
        with self.server.connections_lock:
            self.server.open_connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.server.connections_lock:
                self.server.open_connections.discard(self.connection)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
        pass  # every request is in ReleaseServer.requests instead

    def do_GET(self) -> None:
        self.server.release_server._handle(self, head=False)

    def do_HEAD(self) -> None:
        self.server.release_server._handle(self, head=True)

    def _not_allowed(self) -> None:
        self.server.release_server._record(self)
        self.close_connection = True
        self.server.release_server._send_text(self, 405, "method not allowed\n", head=False)

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed


class ReleaseServer:
    """GitHub Releases on 127.0.0.1, on a free port, until `close()` (or the `with` block ends)."""

    def __init__(self, root: Path, *, repo: str = DEFAULT_REPO, port: int = 0,
                 on_request: Optional[Callable[[Request], None]] = None,
                 ssl_context: Optional[ssl.SSLContext] = None, host_name: str = HOST) -> None:
        """`ssl_context`: serve https with it (a server context holding the certificate);
        `host_name`: the name its URLs and redirects use (it still listens on 127.0.0.1 only)."""
        self.root = Path(root)
        self.ssl_context = ssl_context
        self.host_name = host_name
        self.repo = repo.strip("/")
        self._on_request = on_request
        self._lock = threading.Lock()
        self._releases: Dict[str, Path] = {}
        self._latest: Optional[str] = None
        self._requests: List[Request] = []
        self._errors: List[BaseException] = []
        self._failures: List[_Failure] = []
        self._truncated: Set[str] = set()
        self._replaced: Dict[str, bytes] = {}
        self._trickles: Dict[str, Tuple[float, Optional[int]]] = {}  # name -> (bytes/s, times left)
        self._overlong: Dict[str, _Overlong] = {}
        self._redirects: Dict[str, str] = {}
        self._sent: Dict[str, int] = {}
        self._httpd = _HTTPServer((HOST, port), self)
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"release-server-{self.port}", daemon=True)
        self._closed = False
        self._thread.start()

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> "ReleaseServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving, drop open connections and free the port; bounded, idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        with self._httpd.connections_lock:
            connections = list(self._httpd.open_connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._httpd.server_close()
        self._thread.join(CLOSE_TIMEOUT_S)

    # -- releases and URLs ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host_name}:{self.port}"

    def base_url(self, tag: str) -> str:
        """What CUDELTA_WHEEL_URL points at: the release's download folder."""
        return f"{self.url}/{self.repo}/releases/download/{quote(tag, safe='')}"

    def index_url(self, flavour: str = "cu130", tag: Optional[str] = None) -> str:
        """The PEP 503 index of a CUDA flavour: of `tag` through the download URL (wheels then
        come through the 302), else at the server's root (the latest release, served as is)."""
        base = self.base_url(tag) if tag is not None else self.url
        return f"{base}/whl/{flavour}"

    def add_release(self, tag: str, directory: Path) -> None:
        """Serve `directory` (wheels, manifest.json, whl/ index) as release `tag`, and at the root."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"{directory} is not a folder")
        with self._lock:
            self._releases[tag] = directory.resolve()
            self._latest = tag

    def _release_dir(self, tag: str) -> Optional[Path]:
        with self._lock:
            found = self._releases.get(tag)
        if found is not None:
            return found
        candidate = self.root / tag
        if tag and "/" not in tag and tag not in (".", "..") and candidate.is_dir():
            return candidate.resolve()
        return None

    # -- what was asked -------------------------------------------------------------------------

    @property
    def requests(self) -> List[Request]:
        """A snapshot of every request received so far, in order."""
        with self._lock:
            return list(self._requests)

    @property
    def errors(self) -> List[BaseException]:
        """Exceptions of handlers (clients that hung up); empty in a clean run."""
        with self._lock:
            return list(self._errors)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def paths(self) -> List[str]:
        """The unquoted paths (no query) of the requests so far: easy to assert on."""
        return [unquote(urlsplit(r.path).path) for r in self.requests]

    # -- faults -----------------------------------------------------------------------------------

    def fail_next(self, path_suffix: str, status: int, headers: Optional[Dict[str, str]] = None,
                  times: int = 1) -> None:
        """Answer the next `times` requests whose path ends with `path_suffix` (quoted or not, query
        ignored) with `status` and `headers`, e.g. 503, or 403 with {"Retry-After": "0"}."""
        if times < 1:
            raise ValueError("times must be >= 1")
        with self._lock:
            self._failures.append(_Failure(path_suffix, status, dict(headers or {}), times))

    def truncate(self, name: str) -> None:
        """From now on, file `name` is sent with its full Content-Length but half its bytes, then
        the connection is closed."""
        with self._lock:
            self._truncated.add(name)

    def replace_bytes(self, name: str, data: bytes) -> None:
        """From now on, file `name` is served as `data` (with a matching Content-Length)."""
        with self._lock:
            self._replaced[name] = bytes(data)

    def trickle(self, name: str, bytes_per_s: float, times: Optional[int] = None) -> None:
        """File `name` goes out at `bytes_per_s` (0: the headers, then nothing until the client
        hangs up or the server closes), for the next `times` requests (None: from now on)."""
        if bytes_per_s < 0 or (times is not None and times < 1):
            raise ValueError("bytes_per_s must be >= 0 and times None or >= 1")
        with self._lock:
            self._trickles[name] = (float(bytes_per_s), times)

    def overlong(self, name: str, extra: int, *, announce: bool = False) -> None:
        """From now on, file `name` is followed by `extra` more bytes: with a Content-Length that
        counts them (`announce`), or with none, the body ending when the connection closes."""
        if extra < 1:
            raise ValueError("extra must be >= 1")
        with self._lock:
            self._overlong[name] = _Overlong(extra, announce)

    def redirect(self, name: str, location: str) -> None:
        """From now on, the download URL of `name` answers 302 to `location` (any URL, e.g. plain
        http on a host that is not this machine) instead of to the storage URL."""
        with self._lock:
            self._redirects[name] = location

    def bytes_sent(self, name: str) -> int:
        """Body bytes of file `name` written to clients so far (what a client made the server send)."""
        with self._lock:
            return self._sent.get(name, 0)

    def reset_faults(self) -> None:
        with self._lock:
            self._failures.clear()
            self._truncated.clear()
            self._replaced.clear()
            self._trickles.clear()
            self._overlong.clear()
            self._redirects.clear()

    def _take_failure(self, raw_path: str, path: str) -> Optional[_Failure]:
        with self._lock:
            for failure in self._failures:
                if raw_path.endswith(failure.suffix) or path.endswith(failure.suffix):
                    failure.remaining -= 1
                    if failure.remaining == 0:
                        self._failures.remove(failure)
                    return failure
        return None

    # -- handling ---------------------------------------------------------------------------------

    def _record(self, handler: _Handler) -> None:
        request = Request(handler.command, handler.path, dict(handler.headers.items()))
        with self._lock:
            self._requests.append(request)
        if self._on_request is not None:
            self._on_request(request)

    def _record_error(self, exc: Optional[BaseException]) -> None:
        if exc is not None:
            with self._lock:
                self._errors.append(exc)

    def _handle(self, h: _Handler, head: bool) -> None:
        self._record(h)
        raw_path = urlsplit(h.path).path
        query = urlsplit(h.path).query
        path = unquote(raw_path)
        failure = self._take_failure(raw_path, path)
        if failure is not None:
            self._send_text(h, failure.status, f"injected failure: HTTP {failure.status}\n", head,
                            failure.headers)
            return
        parts = path.split("/")[1:]  # path starts with '/'
        if any(p in (".", "..") or "\\" in p or "\0" in p for p in parts):
            self._send_text(h, 400, "bad path\n", head)
            return
        repo_parts = self.repo.split("/")
        prefix = [*repo_parts, "releases", "download"]
        if parts[: len(prefix)] == prefix and len(parts) > len(prefix) + 1:
            tag, rest = parts[len(prefix)], parts[len(prefix) + 1:]
            if len(rest) == 1 and rest[0]:
                self._redirect_to_storage(h, tag, rest[0], head)
            else:
                self._serve_static(h, self._release_dir(tag), rest, path, head)
        elif len(parts) == 3 and parts[0] == "storage":
            self._serve_storage(h, parts[1], parts[2], query, head)
        else:
            with self._lock:
                latest = self._latest
            self._serve_static(h, self._release_dir(latest) if latest else None, parts, path, head)

    def _redirect_to_storage(self, h: _Handler, tag: str, name: str, head: bool) -> None:
        folder = self._release_dir(tag)
        if folder is None or not (folder / name).is_file():
            self._send_text(h, 404, "Not Found\n", head)
            return
        with self._lock:
            redirected = self._redirects.get(name)
        if redirected is not None:
            self._send_text(h, 302, "", head, {"Location": redirected})
            return
        location = (f"{self.url}/storage/{quote(tag, safe='')}/{quote(name, safe='')}"
                    f"?sig={secrets.token_hex(8)}&expires={int(time.time()) + 300}")
        self._send_text(h, 302, "", head, {"Location": location})

    def _serve_storage(self, h: _Handler, tag: str, name: str, query: str, head: bool) -> None:
        if "sig=" not in query:
            self._send_text(h, 403, "missing signature\n", head)
            return
        folder = self._release_dir(tag)
        if folder is None or not (folder / name).is_file():
            self._send_text(h, 404, "Not Found\n", head)
            return
        self._send_file(h, folder / name, head, "application/octet-stream")

    def _serve_static(self, h: _Handler, folder: Optional[Path], parts: List[str], path: str,
                      head: bool) -> None:
        if folder is None:
            self._send_text(h, 404, "Not Found\n", head)
            return
        target = folder.joinpath(*[p for p in parts if p])
        if target.is_dir():
            if not path.endswith("/"):
                self._send_text(h, 301, "", head, {"Location": quote(path) + "/"})
                return
            target = target / "index.html"
        try:
            inside = target.resolve().is_relative_to(folder)
        except OSError:
            inside = False
        if not inside or not target.is_file():
            self._send_text(h, 404, "Not Found\n", head)
            return
        ctype = "text/html; charset=utf-8" if target.suffix == ".html" else (
            mimetypes.guess_type(target.name)[0] or "application/octet-stream")
        if target.suffix == ".whl":
            ctype = "application/octet-stream"
        self._send_file(h, target, head, ctype)

    def _take_trickle(self, name: str) -> Optional[float]:
        with self._lock:
            found = self._trickles.get(name)
            if found is None:
                return None
            rate, times = found
            if times is not None:
                if times <= 1:
                    del self._trickles[name]
                else:
                    self._trickles[name] = (rate, times - 1)
            return rate

    def _count_sent(self, name: str, n: int) -> None:
        with self._lock:
            self._sent[name] = self._sent.get(name, 0) + n

    def _write_body(self, h: _Handler, name: str, data: bytes, rate: Optional[float],
                    piece: int = 1 << 20) -> None:
        """Write `data` (at `rate` bytes/s when given), counting what went out; a client that
        hangs up ends it (the handler's error is recorded, as for any client that hangs up)."""
        if rate is None:
            for start in range(0, len(data), piece):
                h.wfile.write(data[start:start + piece])
                self._count_sent(name, len(data[start:start + piece]))
            return
        step = max(1, int(rate * TRICKLE_TICK_S)) if rate > 0 else 0
        start = 0
        while start < len(data) and not self._closed:
            time.sleep(TRICKLE_TICK_S)
            if step:
                h.wfile.write(data[start:start + step])
                h.wfile.flush()
                self._count_sent(name, len(data[start:start + step]))
                start += step

    def _send_file(self, h: _Handler, path: Path, head: bool, content_type: str) -> None:
        with self._lock:
            data = self._replaced.get(path.name)
            truncated = path.name in self._truncated
            overlong = self._overlong.get(path.name)
        if data is None:
            data = path.read_bytes()
        rate = None if head else self._take_trickle(path.name)
        if overlong is not None:
            # Not the file: its bytes and more (a hostile or broken mirror), e.g. 2.4 MB for 1.4 MB.
            data = data + (b"\0" * overlong.extra)
            if not overlong.announce:
                self._send_close_delimited(h, path.name, data, head, content_type)
                return
        length = len(data)
        if truncated:
            length = max(len(data), 1)
            data = data[: len(data) // 2]
            h.close_connection = True
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(length))
        if truncated:
            h.send_header("Connection", "close")
        h.end_headers()
        if not head:
            self._write_body(h, path.name, data, rate, OVERLONG_PIECE if overlong else 1 << 20)
        h.wfile.flush()

    def _send_close_delimited(self, h: _Handler, name: str, data: bytes, head: bool, content_type: str) -> None:
        # HTTP/1.1 without Content-Length: the body is whatever comes until the server closes.
        h.close_connection = True
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Connection", "close")
        h.end_headers()
        if not head:
            self._write_body(h, name, data, None, OVERLONG_PIECE)
        h.wfile.flush()

    def _send_text(self, h: _Handler, status: int, text: str, head: bool,
                   headers: Optional[Dict[str, str]] = None) -> None:
        body = text.encode("utf-8")
        h.send_response(status)
        h.send_header("Content-Type", "text/plain; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            h.send_header(key, value)
        h.end_headers()
        if not head:
            h.wfile.write(body)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a release folder like GitHub Releases.")
    parser.add_argument("directory", type=Path, help="the release folder (what release/make_release.py wrote)")
    parser.add_argument("--tag", default="v0.1.0", help="the release tag (default: v0.1.0)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--quiet", action="store_true", help="do not print each request")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a folder")

    def show(request: Request) -> None:
        print(f"{request.method} {request.path}", file=sys.stderr, flush=True)

    with ReleaseServer(args.directory.parent, port=args.port, on_request=None if args.quiet else show) as server:
        server.add_release(args.tag, args.directory)
        print(f"CUDELTA_WHEEL_URL={server.base_url(args.tag)}")
        for index in sorted((args.directory / "whl").glob("*/")):
            print(f"pip install cudelta --extra-index-url {server.index_url(index.name)}")
        print("serving until Ctrl-C", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
