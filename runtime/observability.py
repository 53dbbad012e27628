"""Structured logs, Prometheus metrics and OpenTelemetry traces for every service.

Trace context travels in NATS headers (W3C ``traceparent``), so one job's spans, from the CLI's
submit through admission, quota, scheduler, executor and accounting, share one trace id.

Spans go where ``GPUSCHED_OTEL_EXPORTER`` says: ``otlp`` (OTLP over HTTP/protobuf to a collector;
the address from the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, default http://localhost:4318),
``file`` (JSON lines, one file per service, for tests and a look by hand), ``console``, or
``none``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from pythonjsonlogger.json import JsonFormatter

from runtime import health

EVENTS_APPENDED = Counter("gpusched_events_appended_total", "Events appended to the log", ["type", "duplicate"])
EVENTS_CONSUMED = Counter("gpusched_events_consumed_total", "Events consumed", ["service", "type"])
DEAD_LETTERS = Counter("gpusched_dead_letters_total", "Poison messages sent to the dead-letter subject", ["service"])
CONFLICTS = Counter(
    "gpusched_concurrency_conflicts_total", "Appends refused: the writer had not seen the newest event", ["service"]
)
DECISIONS = Counter("gpusched_decisions_total", "Decisions emitted by a service core", ["service", "type"])
APPLIED_SEQUENCE = Gauge("gpusched_applied_sequence", "Highest stream sequence applied to state", ["service"])
BATCH_SECONDS = Histogram(
    "gpusched_batch_seconds", "Time to handle one batch of events", ["service"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

_tracer_name = "gpusched"
_tracer: trace.Tracer | None = None
_recording = False
"""Whether this process's spans go anywhere (``setup`` with an exporter). Without one, a consumer
passes the trace context it received on unchanged instead of making spans nobody sees: that
cost a tenth to a third of each service's time (docs/performance.md, "Where the time goes")."""


def setup(service: str, *, level: str = "INFO", fmt: str = "json", metrics_port: int = 0, metrics_addr: str = "127.0.0.1",
          otel_exporter: str = "none", trace_dir: Path | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "ts", "levelname": "level", "name": "logger"},
                static_fields={"service": service},
            )
        )
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("nats").setLevel("WARNING")

    if metrics_port:
        serve_metrics(metrics_port, metrics_addr)

    provider = TracerProvider(resource=Resource.create({"service.name": f"gpusched-{service}"}))
    exporter = span_exporter(otel_exporter, service, trace_dir)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    global _recording
    _recording = exporter is not None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape or a probe every few seconds is no news
        pass


def serve_metrics(port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """``/metrics`` (Prometheus), ``/livez`` and ``/readyz`` (runtime/health.py) on one port, in
    a thread."""
    metrics = make_wsgi_app()

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/livez", "/readyz"):
            ok, body = health.HEALTH.live() if path == "/livez" else health.HEALTH.ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]
        return metrics(environ, start_response)
    httpd = make_server(addr, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd


def span_exporter(kind: str, service: str, trace_dir: Path | None = None) -> SpanExporter | None:
    """The exporter ``GPUSCHED_OTEL_EXPORTER`` names (None for ``none``)."""
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint, headers, timeout: the standard OTEL_EXPORTER_OTLP_* variables
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "file":
        directory = trace_dir or Path(".")
        directory.mkdir(parents=True, exist_ok=True)
        out = open(directory / f"{service}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    return None


def client_tracing() -> None:
    """For short-lived clients (the CLI): a provider, so that the spans they start have real ids
    and the trace context they put in headers starts the job's trace; exported where
    ``GPUSCHED_OTEL_EXPORTER`` says (flushed at exit)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "gpusched-cli"}))
    trace_dir = os.environ.get("GPUSCHED_TRACE_DIR")
    exporter = span_exporter(os.environ.get("GPUSCHED_OTEL_EXPORTER", "none"), "cli",
                             Path(trace_dir) if trace_dir else None)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
        atexit.register(provider.shutdown)
    trace.set_tracer_provider(provider)


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer() -> trace.Tracer:
    global _tracer
    if _tracer is None:  # the SDK makes a new tracer on every call; one per process is enough
        _tracer = trace.get_tracer(_tracer_name)
    return _tracer


def inject_trace(headers: dict[str, str]) -> None:
    """Put the current span's context into outgoing NATS headers (unless already set)."""
    if "traceparent" not in headers:
        inject(headers)


@contextmanager
def span_from_headers(name: str, headers: Mapping[str, str] | None, **attributes: str | int) -> Iterator[None]:
    """A consumer span that continues the trace carried by a message's headers; when nothing
    exports spans, only that trace's context (what is appended inside carries it on)."""
    ctx = extract(dict(headers or {}))
    token = otel_context.attach(ctx)
    try:
        if not _recording:
            yield
            return
        with tracer().start_as_current_span(name, kind=trace.SpanKind.CONSUMER, attributes=attributes):
            yield
    finally:
        otel_context.detach(token)


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The trace-context part of a message's headers, to continue the trace later."""
    return {k: v for k, v in (headers or {}).items() if k in ("traceparent", "tracestate")}
