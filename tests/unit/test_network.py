"""pip's network settings reach the downloader: which proxy and which certificates result from
which variables, on every hop, and what a failure says for the URL's scheme."""

import hashlib
import ssl
import sys
from pathlib import Path

import pytest
import requests
import responses
import trustme

from installer.core.errors import FetchError, SettingsError
from installer.core.settings import Settings
from installer.fetch import fetch, network
from installer.fetch.network import NetworkHints, Proxy, policy_from
from installer.fetch.transfer import describe_error, status_hint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_make_release beside this file
from test_make_release import load_module  # noqa: E402

ReleaseServer = load_module("release_server", Path(__file__).resolve().parents[1] / "e2e" / "release_server.py").ReleaseServer

NAME = "cudelta-0.1.0-cp310-abi3-manylinux_2_28_x86_64.whl"
BODY = b"PK\x03\x04 not really a wheel " * 100
SHA = hashlib.sha256(BODY).hexdigest()
MIRROR = "https://mirror.corp.example/cudelta/v0.1.0"


@pytest.fixture
def ca_files(tmp_path):
    paths = {}
    for name in ("pip", "requests", "openssl"):
        path = tmp_path / f"{name}-ca.pem"
        trustme.CA().cert_pem.write_to_path(str(path))
        paths[name] = path
    return paths


def policy(**env):
    return policy_from(Settings.from_env(env))


def proxy_of(url, **env):
    found = policy(**env).proxy_for(url)
    return (found.url, found.variable) if found else None


# -- proxies ----------------------------------------------------------------------------------------


def test_each_scheme_takes_its_own_variable():
    env = {"HTTPS_PROXY": "http://secure:3128", "HTTP_PROXY": "http://plain:3128"}
    assert proxy_of("https://github.com/x", **env) == ("http://secure:3128", "HTTPS_PROXY")
    assert proxy_of("http://mirror.corp/x", **env) == ("http://plain:3128", "HTTP_PROXY")


def test_lower_case_wins_over_upper_case_as_curl_reads_them():
    assert proxy_of("https://github.com/x", https_proxy="http://lower:1", HTTPS_PROXY="http://upper:2")[0] == "http://lower:1"


def test_pip_proxy_is_taken_only_where_no_proxy_variable_is_set():
    assert proxy_of("https://github.com/x", PIP_PROXY="proxy.corp:3128") == ("http://proxy.corp:3128", "PIP_PROXY")
    assert proxy_of("https://github.com/x", PIP_PROXY="http://pip:1", HTTPS_PROXY="http://env:2")[1] == "HTTPS_PROXY"
    assert proxy_of("https://github.com/x", PIP_PROXY="http://pip:1", ALL_PROXY="http://all:2")[1] == "ALL_PROXY"
    # An http mirror with only HTTPS_PROXY set falls to PIP_PROXY, as pip uses its proxy for both.
    assert proxy_of("http://mirror.corp/x", PIP_PROXY="http://pip:1", HTTPS_PROXY="http://env:2")[1] == "PIP_PROXY"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/r", "https://127.9.9.9/r", "http://[::1]:80/r",
                                 "http://localhost:8000/r", "https://LOCALHOST./r", "file:///srv/wheels"])
def test_this_machine_and_file_urls_are_always_direct(url):
    assert proxy_of(url, HTTPS_PROXY="http://p:1", HTTP_PROXY="http://p:1", PIP_PROXY="http://p:1") is None


def test_a_name_that_merely_resolves_here_is_still_proxied():
    # Only the proxy may know what the name means (a corporate proxy's own DNS): it is not ours to guess.
    assert proxy_of("https://mirror.cudelta.test/r", PIP_PROXY="http://p:1") == ("http://p:1", "PIP_PROXY")


