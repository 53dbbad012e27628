"""Where a webhook may go (schemas.egress): every spelling of an internal address is refused with
its rule and the address it means; public addresses and names pass; the operator's allow-list
(GPUSCHED_WEBHOOK_ALLOW) lets a network through, and a bad one stops the service at start."""

from __future__ import annotations

from ipaddress import IPv4Address, ip_address, ip_network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.settings import ConfigError, env_networks
from schemas.egress import EgressRule, address_refusal, host_refusal, ipv4_literal, url_refusal

LOOPBACK, LINK_LOCAL, PRIVATE = EgressRule.LOOPBACK, EgressRule.LINK_LOCAL, EgressRule.PRIVATE

REFUSED = [
    # (url, rule, the address as understood)
    ("http://169.254.169.254/latest/meta-data/", LINK_LOCAL, "169.254.169.254"),
    ("http://127.0.0.1:8222/varz", LOOPBACK, "127.0.0.1"),
    ("http://localhost:5432/", EgressRule.LOCALHOST, "localhost"),
    ("http://LocalHost./", EgressRule.LOCALHOST, "localhost"),
    ("http://api.localhost/", EgressRule.LOCALHOST, "api.localhost"),
    ("http://[::1]:22/", LOOPBACK, "::1"),
    ("http://[0:0:0:0:0:0:0:1]/", LOOPBACK, "::1"),
    # every spelling of 127.0.0.1 that the C library's resolver reads
    ("http://2130706433/", LOOPBACK, "127.0.0.1"),
    ("http://0177.0.0.1/", LOOPBACK, "127.0.0.1"),
    ("http://017700000001/", LOOPBACK, "127.0.0.1"),
    ("http://0x7f.0.0.1/", LOOPBACK, "127.0.0.1"),
    ("http://0X7F.0.0.1/", LOOPBACK, "127.0.0.1"),
    ("http://0x7f000001/", LOOPBACK, "127.0.0.1"),
    ("http://127.1/", LOOPBACK, "127.0.0.1"),
    ("http://127.0.1/", LOOPBACK, "127.0.0.1"),
    ("http://0x7f.1/", LOOPBACK, "127.0.0.1"),
    ("http://127.0.0.1./", LOOPBACK, "127.0.0.1"),
    ("http://0xa9fea9fe/", LINK_LOCAL, "169.254.169.254"),
    # IPv4 inside IPv6: mapped, compatible, NAT64, 6to4
    ("http://[::ffff:127.0.0.1]/", LOOPBACK, "127.0.0.1 (in ::ffff:7f00:1)"),
    ("http://[::ffff:7f00:1]/", LOOPBACK, "127.0.0.1 (in ::ffff:7f00:1)"),
    ("http://[::ffff:169.254.169.254]/", LINK_LOCAL, "169.254.169.254 (in ::ffff:a9fe:a9fe)"),
    ("http://[::127.0.0.1]/", LOOPBACK, "127.0.0.1 (in ::7f00:1)"),
    ("http://[64:ff9b::10.0.0.1]/", PRIVATE, "10.0.0.1 (in 64:ff9b::a00:1)"),
    ("http://[64:ff9b::7f00:1]/", LOOPBACK, "127.0.0.1 (in 64:ff9b::7f00:1)"),
    ("http://[2002:7f00:1::]/", LOOPBACK, "127.0.0.1 (in 2002:7f00:1::)"),
    ("http://[2002:c0a8:101::1]/", PRIVATE, "192.168.1.1 (in 2002:c0a8:101::1)"),
    # zone ids
    ("http://[fe80::1%25eth0]:8080/", LINK_LOCAL, "fe80::1"),
    ("http://[fe80::1]/", LINK_LOCAL, "fe80::1"),
    # private
    ("http://10.1.2.3/", PRIVATE, "10.1.2.3"),
    ("http://172.16.0.1/", PRIVATE, "172.16.0.1"),
    ("http://172.31.255.254/", PRIVATE, "172.31.255.254"),
    ("http://192.168.0.10/", PRIVATE, "192.168.0.10"),
    ("http://100.64.0.1/", PRIVATE, "100.64.0.1"),
    ("http://100.127.255.254/", PRIVATE, "100.127.255.254"),
    ("http://[fc00::1]/", PRIVATE, "fc00::1"),
    ("http://[fd12:3456::1]/", PRIVATE, "fd12:3456::1"),
    # multicast, unspecified, reserved and broadcast
    ("http://224.0.0.1/", EgressRule.MULTICAST, "224.0.0.1"),
    ("http://239.255.255.250/", EgressRule.MULTICAST, "239.255.255.250"),
    ("http://[ff02::1]/", EgressRule.MULTICAST, "ff02::1"),
    ("http://0.0.0.0/", EgressRule.UNSPECIFIED, "0.0.0.0"),
    ("http://0/", EgressRule.UNSPECIFIED, "0.0.0.0"),
    ("http://[::]/", EgressRule.UNSPECIFIED, "::"),
    ("http://255.255.255.255/", EgressRule.RESERVED, "255.255.255.255"),
    ("http://240.0.0.1/", EgressRule.RESERVED, "240.0.0.1"),
    ("http://192.0.2.1/", EgressRule.RESERVED, "192.0.2.1"),  # documentation
    ("http://[2001:db8::1]/", EgressRule.RESERVED, "2001:db8::1"),
    # not a host at all
    ("http://[::1/", EgressRule.MALFORMED, "its host"),
]

