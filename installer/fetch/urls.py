"""URLs of release files: where an asset is, how a URL is shown, who may see the token, and
which redirects are followed. Pure: strings in, strings or FetchError out.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Optional
from urllib.parse import quote, urlparse, urlunparse
from urllib.request import url2pathname

from ..core.errors import FetchError

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
# The token raises GitHub's rate limit; any other host (a mirror, the storage host GitHub
# redirects to) must never see it.
TOKEN_HOSTS = frozenset({"github.com", "api.github.com"})


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
