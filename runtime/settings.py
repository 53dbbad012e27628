"""Configuration from the environment. Every variable is documented in docs/configuration.md.

A bad value fails at start with the variable's name, the value and what is accepted.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the variable and the accepted values."""


def env_value(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value in (None, "") else value


def env_number(name: str, default: float, *, minimum: float, maximum: float, integer: bool = False) -> float:
    raw = env_value(name)
    if raw is None:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={raw!r} is not {kind}; accepted: {minimum}..{maximum}") from None
    if not minimum <= value <= maximum:
        raise ConfigError(f"{name}={raw!r} is out of range; accepted: {minimum}..{maximum}")
    return value


def env_choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    value = env_value(name, default)
    assert value is not None
    if value not in accepted:
        raise ConfigError(f"{name}={value!r} is not accepted; accepted: {', '.join(accepted)}")
    return value


def env_address(name: str, default: str) -> str:
    """An IP address to bind to (``0.0.0.0``: every interface)."""
    value = env_value(name, default)
    assert value is not None
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an IP address; accepted: e.g. 127.0.0.1 (loopback, the "
                          "default), 0.0.0.0 (every interface), ::1") from None
    return value


def env_networks(name: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated CIDRs (``10.20.0.0/16,2001:db8::/32``); unset: none. Every entry must be a
    network written exactly (no host bits set), so that a typo never allows more than was meant."""
    raw = env_value(name)
    if raw is None:
        return ()
    networks = []
    for entry in raw.split(","):
        try:
            networks.append(ipaddress.ip_network(entry.strip()))
        except ValueError as err:
            raise ConfigError(f"{name}={raw!r}: {entry.strip()!r} is not a network ({err}); accepted: comma-separated "
                              "CIDRs, e.g. 10.20.0.0/16,2001:db8::/32") from None
    return tuple(networks)


NATS_SCHEMES = ("nats", "tls")


def nats_servers(raw: str, name: str = "GPUSCHED_NATS_URL") -> list[str]:
    """The servers of a NATS URL setting: one URL, or a comma-separated list of them (every server
    of a cluster: a client that loses one goes on with another). Each must be ``nats://`` or
    ``tls://`` with a host and, where given, a port; a wrong entry is a ConfigError naming ``name``."""
    servers = [entry.strip() for entry in raw.split(",")]
    for entry in servers:
        try:
            url = urlsplit(entry)
            ok = url.scheme in NATS_SCHEMES and bool(url.hostname) and url.path in ("", "/")
            url.port  # a port that is not a number raises
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"{name}={raw!r}: {entry!r} is not a NATS server URL; accepted: nats://HOST:PORT or "
                              "tls://HOST:PORT, or several of them separated by commas (every server of a cluster), "
                              "e.g. nats://10.0.0.1:4222,nats://10.0.0.2:4222")
    return servers


def _pem(name: str, raw: str | None) -> Path | None:
    if raw is not None and not (os.path.isfile(raw) and os.access(raw, os.R_OK)):
        raise ConfigError(f"{name}={raw!r} is not a readable file; accepted: the path of a PEM file")
    return Path(raw) if raw else None


@dataclass(frozen=True)
class NatsTls:
    """TLS to NATS (docs/configuration.md): the CA that signed the server's certificate, and this
    process's own certificate and key where the server verifies clients. Paths, so that a child
    process (a rebuild's writers) builds the same context."""

    ca: Path | None = None  # GPUSCHED_NATS_TLS_CA; None: the system's trust store
    cert: Path | None = None  # GPUSCHED_NATS_TLS_CERT
    key: Path | None = None  # GPUSCHED_NATS_TLS_KEY

    @classmethod
    def from_env(cls) -> "NatsTls | None":
        """None when no TLS variable is set (a tls:// URL still uses TLS, trusting the system's CAs)."""
        tls = cls(ca=_pem("GPUSCHED_NATS_TLS_CA", env_value("GPUSCHED_NATS_TLS_CA")),
                  cert=_pem("GPUSCHED_NATS_TLS_CERT", env_value("GPUSCHED_NATS_TLS_CERT")),
                  key=_pem("GPUSCHED_NATS_TLS_KEY", env_value("GPUSCHED_NATS_TLS_KEY")))
        if (tls.cert is None) != (tls.key is None):
            raise ConfigError("GPUSCHED_NATS_TLS_CERT and GPUSCHED_NATS_TLS_KEY go together: a client certificate "
                              "and its key; accepted: both set, or neither")
        if not (tls.ca or tls.cert):
            return None
        try:
            tls.context()
        except (ssl.SSLError, OSError) as err:
            raise ConfigError(f"GPUSCHED_NATS_TLS_CA/_CERT/_KEY cannot be loaded ({err}); accepted: PEM files, the "
                              "certificate with its own key") from None
        return tls

    def context(self) -> ssl.SSLContext:
        """A client context that verifies the server (hostname included) against ``ca``."""
        ctx = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if self.cert is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def connect_options(self) -> dict:
        """nats-py's options: TLS from the first byte (``tls_handshake_first``; the server's
        ``handshake_first``, gpusched.dev.stack.tls_block), so that no server, or anything in between,
        can have the client go on in plain text and read its credentials."""
        return {"tls": self.context(), "tls_handshake_first": True}


@dataclass(frozen=True)
class Settings:
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: str | None = None
    nats_tls: NatsTls | None = None
    pg_dsn: str | None = None
    stream_replicas: int = 1
    duplicate_window_s: float = 120.0
    time_scale: float = 1.0
    clock_epoch: float = field(default_factory=time.time)
    clock_start: float | None = None  # platform time at clock_epoch (runtime/clock.py); None: clock_epoch
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_addr: str = "127.0.0.1"  # loopback unless a deployment names another address
    log_level: str = "INFO"
    log_format: str = "json"
    otel_exporter: str = "none"
    trace_dir: Path | None = None
    executor_backend: str = "sim"
    sim_cluster: Path | None = None
    batch_size: int = 256
    tick_s: float = 0.5
    snapshot_every: int = 100_000  # events applied between snapshots (runtime/snapshot.py); 0: none
    snapshot_min_interval_s: float = 60.0
    lease_ttl_s: float = 0.0  # single-active with a lease of this ttl (runtime/lease.py); 0: no lease

    @property
    def nats_servers(self) -> list[str]:
        """The servers of :attr:`nats_url` (GPUSCHED_NATS_URL: one URL or a comma-separated list)."""
        return nats_servers(self.nats_url)

    @classmethod
    def from_env(cls) -> "Settings":
        trace_dir = env_value("GPUSCHED_TRACE_DIR")
        sim_cluster = env_value("GPUSCHED_SIM_CLUSTER")
        nats_url = env_value("GPUSCHED_NATS_URL", cls.nats_url) or cls.nats_url
        nats_servers(nats_url)  # a wrong entry fails here, at start
        return cls(
            nats_url=nats_url,
            nats_user=env_value("GPUSCHED_NATS_USER"),
            nats_password=env_value("GPUSCHED_NATS_PASSWORD"),
            nats_tls=NatsTls.from_env(),
            pg_dsn=env_value("GPUSCHED_PG_DSN"),
            stream_replicas=int(env_number("GPUSCHED_STREAM_REPLICAS", 1, minimum=1, maximum=5, integer=True)),
            duplicate_window_s=env_number("GPUSCHED_DUPLICATE_WINDOW_S", 120.0, minimum=1, maximum=86_400),
            time_scale=env_number("GPUSCHED_TIME_SCALE", 1.0, minimum=0.001, maximum=1_000_000),
            clock_epoch=env_number("GPUSCHED_CLOCK_EPOCH", time.time(), minimum=0, maximum=4e9),
            clock_start=(env_number("GPUSCHED_CLOCK_START", 0.0, minimum=0, maximum=4e9)
                         if env_value("GPUSCHED_CLOCK_START") is not None else None),
            metrics_port=int(env_number("GPUSCHED_METRICS_PORT", 0, minimum=0, maximum=65535, integer=True)),
            metrics_addr=env_address("GPUSCHED_METRICS_ADDR", "127.0.0.1"),
            log_level=env_choice("GPUSCHED_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR")),
            log_format=env_choice("GPUSCHED_LOG_FORMAT", "json", ("json", "text")),
            otel_exporter=env_choice("GPUSCHED_OTEL_EXPORTER", "none", ("none", "console", "file", "otlp")),
            trace_dir=Path(trace_dir) if trace_dir else None,
            executor_backend=env_choice("GPUSCHED_EXECUTOR_BACKEND", "sim", ("sim", "kubernetes", "local")),
            sim_cluster=Path(sim_cluster) if sim_cluster else None,
            batch_size=int(env_number("GPUSCHED_BATCH_SIZE", 256, minimum=1, maximum=10_000, integer=True)),
            tick_s=env_number("GPUSCHED_TICK_S", 0.5, minimum=0.01, maximum=60),
            snapshot_every=int(env_number("GPUSCHED_SNAPSHOT_EVERY", 100_000, minimum=0, maximum=1e9, integer=True)),
            snapshot_min_interval_s=env_number("GPUSCHED_SNAPSHOT_MIN_INTERVAL_S", 60.0, minimum=0, maximum=86_400),
            lease_ttl_s=env_number("GPUSCHED_LEASE_TTL_S", 0.0, minimum=0, maximum=600),
        )
