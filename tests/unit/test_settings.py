"""Settings.from_env: defaults, parsing, and errors that name the variable and what is accepted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.settings import ConfigError, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("GPUSCHED_"):
            monkeypatch.delenv(name)


def test_defaults(monkeypatch):
    monkeypatch.setenv("GPUSCHED_CLOCK_EPOCH", "1000")
    s = Settings.from_env()
    assert s == Settings(clock_epoch=1000.0)
    assert (s.nats_url, s.stream_replicas, s.duplicate_window_s, s.time_scale) == ("nats://127.0.0.1:4222", 1, 120.0, 1.0)
    assert (s.metrics_port, s.log_level, s.log_format, s.otel_exporter) == (0, "INFO", "json", "none")
    assert s.metrics_addr == "127.0.0.1"  # no unauthenticated endpoint on other interfaces by default
    assert (s.executor_backend, s.batch_size, s.tick_s) == ("sim", 256, 0.5)
    assert s.trace_dir is None and s.sim_cluster is None and s.pg_dsn is None


def test_values_are_parsed(monkeypatch):
    env = {
        "GPUSCHED_NATS_URL": "nats://nats:4222",
        "GPUSCHED_NATS_USER": "u",
        "GPUSCHED_NATS_PASSWORD": "p",
        "GPUSCHED_PG_DSN": "postgresql://x",
        "GPUSCHED_STREAM_REPLICAS": "3",
        "GPUSCHED_DUPLICATE_WINDOW_S": "30.5",
        "GPUSCHED_TIME_SCALE": "3600",
        "GPUSCHED_CLOCK_EPOCH": "1767225600",
        "GPUSCHED_METRICS_PORT": "9100",
        "GPUSCHED_LOG_LEVEL": "DEBUG",
        "GPUSCHED_LOG_FORMAT": "text",
        "GPUSCHED_OTEL_EXPORTER": "file",
        "GPUSCHED_TRACE_DIR": "/tmp/traces",
        "GPUSCHED_SIM_CLUSTER": "cluster.yaml",
        "GPUSCHED_BATCH_SIZE": "10000",
        "GPUSCHED_TICK_S": "0.01",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert Settings.from_env() == Settings(
        nats_url="nats://nats:4222", nats_user="u", nats_password="p", pg_dsn="postgresql://x", stream_replicas=3,
        duplicate_window_s=30.5, time_scale=3600.0, clock_epoch=1767225600.0, metrics_port=9100, log_level="DEBUG",
        log_format="text", otel_exporter="file", trace_dir=Path("/tmp/traces"), executor_backend="sim",
        sim_cluster=Path("cluster.yaml"), batch_size=10000, tick_s=0.01,
    )


def test_empty_value_means_default(monkeypatch):
    monkeypatch.setenv("GPUSCHED_STREAM_REPLICAS", "")
    monkeypatch.setenv("GPUSCHED_LOG_LEVEL", "")
    monkeypatch.setenv("GPUSCHED_NATS_URL", "")
    s = Settings.from_env()
    assert (s.stream_replicas, s.log_level, s.nats_url) == (1, "INFO", "nats://127.0.0.1:4222")


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("GPUSCHED_STREAM_REPLICAS", "0", "GPUSCHED_STREAM_REPLICAS='0' is out of range; accepted: 1..5"),
        ("GPUSCHED_STREAM_REPLICAS", "6", "GPUSCHED_STREAM_REPLICAS='6' is out of range; accepted: 1..5"),
        ("GPUSCHED_STREAM_REPLICAS", "2.5", "GPUSCHED_STREAM_REPLICAS='2.5' is not an integer; accepted: 1..5"),
        ("GPUSCHED_STREAM_REPLICAS", "three", "GPUSCHED_STREAM_REPLICAS='three' is not an integer; accepted: 1..5"),
        ("GPUSCHED_DUPLICATE_WINDOW_S", "0.5", "GPUSCHED_DUPLICATE_WINDOW_S='0.5' is out of range; accepted: 1..86400"),
        ("GPUSCHED_TIME_SCALE", "0", "GPUSCHED_TIME_SCALE='0' is out of range; accepted: 0.001..1000000"),
        ("GPUSCHED_TIME_SCALE", "fast", "GPUSCHED_TIME_SCALE='fast' is not a number; accepted: 0.001..1000000"),
        ("GPUSCHED_TIME_SCALE", "nan", "GPUSCHED_TIME_SCALE='nan' is out of range; accepted: 0.001..1000000"),
        ("GPUSCHED_TIME_SCALE", "inf", "GPUSCHED_TIME_SCALE='inf' is out of range; accepted: 0.001..1000000"),
        ("GPUSCHED_CLOCK_EPOCH", "-1", "GPUSCHED_CLOCK_EPOCH='-1' is out of range; accepted: 0..4000000000.0"),
        ("GPUSCHED_METRICS_PORT", "65536", "GPUSCHED_METRICS_PORT='65536' is out of range; accepted: 0..65535"),
        ("GPUSCHED_METRICS_PORT", "http", "GPUSCHED_METRICS_PORT='http' is not an integer; accepted: 0..65535"),
        ("GPUSCHED_METRICS_ADDR", "localhost", "GPUSCHED_METRICS_ADDR='localhost' is not an IP address; accepted: e.g. "
         "127.0.0.1 (loopback, the default), 0.0.0.0 (every interface), ::1"),
        ("GPUSCHED_BATCH_SIZE", "0", "GPUSCHED_BATCH_SIZE='0' is out of range; accepted: 1..10000"),
        ("GPUSCHED_TICK_S", "61", "GPUSCHED_TICK_S='61' is out of range; accepted: 0.01..60"),
        ("GPUSCHED_LOG_LEVEL", "debug", "GPUSCHED_LOG_LEVEL='debug' is not accepted; accepted: DEBUG, INFO, WARNING, ERROR"),
        ("GPUSCHED_LOG_FORMAT", "xml", "GPUSCHED_LOG_FORMAT='xml' is not accepted; accepted: json, text"),
        ("GPUSCHED_OTEL_EXPORTER", "jaeger", "GPUSCHED_OTEL_EXPORTER='jaeger' is not accepted; accepted: none, console, file, otlp"),
    ],
)
def test_bad_values_raise_config_error(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        Settings.from_env()
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "name, value, attr, expected",
    [
        ("GPUSCHED_STREAM_REPLICAS", "1", "stream_replicas", 1),
        ("GPUSCHED_STREAM_REPLICAS", "5", "stream_replicas", 5),
        ("GPUSCHED_TIME_SCALE", "0.001", "time_scale", 0.001),
        ("GPUSCHED_TIME_SCALE", "1e6", "time_scale", 1_000_000.0),
        ("GPUSCHED_METRICS_PORT", "65535", "metrics_port", 65535),
        ("GPUSCHED_TICK_S", "60", "tick_s", 60.0),
    ],
)
def test_range_bounds_are_inclusive(monkeypatch, name, value, attr, expected):
    monkeypatch.setenv(name, value)
    got = getattr(Settings.from_env(), attr)
    assert got == expected and type(got) is type(expected)


def test_bad_executor_backend_lists_the_accepted_backends(monkeypatch):
    # the set of backends grows; the message must name the variable, the value and the list
    monkeypatch.setenv("GPUSCHED_EXECUTOR_BACKEND", "k8s-typo")
    with pytest.raises(ConfigError) as err:
        Settings.from_env()
    prefix = "GPUSCHED_EXECUTOR_BACKEND='k8s-typo' is not accepted; accepted: "
    assert str(err.value).startswith(prefix)
    accepted = str(err.value)[len(prefix):].split(", ")
    assert "sim" in accepted
    for backend in accepted:
        monkeypatch.setenv("GPUSCHED_EXECUTOR_BACKEND", backend)
        assert Settings.from_env().executor_backend == backend
