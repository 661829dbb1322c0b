"""Corporate networks, end to end: real pip installing the sdist from a release mirror that is
reachable only the corporate way.

- An https mirror on 127.0.0.1 whose certificate is signed by a private CA (trustme): the prebuilt
  wheel installs with the CA given as PIP_CERT or as SSL_CERT_FILE, and not without it.
- A real forward proxy (proxy.py, tests/e2e/corp_proxy.py) in front of a mirror named
  `mirror.cudelta.test`, a name that only the proxy resolves (to 127.0.0.1), as an internal host
  behind a corporate proxy: the wheel installs through HTTPS_PROXY and through PIP_PROXY, the
  proxy's own access log holds the tunnel, and without a proxy variable the mirror is unreachable.
  (Loopback URLs are never proxied, so a mirror on 127.0.0.1 could not show the proxy is used.)

pip itself never needs the network here: build requirements come from a local wheelhouse
(`--no-index --find-links`), under default build isolation and with `--no-build-isolation`.
"""

from __future__ import annotations

import ssl

import pytest
from conftest import BUILD_REQS, TAG, clean_env, find_uv, pip_output, run
from corp_proxy import DOMAIN, CorporateProxy
from release_server import ReleaseServer
from test_pip_install import asset_name, installed_record

pytestmark = pytest.mark.e2e

MIRROR_HOST = f"mirror.{DOMAIN}"
# What the developer's or CI's shell may set for its own network; each case sets only its own.
NETWORK_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "PIP_PROXY",
                     "http_proxy", "https_proxy", "all_proxy", "no_proxy",
                     "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory):
    """(CA PEM path, server SSL context) of a CA no trust store knows, certifying the mirror's names."""
    import trustme

    ca = trustme.CA(organization_name="cudelta corp test CA")
    pem = tmp_path_factory.mktemp("ca") / "corp-ca.pem"
    ca.cert_pem.write_to_path(str(pem))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(MIRROR_HOST, "127.0.0.1", "localhost").configure_cert(context)
    return pem, context


@pytest.fixture
def tls_mirror(release_dir, private_ca):
    with ReleaseServer(release_dir.parent, ssl_context=private_ca[1]) as srv:
        srv.add_release(TAG, release_dir)
        yield srv


@pytest.fixture
def proxied_mirror(release_dir, private_ca):
    with ReleaseServer(release_dir.parent, ssl_context=private_ca[1], host_name=MIRROR_HOST) as srv:
        srv.add_release(TAG, release_dir)
        yield srv


@pytest.fixture
def corp_proxy(tmp_path):
    with CorporateProxy(tmp_path / "proxy") as proxy:
        yield proxy


def network_env(mirror, tmp_path, **extra):
    # CUDELTA_NO_BUILD: a download that fails fails the install at once, instead of a long compile.
    env = clean_env(CUDELTA_WHEEL_URL=mirror.base_url(TAG), CUDELTA_CACHE_DIR=str(tmp_path / "cache"),
                    CUDELTA_NO_BUILD="1")
    for name in NETWORK_VARIABLES:
        env.pop(name, None)
    env.update(extra)
    return env


def install(env_dir, sdist, wheelhouse, env, *, isolation, check=True):
    args = ["install", "-v", "--no-index", "--find-links", wheelhouse]
    if not isolation:
        args.append("--no-build-isolation")
    return env_dir.pip(*args, sdist, env=env, check=check)


def venv_for(fresh_venv, base_cu, wheelhouse, isolation):
    env = fresh_venv(base_cu)
    if not isolation:  # the build requirements, truststore among them, where the build runs
        env.pip("install", "-q", "--no-index", "--find-links", wheelhouse, *BUILD_REQS)
    return env


def downloaded(mirror, asset):
    return [p for p in mirror.paths() if p.endswith(f"/{asset}")]


@pytest.mark.parametrize("variable,isolation", [("PIP_CERT", True), ("SSL_CERT_FILE", False)],
                         ids=["PIP_CERT-isolated", "SSL_CERT_FILE-no-build-isolation"])
def test_an_https_mirror_signed_by_a_private_ca_installs_with_the_ca_given_the_pip_way(
        variable, isolation, base_cu, fresh_venv, sdist, build_wheelhouse, tls_mirror, private_ca, release_dir,
        tmp_path):
    env = venv_for(fresh_venv, base_cu, build_wheelhouse, isolation)
    asset = asset_name(release_dir)
    pem = private_ca[0]
    out = pip_output(install(env, sdist, build_wheelhouse, network_env(tls_mirror, tmp_path, **{variable: str(pem)}),
                             isolation=isolation))
    print("\n".join(line for line in out.splitlines() if "cudelta:" in line))

    assert f"reaching 127.0.0.1 trusting {pem} ({variable}) and the system trust store (truststore)" in out
    assert f"installing prebuilt {asset} (sha256 verified against the manifest embedded in the sdist)" in out
    assert installed_record(env)["build"]["build"] == "release"
    assert len(downloaded(tls_mirror, asset)) == 2  # the download URL, then its 302 to storage, over TLS


