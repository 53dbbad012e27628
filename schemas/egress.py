"""Where an outbound call made for a team (a webhook) may go: public addresses only, never the
platform's own network (docs/notifications.md, "Where webhooks may go"). A pure rule, no I/O:
admission applies it to the host a URL names; the notifier applies it again to every address that
host resolves to, on every redirect.

An address is refused by the first rule it meets (:class:`EgressRule`), unless it lies in a
network of the operator's allow-list (``GPUSCHED_WEBHOOK_ALLOW``). An IPv4 address carried inside
an IPv6 one (IPv4-mapped ``::ffff:0:0/96``, IPv4-compatible ``::/96``, NAT64 ``64:ff9b::/96``,
6to4 ``2002::/16``) is judged as that IPv4 address, since that is where a connection ends up. A
host is read the way the C library's resolver reads it, so that every spelling of an address
is recognised: an IPv4 literal may be dotted decimal, one integer, octal or hex parts, or a short
form (``127.1``); an IPv6 literal may carry brackets and a zone id (``[fe80::1%25eth0]``). The
names ``localhost`` and ``*.localhost`` are this machine's whatever a resolver says (RFC 6761).
Any other name is not judged here: what it resolves to is.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from urllib.parse import urlsplit

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network

ALLOW_VARIABLE = "GPUSCHED_WEBHOOK_ALLOW"
"""The operator's allow-list: comma-separated CIDRs whose addresses a webhook may reach."""

ACCEPTED = f"webhooks reach public addresses only (an operator may allow a network with {ALLOW_VARIABLE})"
"""What a refusal says is accepted."""


class EgressRule(StrEnum):
    """Why an address, or a host, is refused; checked in this order."""

    UNSPECIFIED = "unspecified"  # 0.0.0.0, ::
    LOOPBACK = "loopback"  # 127.0.0.0/8, ::1
    LINK_LOCAL = "link-local"  # 169.254.0.0/16 (cloud metadata services), fe80::/10
    MULTICAST = "multicast"  # 224.0.0.0/4, ff00::/8
    PRIVATE = "private"  # RFC 1918, carrier-grade NAT 100.64.0.0/10, unique local fc00::/7
    RESERVED = "reserved"  # anything else that is not globally reachable: broadcast, 240.0.0.0/4, documentation, ...
    LOCALHOST = "localhost"  # the names localhost and *.localhost
    MALFORMED = "malformed"  # a host that is neither an IP address nor a host name


PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))

_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

_WHAT = {
    EgressRule.UNSPECIFIED: "the unspecified address",
    EgressRule.LOOPBACK: "a loopback address",
    EgressRule.LINK_LOCAL: "a link-local address",
    EgressRule.MULTICAST: "a multicast address",
    EgressRule.PRIVATE: "a private address",
    EgressRule.RESERVED: "a reserved address, not reachable on the internet",
    EgressRule.LOCALHOST: "a name of this machine",
    EgressRule.MALFORMED: "neither an IP address nor a host name",
}


@dataclass(frozen=True)
class Refusal:
    """A refused host: the rule, and the address as understood (or the name)."""

    rule: EgressRule
    address: str  # e.g. "127.0.0.1", "127.0.0.1 (in ::ffff:7f00:1)", "localhost"

    @property
    def reason(self) -> str:
        """E.g. ``127.0.0.1 is a loopback address``."""
        return f"{self.address} is {_WHAT[self.rule]}"

    def message(self, url: str, what: str = "webhook url") -> str:
        """What a person is told: the URL (``what`` names it: a field), the rule, the address and
        what is accepted."""
        return f"{what} {url} refused: {self.reason}; {ACCEPTED}"


_IPV4_PART = re.compile(r"0[xX][0-9a-fA-F]*|0[0-7]*|[1-9][0-9]*")


def ipv4_literal(host: str) -> IPv4Address | None:
    """The IPv4 address ``host`` means to the C library's resolver (``inet_aton``), or None: one to
    four parts, each decimal, octal (leading 0) or hex (0x); the last part fills the bytes left,
    so ``2130706433``, ``0x7f000001``, ``0177.0.0.1``, ``127.1`` and ``127.0.1`` are all 127.0.0.1."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4 or not all(_IPV4_PART.fullmatch(p) for p in parts):
        return None
    numbers = [int(p[2:] or "0", 16) if p[:2].lower() == "0x" else int(p, 8 if p.startswith("0") else 10)
               for p in parts]
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (4 - len(leading)):
        return None
    value = last
    for i, n in enumerate(leading):
        value += n << (8 * (3 - i))
    return IPv4Address(value)


def embedded_ipv4(address: Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 address carries to (IPv4-mapped, IPv4-compatible, NAT64, 6to4)."""
    if isinstance(address, IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if (address in _IPV4_COMPATIBLE and int(address) > 1) or address in _NAT64:  # :: and ::1 are themselves
        return IPv4Address(int(address) & 0xFFFF_FFFF)
    return address.sixtofour


def _rule(address: Address) -> EgressRule | None:
    if address.is_unspecified:
        return EgressRule.UNSPECIFIED
    if address.is_loopback:
        return EgressRule.LOOPBACK
    if address.is_link_local:
        return EgressRule.LINK_LOCAL
    if address.is_multicast:
        return EgressRule.MULTICAST
    if any(address in network for network in PRIVATE_NETWORKS):
        return EgressRule.PRIVATE
    if address.is_reserved or not address.is_global:
        return EgressRule.RESERVED
    return None


def address_refusal(address: Address, allow: tuple[Network, ...] | list[Network] = ()) -> Refusal | None:
    """Why a connection to ``address`` is refused, or None: it is public, or in ``allow``."""
    if isinstance(address, IPv6Address) and address.scope_id:
        address = IPv6Address(str(address).split("%", 1)[0])  # the zone says which link, not which address
    inner = embedded_ipv4(address)
    if any(a in network for a in (address, inner) if a is not None for network in allow):
        return None
    if inner is not None:
        rule = _rule(inner)
        return Refusal(rule, f"{inner} (in {address})") if rule is not None else None
    rule = _rule(address)
    return Refusal(rule, str(address)) if rule is not None else None


def ip_literal(host: str) -> Address | None:
    """The address a URL's host spells (brackets and an IPv6 zone id allowed), or None for a name."""
    host = host.removeprefix("[").removesuffix("]").removesuffix(".")
    if ":" in host:
        try:
            return IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return None
    return ipv4_literal(host)


def host_refusal(host: str, allow: tuple[Network, ...] | list[Network] = ()) -> Refusal | None:
    """Why a URL's host is refused, as written (before any name is resolved), or None."""
    address = ip_literal(host)
    if address is not None:
        return address_refusal(address, allow)
    name = host.lower().removesuffix(".")
    if name == "localhost" or name.endswith(".localhost"):
        return Refusal(EgressRule.LOCALHOST, name)
    if not name or ":" in name or "[" in name or "]" in name or "%" in name:
        return Refusal(EgressRule.MALFORMED, repr(host))
    return None


def url_refusal(url: str, allow: tuple[Network, ...] | list[Network] = ()) -> Refusal | None:
    """Why a webhook URL is refused by the host it names, or None (a name other than localhost
    is judged when it is resolved, by the notifier)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        host = None
    if host is None:
        return Refusal(EgressRule.MALFORMED, "its host")
    return host_refusal(host, allow)