PUBLIC = [
    "http://8.8.8.8/", "https://1.1.1.1/hook", "http://[2606:4700:4700::1111]/", "https://example.com/hooks/a",
    "https://hooks.example:8443/x?y=1", "http://0x08080808/", "http://134744072/", "http://[::ffff:8.8.8.8]/",
    "http://[64:ff9b::8.8.8.8]/", "http://[2002:808:808::1]/", "http://172.32.0.1/", "http://100.128.0.1/",
    "https://localhost.example.com/", "https://mylocalhost/",
]


@pytest.mark.parametrize("url, rule, address", REFUSED)
def test_an_internal_address_in_any_spelling_is_refused_with_its_rule(url, rule, address):
    refusal = url_refusal(url)
    assert refusal is not None, f"{url} is accepted"
    assert (refusal.rule, refusal.address) == (rule, address)


@pytest.mark.parametrize("url", PUBLIC)
def test_public_addresses_and_names_pass(url):
    assert url_refusal(url) is None


def test_the_message_names_the_url_the_address_the_rule_and_what_is_accepted():
    assert url_refusal("http://2130706433/").message("http://2130706433/") == (
        "webhook url http://2130706433/ refused: 127.0.0.1 is a loopback address; webhooks reach public addresses "
        "only (an operator may allow a network with GPUSCHED_WEBHOOK_ALLOW)")
    assert url_refusal("http://[::ffff:7f00:1]/").reason == "127.0.0.1 (in ::ffff:7f00:1) is a loopback address"
    assert url_refusal("http://localhost/").reason == "localhost is a name of this machine"


@pytest.mark.parametrize("url, allow, refused", [
    ("http://127.0.0.1:8000/", ["127.0.0.0/8"], False),
    ("http://127.0.0.1:8000/", ["127.0.0.2/32"], True),
    ("http://2130706433/", ["127.0.0.1/32"], False),  # the address it means is allowed, however spelled
    ("http://[::ffff:127.0.0.1]/", ["127.0.0.0/8"], False),  # an embedded address counts as itself
    ("http://[::1]/", ["127.0.0.0/8"], True),
    ("http://[::1]/", ["127.0.0.0/8", "::1/128"], False),
    ("http://10.20.3.4/", ["10.20.0.0/16"], False),
    ("http://10.21.3.4/", ["10.20.0.0/16"], True),
    ("http://[fd00:1::5]/", ["fd00:1::/64"], False),
    ("http://localhost/", ["127.0.0.0/8", "::1/128"], True),  # a name is not an address: write the address
])
def test_the_allow_list_lets_its_networks_through(url, allow, refused):
    assert (url_refusal(url, [ip_network(n) for n in allow]) is not None) is refused


