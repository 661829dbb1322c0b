"""How the downloader reaches the network: which proxy for a URL, which certificates to trust.

The policy follows pip, so that an install whose pip reaches PyPI also reaches the release:
- **Trust**: the system trust store through `truststore`, as pip >= 24.2 does on Python >= 3.10
  (corporate TLS-inspecting proxies install their CA there, not in certifi's bundle). One CA file
  from the environment is added to it, the first set of: PIP_CERT (what the user told pip), then
  REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE (requests' own), then SSL_CERT_FILE (OpenSSL's). pip adds its
  `--cert` to the truststore context the same way (urllib3 loads it into the context pip passes).
  Without truststore, the file replaces certifi's bundle, as in pip's legacy mode and in requests.
- **Proxies**: `<scheme>_proxy` (lower case first, as curl and urllib read them), then ALL_PROXY,
  then PIP_PROXY (pip's `--proxy` as an environment variable: the only form that reaches a build).
  NO_PROXY is honoured for all of them. This machine (127.0.0.0/8, ::1, localhost) and `file://`
  are always direct: a proxy elsewhere would reach its own loopback, never ours.

Pure: `Settings` in, `NetworkPolicy` and strings out; `NetworkAdapter` carries the policy into
requests, so every hop (redirects included) is routed and verified by it and by nothing else.
"""

from __future__ import annotations

import importlib
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from requests.adapters import HTTPAdapter

from ..core.settings import Settings
from .urls import display_url, is_loopback

# The order a CA file is taken in: the first one set wins (see the module docstring).
CA_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE", "SSL_CERT_FILE")
CA_HINT = "PIP_CERT, SSL_CERT_FILE or REQUESTS_CA_BUNDLE"
# truststore is a build requirement (pyproject.toml): pip's isolated build env and uv's have no pip
# to borrow it from. Under --no-build-isolation it may be missing; pip >= 24.2 vendors a copy.
TRUSTSTORE_MODULES = ("truststore", "pip._vendor.truststore")


@dataclass(frozen=True)
class Proxy:
    url: str
    variable: str  # where it came from, for messages

    @property
    def shown(self) -> str:
        return display_url(self.url)  # without its user:password


@dataclass(frozen=True)
class Trust:
    store: str  # "system" (truststore) or "certifi"
    ca_file: Optional[Path]
    ca_variable: Optional[str]
    truststore_module: Optional[str]

    def words(self) -> str:
        base = "the system trust store (truststore)" if self.store == "system" else "certifi's CA bundle"
        if self.ca_file is None:
            return base
        if self.store == "system":
            return f"{self.ca_file} ({self.ca_variable}) and {base}"
        return f"{self.ca_file} ({self.ca_variable}; truststore is not installed)"


@dataclass(frozen=True)
class NetworkHints:
    """What error messages about one URL say: its proxy, the variables to change, what is trusted."""

    proxy: Optional[Proxy]
    proxy_variables: str  # e.g. "HTTPS_PROXY (or PIP_PROXY) / NO_PROXY"
    trust: str  # e.g. "the system trust store (truststore)"
    no_proxy_bypassed: bool = False  # a proxy is set, but NO_PROXY sends this URL direct


DEFAULT_HINTS = NetworkHints(None, "HTTPS_PROXY (or PIP_PROXY) / NO_PROXY", "the default CA certificates")


@dataclass(frozen=True)
class NetworkPolicy:
    http_proxy: Optional[Proxy]
    https_proxy: Optional[Proxy]
    no_proxy: tuple[str, ...]
    trust: Trust

    def proxy_for(self, url: str) -> Optional[Proxy]:
        """The proxy a request of `url` goes through; None: direct."""
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or is_loopback(parsed.hostname):
            return None
        if bypasses(parsed.hostname or "", parsed.port, self.no_proxy):
            return None
        return self.https_proxy if parsed.scheme == "https" else self.http_proxy

    def hints(self, url: str) -> NetworkHints:
        # The variables of the URL's own scheme: HTTPS_PROXY means nothing to an http mirror.
        scheme = "HTTP" if urlparse(url).scheme == "http" else "HTTPS"
        proxy = self.proxy_for(url)
        parsed = urlparse(url)
        configured = self.https_proxy if parsed.scheme == "https" else self.http_proxy
        bypassed = (proxy is None and configured is not None and not is_loopback(parsed.hostname)
                    and parsed.scheme in ("http", "https"))
        return NetworkHints(proxy, f"{scheme}_PROXY (or PIP_PROXY) / NO_PROXY", self.trust.words(), bypassed)


