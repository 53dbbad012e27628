"""services.notifier.egress.post against real HTTP(S) servers on loopback addresses: a refused
target is never contacted (in any spelling, by name after resolution, or as a redirect's target);
the connection goes to the address that was checked, and for https the certificate is still
checked against the name; redirects are followed here, a few, with the method RFC 9110 gives."""

from __future__ import annotations

import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import ip_address, ip_network

import httpx
import pytest
import trustme

from schemas.egress import EgressRule
from services.notifier import egress
from services.notifier.egress import EgressRefused

BODY = b'{"kind": "succeeded"}'
HEADERS = {"Content-Type": "application/json", "Gpusched-Kind": "succeeded"}
ONLY_127_0_0_2 = [ip_network("127.0.0.2/32")]


class Server:
    """A real HTTP server on ``address``: answers each request with the next (status, headers) of
    ``answers`` (then 204) and keeps (method, path, headers, body)."""

    def __init__(self, address: str = "127.0.0.1", answers=(), tls: ssl.SSLContext | None = None) -> None:
        self.answers, self.got = list(answers), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.got.append((self.command, self.path, dict(self.headers), body))
                status, headers = server.answers.pop(0) if server.answers else (204, {})
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v.format(port=server.port))
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_GET = answer

            def log_message(self, *args) -> None:
                pass
        self.http = ThreadingHTTPServer((address, 0), Handler)
        if tls is not None:
            self.http.socket = tls.wrap_socket(self.http.socket, server_side=True)
        self.port = self.http.server_port
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def servers():
    made: list[Server] = []
    yield lambda *args, **kw: made.append(Server(*args, **kw)) or made[-1]
    for s in made:
        s.close()


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=5) as client:
        yield client


def resolver(names: dict[str, list[str]], calls: list[str] | None = None):
    """A resolver hook that knows ``names`` only (the system's would not know them: a request
    that reaches a server did so through the address checked here)."""
    async def resolve(host: str, port: int):
        if calls is not None:
            calls.append(host)
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ip_address(a) for a in names[host]]
    return resolve


# -- (a) a refused target is never contacted --------------------------------------------------


@pytest.mark.parametrize("spelling", ["127.0.0.1", "2130706433", "0x7f.0.0.1", "0177.0.0.1", "127.1",
                                      "[::ffff:127.0.0.1]", "localhost"])
async def test_a_refused_target_is_never_contacted_in_any_spelling(servers, http, spelling):
    target = servers("127.0.0.1")
    url = f"http://{spelling}:{target.port}/hook"
    with pytest.raises(EgressRefused) as refused:
        await egress.post(http, url, content=BODY, headers=HEADERS, allow=ONLY_127_0_0_2)
    assert refused.value.rule in (EgressRule.LOOPBACK, EgressRule.LOCALHOST)
    assert refused.value.url == url
    assert str(refused.value).startswith(f"webhook url {url} refused: ")
    assert target.got == []


async def test_an_allowed_address_is_delivered_to(servers, http):
    target = servers("127.0.0.1")
    response = await egress.post(http, f"http://127.0.0.1:{target.port}/hook", content=BODY, headers=HEADERS,
                                 allow=[ip_network("127.0.0.0/8")])
    assert response.status_code == 204
    ((method, path, headers, body),) = target.got
    assert (method, path, body, headers["Host"], headers["Gpusched-Kind"]) == (
        "POST", "/hook", BODY, f"127.0.0.1:{target.port}", "succeeded")


# -- (b) redirects ------------------------------------------------------------------------------