def test_without_the_private_ca_the_mirror_is_not_trusted_and_nothing_is_installed(
        base_cu, fresh_venv, sdist, build_wheelhouse, tls_mirror, release_dir, tmp_path):
    env = fresh_venv(base_cu)
    proc = install(env, sdist, build_wheelhouse, network_env(tls_mirror, tmp_path),
                   isolation=True, check=False)
    out = pip_output(proc)
    print("\n".join(line for line in out.splitlines() if "cudelta:" in line))

    assert proc.returncode != 0
    assert "TLS certificate not trusted (CERTIFICATE_VERIFY_FAILED): checked against the system trust store " \
           "(truststore); for a private or corporate CA set PIP_CERT, SSL_CERT_FILE or REQUESTS_CA_BUNDLE" in out
    assert "Traceback" not in out
    assert tls_mirror.paths() == []  # no request got past the handshake
    assert any("UNKNOWN_CA" in str(e) or "unknown ca" in str(e) for e in tls_mirror.errors)
    assert not env.has("cudelta")


@pytest.mark.parametrize("proxy_variable,ca_variable,isolation",
                         [("HTTPS_PROXY", "PIP_CERT", True), ("PIP_PROXY", "SSL_CERT_FILE", False)],
                         ids=["HTTPS_PROXY-isolated", "PIP_PROXY-no-build-isolation"])
def test_a_mirror_only_the_corporate_proxy_reaches_installs_through_it(
        proxy_variable, ca_variable, isolation, base_cu, fresh_venv, sdist, build_wheelhouse, proxied_mirror,
        corp_proxy, private_ca, release_dir, tmp_path):
    env = venv_for(fresh_venv, base_cu, build_wheelhouse, isolation)
    asset = asset_name(release_dir)
    e = network_env(proxied_mirror, tmp_path, **{proxy_variable: corp_proxy.url, ca_variable: str(private_ca[0])})
    out = pip_output(install(env, sdist, build_wheelhouse, e, isolation=isolation))
    print("\n".join(line for line in out.splitlines() if "cudelta:" in line))

    assert (f"reaching {MIRROR_HOST} through the proxy {corp_proxy.url} ({proxy_variable}), trusting "
            f"{private_ca[0]} ({ca_variable}) and the system trust store (truststore)") in out
    assert f"installing prebuilt {asset} (sha256 verified against the manifest embedded in the sdist)" in out
    assert installed_record(env)["build"]["build"] == "release"
    tunnels = corp_proxy.connects(wait_for=MIRROR_HOST)
    print("proxy.py access log, CONNECT lines:", tunnels)
    assert f"{MIRROR_HOST}:{proxied_mirror.port}" in tunnels
    assert len(downloaded(proxied_mirror, asset)) == 2


def test_uv_builds_in_its_own_venv_and_reaches_the_mirror_through_the_proxy_too(
        fresh_venv, base_cu, sdist, build_wheelhouse, proxied_mirror, corp_proxy, private_ca, release_dir, tmp_path):
    # uv's build venv has no pip to borrow a truststore from: the build requirement brings it.
    uv = find_uv()
    if uv is None:
        pytest.fail("uv is not installed next to the test interpreter (scripts/test.sh installs it)")
    env = fresh_venv(base_cu)
    asset = asset_name(release_dir)
    e = network_env(proxied_mirror, tmp_path, HTTPS_PROXY=corp_proxy.url, SSL_CERT_FILE=str(private_ca[0]))
    proc = run([uv, "pip", "install", "--python", env.python, "-v", "--no-cache", "--no-deps", "--no-index",
                "--find-links", build_wheelhouse, sdist], env=e, check=False)
    out = pip_output(proc)
    print("\n".join(line for line in out.splitlines() if "cudelta:" in line))

    assert proc.returncode == 0, out
    assert (f"reaching {MIRROR_HOST} through the proxy {corp_proxy.url} (HTTPS_PROXY), trusting "
            f"{private_ca[0]} (SSL_CERT_FILE) and the system trust store (truststore)") in out
    assert f"installing prebuilt {asset}" in out
    assert installed_record(env)["build"]["build"] == "release"
    assert f"{MIRROR_HOST}:{proxied_mirror.port}" in corp_proxy.connects(wait_for=MIRROR_HOST)


def test_without_a_proxy_variable_the_mirror_behind_the_proxy_is_out_of_reach(
        base_cu, fresh_venv, sdist, build_wheelhouse, proxied_mirror, corp_proxy, private_ca, tmp_path):
    # The control of the case above: same mirror, same CA, no proxy setting. NO_PROXY naming the
    # mirror must bypass a set proxy the same way.
    env = fresh_venv(base_cu)
    for extra, hint in (({}, "behind a proxy, set HTTPS_PROXY (or PIP_PROXY)"),
                        ({"HTTPS_PROXY": corp_proxy.url, "NO_PROXY": f".{DOMAIN}"}, "reached directly, as NO_PROXY says")):
        e = network_env(proxied_mirror, tmp_path, PIP_CERT=str(private_ca[0]), **extra)
        proc = install(env, sdist, build_wheelhouse, e, isolation=True, check=False)
        out = pip_output(proc)
        print("\n".join(line for line in out.splitlines() if "cudelta:" in line))

        assert proc.returncode != 0
        assert f"could not download https://{MIRROR_HOST}:{proxied_mirror.port}/" in out
        assert hint in out
        assert not env.has("cudelta")
    assert proxied_mirror.paths() == [] and corp_proxy.connects() == []