@pytest.mark.parametrize("no_proxy,url,direct", [
    ("corp.example", "https://mirror.corp.example/r", True),
    (".corp.example", "https://corp.example/r", True),
    ("corp.example", "https://notcorp.example/r", False),
    ("10.0.0.0/8", "https://10.1.2.3/r", True),
    ("10.0.0.0/8", "https://11.1.2.3/r", False),
    ("mirror.corp:8443", "https://mirror.corp:8443/r", True),
    ("mirror.corp:8443", "https://mirror.corp/r", False),
    ("*", "https://github.com/r", True),
    ("a.example, b.example github.com", "https://api.github.com/r", True),
])
def test_no_proxy_covers_domains_networks_and_ports(no_proxy, url, direct):
    for env in ({"NO_PROXY": no_proxy, "HTTPS_PROXY": "http://p:1"}, {"no_proxy": no_proxy, "PIP_PROXY": "http://p:1"}):
        assert (proxy_of(url, **env) is None) is direct


@pytest.mark.parametrize("raw", ["ftp://proxy:21", "http://proxy:port", "http://", "http://pro xy:3128", "http://p\t:1",
                                 "http://[::1:3128", "http://proxy:99999", "http://p\x00:1"])
def test_a_bad_proxy_is_refused_by_name(raw):
    with pytest.raises(SettingsError, match=r"^HTTPS_PROXY is not accepted .*expected a proxy URL"):
        Settings.from_env({"HTTPS_PROXY": raw})


def test_a_refused_proxy_does_not_print_its_password():
    with pytest.raises(SettingsError) as err:
        Settings.from_env({"PIP_PROXY": "ftp://me:hunter2@proxy:21"})
    assert "hunter2" not in str(err.value) and "ftp://***@proxy:21" in str(err.value)


def test_proxy_credentials_stay_out_of_repr_and_messages():
    s = Settings.from_env({"HTTPS_PROXY": "http://me:hunter2@proxy:3128"})
    assert "hunter2" not in repr(s)
    assert policy_from(s).proxy_for("https://github.com/x").shown == "http://proxy:3128"


# -- certificates -----------------------------------------------------------------------------------


def test_ca_files_are_taken_in_pips_order(ca_files):
    every = {"PIP_CERT": str(ca_files["pip"]), "REQUESTS_CA_BUNDLE": str(ca_files["requests"]),
             "SSL_CERT_FILE": str(ca_files["openssl"])}
    assert policy(**every).trust.ca_file == ca_files["pip"]
    del every["PIP_CERT"]
    assert (policy(**every).trust.ca_file, policy(**every).trust.ca_variable) == (
        ca_files["requests"], "REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE")
    del every["REQUESTS_CA_BUNDLE"]
    assert (policy(**every).trust.ca_file, policy(**every).trust.ca_variable) == (ca_files["openssl"], "SSL_CERT_FILE")
    assert policy(CURL_CA_BUNDLE=str(ca_files["openssl"])).trust.ca_file == ca_files["openssl"]
    assert policy().trust.ca_file is None


@pytest.mark.parametrize("name", ["PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"])
def test_a_ca_file_that_is_not_there_is_refused_by_name(name, tmp_path):
    with pytest.raises(SettingsError, match=rf"^{name}='{tmp_path}/nope.pem' is not an existing file or folder"):
        Settings.from_env({name: str(tmp_path / "nope.pem")})
    for hostile in ("ca\x00.pem", "x" * 5000, "~no-such-user-here/ca.pem"):
        with pytest.raises(SettingsError, match=rf"^{name}=.*; expected the path of a PEM file of CA certificates"):
            Settings.from_env({name: hostile})


def test_no_proxy_with_a_control_character_is_refused():
    with pytest.raises(SettingsError, match=r"^NO_PROXY=.* is not accepted; expected host names"):
        Settings.from_env({"NO_PROXY": "corp.example,\x1b[31m"})


def test_the_system_trust_store_is_used_when_truststore_is_there(ca_files):
    import truststore

    trust = policy(PIP_CERT=str(ca_files["pip"])).trust
    assert trust.store == "system" and trust.truststore_module == "truststore"
    assert isinstance(network.ssl_context(trust), truststore.SSLContext)
    assert trust.words() == f"{ca_files['pip']} (PIP_CERT) and the system trust store (truststore)"