async def test_a_redirect_to_a_refused_address_is_refused_at_the_redirect(servers, http):
    inside = servers("127.0.0.1")
    allowed = servers("127.0.0.2", answers=[(307, {"Location": f"http://127.0.0.1:{inside.port}/steal"})])
    url = f"http://127.0.0.2:{allowed.port}/hook"
    with pytest.raises(EgressRefused) as refused:
        await egress.post(http, url, content=BODY, headers=HEADERS, allow=ONLY_127_0_0_2)
    assert (refused.value.rule, refused.value.address) == (EgressRule.LOOPBACK, "127.0.0.1")
    assert (refused.value.url, refused.value.redirected_from) == (f"http://127.0.0.1:{inside.port}/steal", url)
    assert str(refused.value).startswith(
        f"webhook url http://127.0.0.1:{inside.port}/steal (a redirect from {url}) refused: 127.0.0.1 is a loopback "
        "address; webhooks reach public addresses only")
    assert [g[0] for g in allowed.got] == ["POST"] and inside.got == []


@pytest.mark.parametrize("location, rule", [
    ("http://localhost:{port}/", EgressRule.LOCALHOST),
    ("http://2130706433:{port}/", EgressRule.LOOPBACK),
    ("http://internal.test:{port}/", EgressRule.LOOPBACK),  # a name resolving to loopback
    ("http://169.254.169.254/latest/meta-data/", EgressRule.LINK_LOCAL),
])
async def test_every_redirect_target_is_checked_again(servers, http, location, rule):
    inside = servers("127.0.0.1")
    allowed = servers("127.0.0.2", answers=[(302, {"Location": location.replace("{port}", str(inside.port))})])
    with pytest.raises(EgressRefused) as refused:
        await egress.post(http, f"http://127.0.0.2:{allowed.port}/hook", content=BODY, headers=HEADERS,
                          allow=ONLY_127_0_0_2, resolver=resolver({"internal.test": ["127.0.0.1"]}))
    assert refused.value.rule is rule
    assert len(allowed.got) == 1 and inside.got == []


@pytest.mark.parametrize("status, method, body", [(307, "POST", BODY), (308, "POST", BODY), (303, "GET", b""),
                                                  (302, "GET", b""), (301, "GET", b"")])
async def test_a_redirect_keeps_or_changes_the_method_as_the_rfc_says(servers, http, status, method, body):
    allowed = servers("127.0.0.2", answers=[(status, {"Location": "/moved?x=1"})])  # relative: the same server
    response = await egress.post(http, f"http://127.0.0.2:{allowed.port}/hook", content=BODY, headers=HEADERS,
                                 allow=ONLY_127_0_0_2)
    assert response.status_code == 204
    (first, second) = allowed.got
    assert (first[0], first[1], first[3]) == ("POST", "/hook", BODY)
    assert (second[0], second[1], second[3]) == (method, "/moved?x=1", body)
    assert ("Content-Type" in second[2]) is (method == "POST")


async def test_too_many_redirects_is_a_failed_try(servers, http):
    loop = servers("127.0.0.2", answers=[(307, {"Location": "/again"})] * 10)
    with pytest.raises(httpx.TooManyRedirects):
        await egress.post(http, f"http://127.0.0.2:{loop.port}/hook", content=BODY, headers=HEADERS,
                          allow=ONLY_127_0_0_2, max_redirects=2)
    assert len(loop.got) == 3


async def test_a_redirect_to_another_scheme_is_not_followed(servers, http):
    allowed = servers("127.0.0.2", answers=[(302, {"Location": "file:///etc/passwd"})])
    with pytest.raises(httpx.UnsupportedProtocol):
        await egress.post(http, f"http://127.0.0.2:{allowed.port}/hook", content=BODY, headers=HEADERS,
                          allow=ONLY_127_0_0_2)


# -- (c) names are judged by what they resolve to ------------------------------------------------


async def test_a_name_resolving_to_loopback_is_refused_after_resolution(servers, http):
    target = servers("127.0.0.1")
    for answer in (["127.0.0.1"], ["8.8.8.8", "127.0.0.1"]):  # any refused address refuses the name
        url = f"http://hook.test:{target.port}/"
        with pytest.raises(EgressRefused) as refused:
            await egress.post(http, url, content=BODY, headers=HEADERS, allow=ONLY_127_0_0_2,
                              resolver=resolver({"hook.test": answer}))
        assert (refused.value.rule, refused.value.address) == (EgressRule.LOOPBACK,
                                                               "127.0.0.1 (an address of hook.test)")
        assert "refused: 127.0.0.1 (an address of hook.test) is a loopback address;" in str(refused.value)
    assert target.got == []


