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
import errno
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import NoReturn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

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
        try:
            serve_metrics(metrics_port, metrics_addr)
        except CannotListen as err:  # a restart would meet the same holder: say so and stop
            exit_cannot_listen(service, err)

    provider = TracerProvider(resource=Resource.create({"service.name": f"gpusched-{service}"}))
    exporter = span_exporter(otel_exporter, service, trace_dir)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    global _recording
    _recording = exporter is not None


EXIT_CANNOT_LISTEN = 4
"""A process's exit status when it cannot listen on its port (2: bad configuration, 3: lease lost).
Starting it again on the same port cannot help, so a supervisor stops instead of restarting it
(the dev stack's, gpusched/dev/stack.py)."""

METRICS_FD = "GPUSCHED_METRICS_FD"
"""Set by the process that started this one (the dev stack): the number of an inherited socket,
already bound and listening, to serve /metrics on instead of binding GPUSCHED_METRICS_PORT."""


class CannotListen(Exception):
    """A listener could not bind its address; the message says which address, why, and what would help."""


_WHY = {
    errno.EADDRINUSE: "address in use (another process holds it)",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
    errno.EADDRNOTAVAIL: "no such address on this machine",
}


def listen(addr: str, port: int, setting: str | None = None) -> socket.socket:
    """A TCP socket bound to ``addr:port`` (0: any free port) and listening; CannotListen when it
    cannot be had (``setting``: the variable that chose the port, named in the message)."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections of an earlier run in TIME_WAIT
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        advice = f"; set {setting} to a free port, or stop the process that holds it" if setting else ""
        raise CannotListen(f"cannot listen on {addr}:{port}: {_WHY.get(err.errno, err.strerror)}{advice}") from None
    return sock


def inherited_listener(variable: str) -> socket.socket | None:
    """The listening socket whose file descriptor ``variable`` names, inherited from the process
    that started this one (which bound it and keeps it, so that its port stays this process's
    across restarts); None when the variable is not set. The variable is removed, so that a
    process this one starts does not take an unrelated descriptor of its own for it."""
    fd = os.environ.pop(variable, None)
    if not fd:
        return None
    sock = socket.socket(fileno=int(fd))
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise CannotListen(f"{variable}={fd}: the inherited socket is not listening")
    return sock


def exit_cannot_listen(service: str, err: CannotListen) -> NoReturn:
    """End the process with :data:`EXIT_CANNOT_LISTEN` and the reason on stderr (plain text: the
    dev stack's supervisor shows that line)."""
    print(f"gpusched {service}: {err}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CANNOT_LISTEN)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:
        """The socket is bound and listening already (:func:`listen`, or inherited); the rest as
        WSGIServer does."""
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()

    def server_activate(self) -> None:
        pass


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape or a probe every few seconds is no news
        pass


def serve_metrics(port: int, addr: str = "127.0.0.1") -> WSGIServer:
    """``/metrics`` (Prometheus), ``/livez`` and ``/readyz`` (runtime/health.py) on one port, in
    a thread: on the socket :data:`METRICS_FD` names when this process inherited one, else on
    ``addr:port`` bound here (CannotListen when another process holds it)."""
    metrics = make_wsgi_app()

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/livez", "/readyz"):
            ok, body = health.HEALTH.live() if path == "/livez" else health.HEALTH.ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]
        return metrics(environ, start_response)
    sock = inherited_listener(METRICS_FD) or listen(addr, port, setting="GPUSCHED_METRICS_PORT")
    httpd = _Server(sock.getsockname()[:2], _Quiet, bind_and_activate=False)
    httpd.socket.close()
    httpd.socket = sock
    httpd.server_bind()
    httpd.set_app(app)
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


def recording() -> bool:
    """Whether this process's spans are exported (``setup`` with an exporter)."""
    return _recording


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


def span_if_recording(name: str, headers: Mapping[str, str] | None, **attributes: str | int):
    """:func:`span_from_headers` when spans are exported; else nothing, not even the trace's
    context: for work that appends nothing inside it, or passes the trace on in the headers it
    writes itself (runtime.loop's appends), which then costs no context per message."""
    return span_from_headers(name, headers, **attributes) if _recording else nullcontext()


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The trace-context part of a message's headers, to continue the trace later."""
    return {k: v for k, v in (headers or {}).items() if k in ("traceparent", "tracestate")}