def test_without_truststore_the_ca_file_replaces_certifi(ca_files, monkeypatch):
    monkeypatch.setattr(network, "TRUSTSTORE_MODULES", ("no_such_truststore",))
    trust = policy(PIP_CERT=str(ca_files["pip"])).trust
    assert trust.store == "certifi" and "truststore is not installed" in trust.words()
    context = network.ssl_context(trust)
    assert type(context) is ssl.SSLContext and len(context.get_ca_certs()) == 1  # the private CA alone
    assert len(network.ssl_context(policy().trust).get_ca_certs()) > 50  # certifi's bundle


# -- the session: every hop routed and verified by the policy --------------------------------------


def fetcher(tmp_path, logs, **env):
    return fetch.Fetcher(Settings.from_env({"CUDELTA_CACHE_DIR": str(tmp_path / "cache"), "CUDELTA_HTTP_RETRIES": "0",
                                            **env}), backoff_factor=0, log=logs.append)


def test_each_hop_gets_its_own_proxy_and_requests_never_reads_the_environment(tmp_path, monkeypatch):
    # requests itself would take this one (trust_env): the settings do not have it, so it is not used.
    monkeypatch.setenv("HTTPS_PROXY", "http://from-requests-env:9")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tmp_path / "missing.pem"))
    logs = []
    f = fetcher(tmp_path, logs, PIP_PROXY="http://corp-proxy:3128")
    with responses.RequestsMock() as mocked:
        mocked.add(responses.GET, f"{MIRROR}/{NAME}", status=302, headers={"Location": f"http://127.0.0.1:8000/{NAME}"})
        mocked.add(responses.GET, f"http://127.0.0.1:8000/{NAME}", body=BODY)
        path = f.fetch_asset(MIRROR, NAME, SHA, len(BODY))
        hops = [(c.request.url, c.request.req_kwargs["proxies"], c.request.req_kwargs["verify"]) for c in mocked.calls]
    assert path.read_bytes() == BODY
    assert hops == [(f"{MIRROR}/{NAME}", {"https": "http://corp-proxy:3128"}, True),
                    (f"http://127.0.0.1:8000/{NAME}", {}, True)]  # the loopback hop goes direct
    assert "reaching mirror.corp.example through the proxy http://corp-proxy:3128 (PIP_PROXY)" in logs


def test_no_proxy_variables_means_direct_and_nothing_said(tmp_path):
    logs = []
    f = fetcher(tmp_path, logs)
    with responses.RequestsMock() as mocked:
        mocked.add(responses.GET, f"{MIRROR}/{NAME}", body=BODY)
        f.fetch_asset(MIRROR, NAME, SHA, len(BODY))
        assert mocked.calls[0].request.req_kwargs["proxies"] == {}
    assert not [line for line in logs if line.startswith("reaching")]


def test_the_ca_file_in_use_is_said_once_per_host(tmp_path, ca_files):
    logs = []
    f = fetcher(tmp_path, logs, SSL_CERT_FILE=str(ca_files["openssl"]))
    with responses.RequestsMock() as mocked:
        mocked.add(responses.GET, f"{MIRROR}/manifest.json", json={"assets": []})
        f.fetch_json(MIRROR, "manifest.json")
        f.fetch_json(MIRROR, "manifest.json")
    said = [line for line in logs if line.startswith("reaching")]
    assert said == [f"reaching mirror.corp.example trusting {ca_files['openssl']} (SSL_CERT_FILE) and the system "
                    "trust store (truststore)"]


# -- hints name the variables of the URL's scheme ---------------------------------------------------


def proxy_error(url):
    return requests.exceptions.ProxyError("Cannot connect to proxy.", request=requests.Request("GET", url).prepare())