async def test_this_machines_own_name_is_refused_with_the_system_resolver(servers, http):
    """The default resolver (getaddrinfo): this machine's name resolves to one of its own
    addresses, loopback or private (skipped where it resolves to a public one, or to none)."""
    name = socket.gethostname()
    try:
        addresses = await egress.resolve(name, 80)
    except OSError:
        pytest.skip(f"{name} does not resolve here")
    if all(egress.address_refusal(a) is None for a in addresses):
        pytest.skip(f"{name} resolves to public addresses here: {addresses}")
    with pytest.raises(EgressRefused) as refused:
        await egress.post(http, f"http://{name}:9/", content=BODY, headers=HEADERS)
    assert f"(an address of {name.lower()})" in refused.value.address


async def test_an_unknown_name_is_a_failed_try(http):
    with pytest.raises(httpx.ConnectError, match="cannot resolve nowhere.test"):
        await egress.post(http, "http://nowhere.test/", content=BODY, headers=HEADERS, resolver=resolver({}))


# -- pinning: the connection goes to the address that was checked --------------------------------


async def test_the_connection_goes_to_the_checked_address_with_the_names_host_header(servers, http):
    target = servers("127.0.0.2")
    calls: list[str] = []
    response = await egress.post(http, f"http://hook.test:{target.port}/hook", content=BODY, headers=HEADERS,
                                 allow=ONLY_127_0_0_2, resolver=resolver({"hook.test": ["127.0.0.2"]}, calls))
    assert response.status_code == 204 and calls == ["hook.test"]  # resolved once, by the check
    ((_, _, headers, body),) = target.got
    assert (headers["Host"], body) == (f"hook.test:{target.port}", BODY)


async def test_an_unreachable_address_falls_back_to_the_next_checked_one(servers, http):
    target = servers("127.0.0.2")
    unused = socket.socket()
    unused.bind(("127.0.0.3", target.port))  # bound, not listening: the connection is refused
    try:
        response = await egress.post(http, f"http://hook.test:{target.port}/", content=BODY, headers=HEADERS,
                                     allow=[ip_network("127.0.0.2/31")],
                                     resolver=resolver({"hook.test": ["127.0.0.3", "127.0.0.2"]}))
    finally:
        unused.close()
    assert response.status_code == 204 and len(target.got) == 1


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


def tls_server(servers, ca, name: str) -> Server:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    return servers("127.0.0.2", tls=context)


@pytest.fixture
async def https(ca):
    context = ssl.create_default_context()
    ca.configure_trust(context)
    async with httpx.AsyncClient(timeout=5, verify=context) as client:
        yield client


async def test_https_to_a_pinned_address_checks_the_certificate_against_the_name(servers, ca, https):
    target = tls_server(servers, ca, "hook.test")
    response = await egress.post(https, f"https://hook.test:{target.port}/hook", content=BODY, headers=HEADERS,
                                 allow=ONLY_127_0_0_2, resolver=resolver({"hook.test": ["127.0.0.2"]}))
    assert response.status_code == 204
    ((_, _, headers, _),) = target.got
    assert (headers["Host"], headers["Connection"]) == (f"hook.test:{target.port}", "close")


async def test_https_to_a_server_whose_certificate_is_for_another_name_fails(servers, ca, https):
    target = tls_server(servers, ca, "other.test")
    with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
        await egress.post(https, f"https://hook.test:{target.port}/hook", content=BODY, headers=HEADERS,
                          allow=ONLY_127_0_0_2, resolver=resolver({"hook.test": ["127.0.0.2"]}))
    assert target.got == []
