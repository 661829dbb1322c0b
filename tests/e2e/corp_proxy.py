"""A corporate forward proxy on 127.0.0.1 for installer tests: proxy.py (a real CONNECT proxy) with
the one thing a corporate proxy has that this machine lacks, its own DNS.

Names under `.cudelta.test` (a TLD reserved by RFC 2606, which no resolver answers) resolve to
127.0.0.1 inside the proxy only. A mirror served on such a name is therefore reachable through the
proxy and through nothing else, as an internal host is from a locked-down workstation: an install
that gets the mirror's wheel went through the proxy, and the proxy's own access log says so.

    with CorporateProxy(tmp_path) as proxy:
        env["HTTPS_PROXY"] = proxy.url
        ...
        proxy.connects()  # ['mirror.cudelta.test:41234', ...] from proxy.py's access log
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

from proxy.http.proxy import HttpProxyBasePlugin

DOMAIN = "cudelta.test"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# proxy.py's access log line for a tunnel: "127.0.0.1:5555 - CONNECT mirror.cudelta.test:443 - 1234 bytes - 5.00ms"
_CONNECT = re.compile(r" - CONNECT (\S+) - ")


class CorporateDns(HttpProxyBasePlugin):
    """The proxy's resolver: `*.cudelta.test` is 127.0.0.1; everything else as the system says."""

    def resolve_dns(self, host: str, port: int) -> Tuple[Optional[str], Optional[Tuple[str, int]]]:
        if host == DOMAIN or host.endswith("." + DOMAIN):
            return "127.0.0.1", None
        return None, None


class CorporateProxy:
    """proxy.py in a process of its own, on a free port of 127.0.0.1, until `close()`."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "proxy.log"
        port_file = workdir / "proxy.port"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent)}
        for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env.pop(name, None)  # the proxy itself connects directly
        self._process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "--hostname", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
             "--num-acceptors", "1", "--num-workers", "1", "--threaded", "--log-level", "INFO",
             "--log-file", str(self.log), "--plugins", f"{__name__}.CorporateDns"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"proxy.py did not start:\n{self.log.read_text() if self.log.exists() else ''}")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connects(self, wait_for: Optional[str] = None, timeout: float = 10.0) -> List[str]:
        """host:port of every CONNECT in the proxy's access log. proxy.py writes a tunnel's line when
        it closes, after the client has gone: with `wait_for`, wait up to `timeout` for a line
        naming it."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text() if self.log.exists() else ""
            found = _CONNECT.findall(text)
            if wait_for is None or any(wait_for in f for f in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def close(self) -> None:
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()

    def __enter__(self) -> "CorporateProxy":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