@pytest.mark.parametrize("url,variable", [("http://mirror.corp/x", "HTTP_PROXY"), ("https://mirror.corp/x", "HTTPS_PROXY")])
def test_a_proxy_failure_names_the_variable_of_the_urls_scheme(url, variable):
    hints = policy(PIP_PROXY="http://proxy.corp:3128").hints(url)
    words = describe_error(proxy_error(url), 10, 30, hints)
    assert words == (f"could not go through the proxy http://proxy.corp:3128 from PIP_PROXY "
                     f"(check {variable} (or PIP_PROXY) / NO_PROXY)")


def test_an_unreachable_host_without_a_proxy_suggests_the_schemes_proxy_variable(tmp_path):
    logs = []
    f = fetcher(tmp_path, logs)
    with responses.RequestsMock() as mocked:
        mocked.add(responses.GET, f"http://mirror.corp/r/{NAME}",
                   body=requests.exceptions.ConnectionError(
                       __import__("urllib3").exceptions.NewConnectionError(None, "Name or service not known")))
        with pytest.raises(FetchError) as err:
            f.fetch_asset("http://mirror.corp/r", NAME, SHA, len(BODY))
    assert "behind a proxy, set HTTP_PROXY (or PIP_PROXY)" in str(err.value)


def test_an_untrusted_certificate_names_the_ca_variables_and_the_store_checked(ca_files):
    exc = requests.exceptions.SSLError(ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] self-signed"))
    words = describe_error(exc, 10, 30, policy(PIP_CERT=str(ca_files["pip"])).hints("https://mirror.corp/x"))
    assert words.startswith("TLS certificate not trusted")
    assert f"checked against {ca_files['pip']} (PIP_CERT) and the system trust store (truststore)" in words
    assert words.endswith("set PIP_CERT, SSL_CERT_FILE or REQUESTS_CA_BUNDLE to its PEM file")


@pytest.mark.parametrize("url,variable", [("http://mirror.corp/x", "HTTP_PROXY"), ("https://mirror.corp/x", "HTTPS_PROXY")])
def test_407_says_where_the_proxy_credentials_go(url, variable):
    response = requests.Response()
    response.status_code = 407
    assert status_hint(response, url, False, NetworkHints(None, f"{variable} (or PIP_PROXY) / NO_PROXY", "x")) == (
        f"; the proxy wants credentials: give them in {variable} as http://user:password@host:port")
    hints = NetworkHints(Proxy("http://p:1", "PIP_PROXY"), "", "x")
    assert "give them in PIP_PROXY" in status_hint(response, url, False, hints)


def test_a_host_sent_direct_by_no_proxy_says_so_when_unreachable():
    exc = requests.exceptions.ConnectionError(
        __import__("urllib3").exceptions.NewConnectionError(None, "Name or service not known"))
    hints = policy(HTTPS_PROXY="http://p:1", NO_PROXY=".corp").hints("https://mirror.corp/x")
    assert describe_error(exc, 10, 30, hints).endswith("; reached directly, as NO_PROXY says")
    assert not policy(HTTPS_PROXY="http://p:1").hints("https://127.0.0.1/x").no_proxy_bypassed


def test_a_real_tls_mirror_is_trusted_with_its_ca_file_and_refused_at_once_without(tmp_path, ca_files):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    (tmp_path / "rel").mkdir()
    (tmp_path / "rel" / NAME).write_bytes(BODY)
    with ReleaseServer(tmp_path, ssl_context=server_context) as server:
        server.add_release("v0.1.0", tmp_path / "rel")
        base = server.base_url("v0.1.0")
        with pytest.raises(FetchError) as err:
            fetcher(tmp_path, [], CUDELTA_HTTP_RETRIES="4", PIP_CERT=str(ca_files["pip"])).fetch_asset(
                base, NAME, SHA, len(BODY))  # another CA's file: still not this server's
        assert "TLS certificate not trusted (CERTIFICATE_VERIFY_FAILED)" in str(err.value)
        assert str(err.value).endswith("(1 attempt)")  # not retried
        path = fetcher(tmp_path, [], PIP_CERT=str(tmp_path / "ca.pem")).fetch_asset(base, NAME, SHA, len(BODY))
        assert path.read_bytes() == BODY