@pytest.mark.parametrize("host, address", [
    ("2130706433", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("017700000001", "127.0.0.1"), ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"), ("1.2.3.4", "1.2.3.4"), ("0x1.0x2.0x3.0x4", "1.2.3.4"), ("01.02.03.04", "1.2.3.4"),
    ("0", "0.0.0.0"), ("255.255.255.255", "255.255.255.255"), ("10.0x10000", "10.1.0.0"),
    # not IPv4 literals: names, to be resolved
    ("example.com", None), ("08.0.0.1", None), ("256.0.0.1", None), ("4294967296", None), ("1.2.3.4.5", None),
    ("1..2", None), ("", None), ("0x", "0.0.0.0"), ("127.0.0.256", None), ("1.16777216", None),
])
def test_ipv4_literals_are_read_as_the_c_library_reads_them(host, address):
    assert ipv4_literal(host) == (IPv4Address(address) if address else None)


def test_a_resolved_address_with_a_zone_is_judged_without_it():
    assert address_refusal(ip_address("fe80::1%eth0")).rule is LINK_LOCAL
    assert address_refusal(ip_address("fe80::1%eth0"), [ip_network("fe80::/10")]) is None


def test_hosts_as_written_brackets_and_all():
    assert host_refusal("[::1]").rule is LOOPBACK
    assert host_refusal("::1").rule is LOOPBACK
    assert host_refusal("[not-ipv6]").rule is EgressRule.MALFORMED
    assert host_refusal("example.com") is None


_SPELLINGS = {
    "decimal": lambda n: str(n),
    "hex": lambda n: hex(n),
    "octal": lambda n: "0" + format(n, "o"),
    "dotted hex": lambda n: ".".join(hex(b) for b in n.to_bytes(4, "big")),
    "dotted octal": lambda n: ".".join("0" + format(b, "o") for b in n.to_bytes(4, "big")),
    "short": lambda n: f"{n >> 24}.{n & 0xFFFFFF}",
}


@given(st.integers(int(IPv4Address("127.0.0.0")), int(IPv4Address("127.255.255.255"))),
       st.sampled_from(list(_SPELLINGS)))
def test_every_address_of_127_0_0_0_8_in_every_spelling_is_loopback(n, spelling):
    refusal = url_refusal(f"http://{_SPELLINGS[spelling](n)}:8080/hook")
    assert refusal is not None and refusal.rule is LOOPBACK and refusal.address == str(IPv4Address(n))


@given(st.integers(0, 2**32 - 1), st.sampled_from(list(_SPELLINGS)))
def test_every_spelling_means_the_same_address(n, spelling):
    assert ipv4_literal(_SPELLINGS[spelling](n)) == IPv4Address(n)


@given(st.integers(0, 2**32 - 1))
def test_an_ipv4_address_mapped_into_ipv6_is_judged_as_itself(n):
    v4 = IPv4Address(n)
    plain, mapped = address_refusal(v4), address_refusal(ip_address(f"::ffff:{v4}"))
    assert (plain and plain.rule) == (mapped and mapped.rule)


# -- GPUSCHED_WEBHOOK_ALLOW ---------------------------------------------------------------------


def test_the_allow_list_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("GPUSCHED_WEBHOOK_ALLOW", raising=False)
    assert env_networks("GPUSCHED_WEBHOOK_ALLOW") == ()
    monkeypatch.setenv("GPUSCHED_WEBHOOK_ALLOW", "127.0.0.0/8, 10.20.0.0/16,fd00::/8,192.0.2.7")
    assert env_networks("GPUSCHED_WEBHOOK_ALLOW") == tuple(
        ip_network(n) for n in ("127.0.0.0/8", "10.20.0.0/16", "fd00::/8", "192.0.2.7/32"))


@pytest.mark.parametrize("value, bad", [
    ("10.0.0.0/33", "'10.0.0.0/33'"),
    ("10.0.0.1/8", "'10.0.0.1/8'"),  # host bits set: strictly a network
    ("127.0.0.0/8,,10.0.0.0/8", "''"),
    ("localhost", "'localhost'"),
    ("127.0.0.0/8;10.0.0.0/8", "'127.0.0.0/8;10.0.0.0/8'"),
])
def test_a_bad_network_is_a_start_error_naming_the_variable(monkeypatch, value, bad):
    monkeypatch.setenv("GPUSCHED_WEBHOOK_ALLOW", value)
    with pytest.raises(ConfigError) as err:
        env_networks("GPUSCHED_WEBHOOK_ALLOW")
    assert str(err.value).startswith(f"GPUSCHED_WEBHOOK_ALLOW={value!r}: {bad} is not a network")
    assert "accepted: comma-separated CIDRs" in str(err.value)


def test_the_notifier_reads_the_same_allow_list(monkeypatch):
    from services.notifier.settings import NotifierSettings

    monkeypatch.setenv("GPUSCHED_WEBHOOK_ALLOW", "127.0.0.0/8")
    assert NotifierSettings.from_env().webhook_allow == (ip_network("127.0.0.0/8"),)
    monkeypatch.setenv("GPUSCHED_WEBHOOK_ALLOW", "127.0.0.1/8")
    with pytest.raises(ConfigError, match="GPUSCHED_WEBHOOK_ALLOW"):
        NotifierSettings.from_env()
