"""Webhook POSTs that reach only the outside (docs/notifications.md, "Where webhooks may go").

Admission judged what a webhook URL spells; here, at delivery, :func:`post` judges where it
really goes, with the contract's rule (:mod:`schemas.egress`):

1. the URL's host as written (an address in any spelling, ``localhost``);
2. every address the host resolves to: one refused address refuses the URL;
3. the connection goes to an address that was checked (pinned): the request's URL names the
   address, its ``Host`` header the host, and for https the TLS server name and the certificate
   check stay the host's (httpcore's ``sni_hostname``). A DNS answer that changes between the
   check and the connection (rebinding) is never asked for. A pinned https connection is not
   kept for another request (``Connection: close``): its certificate proved one name only, and
   another name may resolve to the same address;
4. redirects are followed here, never by httpx, each target checked from step 1.

A refusal raises :class:`EgressRefused` before anything is sent to the refused address: no try
would fare better, so it is dead-lettered at once, never retried. Everything else that goes wrong
(a name that does not resolve, a refused connection, too many redirects) is an ``httpx.HTTPError``
like any failed try.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin

import httpx

from schemas.egress import (
    Address,
    EgressRule,
    Network,
    Refusal,
    address_refusal,
    host_refusal,
    ip_literal,
    url_refusal,
)

REDIRECTS = (301, 302, 303, 307, 308)
DEFAULT_PORTS = {"http": 80, "https": 443}

Resolver = Callable[[str, int], Awaitable[list[Address]]]
"""Host and port -> the addresses to connect to, in the order to try them."""


class EgressRefused(Exception):
    """A webhook URL, or a redirect's target (``redirected_from``: the URL that sent there), that
    may not be reached: the rule, the address as understood and the URL, in a message a person
    reads on the delivery log."""

    def __init__(self, url: str, refusal: Refusal, redirected_from: str | None = None) -> None:
        super().__init__(refusal.message(_shown(url, redirected_from)))
        self.url, self.refusal, self.redirected_from = url, refusal, redirected_from

    @property
    def rule(self) -> EgressRule:
        return self.refusal.rule

    @property
    def address(self) -> str:
        return self.refusal.address


async def resolve(host: str, port: int) -> list[Address]:
    """The system resolver's addresses for ``host`` (getaddrinfo), in its order, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))


async def post(http: httpx.AsyncClient, url: str, *, content: bytes, headers: dict[str, str],
               allow: tuple[Network, ...] | list[Network] = (), max_redirects: int = 3,
               resolver: Resolver = resolve) -> httpx.Response:
    """POST ``content`` to ``url`` if it, and every redirect's target, reach only addresses the
    rule accepts (or ``allow`` lists); the last answer. A 303, and a 301 or 302 to a POST, go on
    as a GET without the body (as browsers and httpx do); a 307 or 308 repeats the POST."""
    method, target, source = "POST", url, None
    for _ in range(max_redirects + 1):
        response = await _send(http, method, target, source, content, headers, allow, resolver)
        location = response.headers.get("Location")
        if response.status_code not in REDIRECTS or location is None:
            return response
        source, target = target, urljoin(target, location)
        if response.status_code == 303 or (response.status_code in (301, 302) and method == "POST"):
            method, content = "GET", b""
            headers = {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}
    raise httpx.TooManyRedirects(f"more than {max_redirects} redirects from {url}", request=response.request)


def _shown(url: str, source: str | None) -> str:
    return url if source is None else f"{url} (a redirect from {source})"


async def _send(http: httpx.AsyncClient, method: str, url: str, source: str | None, content: bytes,
                headers: dict[str, str], allow: tuple[Network, ...] | list[Network],
                resolver: Resolver) -> httpx.Response:
    """One request, not following redirects, to an address of ``url``'s host that was checked
    (``source``: the URL that redirected here)."""
    parsed, addresses = await _checked(url, source, allow, resolver, http.timeout.connect)
    pinned_headers = {**headers, "Host": parsed.netloc.decode("ascii")}
    extensions = {}
    host = parsed.raw_host.decode("ascii")
    if parsed.scheme == "https" and ip_literal(host) is None:
        extensions["sni_hostname"] = host  # the certificate is checked against the name, not the address
        pinned_headers["Connection"] = "close"
    # One address after another, as a client does when one of a host's addresses is unreachable.
    for address in addresses[:-1]:
        try:
            return await _send_to(http, method, parsed, address, content, pinned_headers, extensions)
        except httpx.ConnectError:
            continue
    return await _send_to(http, method, parsed, addresses[-1], content, pinned_headers, extensions)


async def _checked(url: str, source: str | None, allow: tuple[Network, ...] | list[Network], resolver: Resolver,
                   timeout_s: float | None) -> tuple[httpx.URL, list[Address]]:
    """``url`` as httpx reads it and the addresses its host resolves to, all accepted by the
    rule; EgressRefused naming the first that is not."""
    if url.split(":", 1)[0].lower() not in DEFAULT_PORTS:
        raise httpx.UnsupportedProtocol(f"{_shown(url, source)}: accepted: http:// or https:// URLs")
    # The host as the contract reads it (every spelling of an address), then as httpx does.
    if (refused := url_refusal(url, allow)) is not None:
        raise EgressRefused(url, refused, source)
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        raise EgressRefused(url, Refusal(EgressRule.MALFORMED, "its host"), source) from None
    host = parsed.raw_host.decode("ascii")
    if (refused := host_refusal(host, allow)) is not None:
        raise EgressRefused(url, refused, source)
    if (literal := ip_literal(host)) is not None:
        return parsed, [literal]
    addresses = await _resolve(host, parsed.port or DEFAULT_PORTS[parsed.scheme], timeout_s, resolver)
    for address in addresses:
        if (refused := address_refusal(address, allow)) is not None:
            named = dataclasses.replace(refused, address=f"{refused.address} (an address of {host})")
            raise EgressRefused(url, named, source)
    return parsed, addresses


async def _send_to(http: httpx.AsyncClient, method: str, url: httpx.URL, address: Address, content: bytes,
                   headers: dict[str, str], extensions: dict[str, str]) -> httpx.Response:
    pinned = url.copy_with(host=str(address).split("%", 1)[0])
    request = http.build_request(method, pinned, content=content or None, headers=headers, extensions=extensions)
    return await http.send(request, follow_redirects=False)


async def _resolve(host: str, port: int, timeout_s: float | None, resolver: Resolver) -> list[Address]:
    try:
        addresses = await asyncio.wait_for(resolver(host, port), timeout_s)
    except TimeoutError:
        raise httpx.ConnectTimeout(f"resolving {host} took more than {timeout_s} s") from None
    except OSError as err:  # socket.gaierror: no such name, or no resolver
        raise httpx.ConnectError(f"cannot resolve {host}: {err}") from None
    if not addresses:
        raise httpx.ConnectError(f"{host} resolves to no address")
    return addresses