def policy_from(settings: Settings) -> NetworkPolicy:
    return NetworkPolicy(
        http_proxy=_first_proxy(settings, "http"),
        https_proxy=_first_proxy(settings, "https"),
        no_proxy=settings.no_proxy or (),
        trust=_trust(settings),
    )


def _first_proxy(settings: Settings, scheme: str) -> Optional[Proxy]:
    for url, variable in (
        (getattr(settings, f"{scheme}_proxy"), f"{scheme.upper()}_PROXY"),
        (settings.all_proxy, "ALL_PROXY"),
        (settings.pip_proxy, "PIP_PROXY"),
    ):
        if url:
            return Proxy(url, variable)
    return None


def _trust(settings: Settings) -> Trust:
    ca_file, ca_variable = next(
        ((path, name) for path, name in zip(
            (settings.pip_cert, settings.ca_bundle, settings.ssl_cert_file), CA_VARIABLES) if path is not None),
        (None, None),
    )
    module = find_truststore()
    return Trust("system" if module else "certifi", ca_file, ca_variable, module)


def find_truststore() -> Optional[str]:
    """The importable truststore module's name, None if there is none."""
    for name in TRUSTSTORE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        return name
    return None


def bypasses(host: str, port: Optional[int], no_proxy: tuple[str, ...]) -> bool:
    """NO_PROXY as curl and requests read it: '*', a domain and its subdomains ('.corp' or 'corp'),
    an IP address or network, each optionally with ':port'."""
    host = host.strip("[]").lower().rstrip(".")
    for entry in no_proxy:
        entry = entry.strip().lower()
        if entry == "*":
            return True
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if entry_port and entry_port != str(port):
            continue
        name = name.strip("[]").lstrip(".").rstrip(".")
        if not name:
            continue
        try:
            if ipaddress.ip_address(host) in ipaddress.ip_network(name, strict=False):
                return True
            continue
        except ValueError:
            pass
        if host == name or host.endswith("." + name):
            return True
    return False


def ssl_context(trust: Trust) -> ssl.SSLContext:
    """The context every https connection (direct or through a proxy's tunnel) is verified with."""
    if trust.truststore_module is not None:
        truststore = importlib.import_module(trust.truststore_module)
        context = truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if trust.ca_file is not None:
            _load(context, trust.ca_file)
        return context
    import certifi

    # PROTOCOL_TLS_CLIENT verifies certificates and host names, and trusts nothing until told.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    _load(context, trust.ca_file or Path(certifi.where()))
    return context


def _load(context: Any, path: Path) -> None:
    if path.is_dir():
        context.load_verify_locations(capath=str(path))
    else:
        context.load_verify_locations(cafile=str(path))


class NetworkAdapter(HTTPAdapter):
    """requests' adapter with the policy's proxy for each hop and its TLS context everywhere.

    The session's trust_env is off (installer/fetch/fetch.py): requests would otherwise read the proxy
    and CA variables itself, behind settings.py's back and in its own order.
    """

    def __init__(self, policy: NetworkPolicy, **kwargs: Any) -> None:
        self.policy = policy
        self.context = ssl_context(policy.trust)
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("ssl_context", self.context)
        super().init_poolmanager(*args, **kwargs)

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> Any:
        # requests builds the tunnel's pools without the pool manager's context: pass it on, or
        # a download through a proxy would be verified against certifi alone.
        kwargs.setdefault("ssl_context", self.context)
        return super().proxy_manager_for(proxy, **kwargs)

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        proxy = self.policy.proxy_for(request.url)
        kwargs["proxies"] = {urlparse(request.url).scheme: proxy.url} if proxy else {}
        # True: verify with the context above, which holds the CA file if one was given.
        kwargs["verify"] = True
        return super().send(request, *args, **kwargs)
