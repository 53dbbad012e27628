"""The API's metrics (Prometheus, on the process's metrics port like every service's) and a
server span per request, whose context the commands it publishes carry (traceparent), so a
job's trace starts at the HTTP request and follows it through admission and on."""

from __future__ import annotations

import time

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime import observability

REQUESTS = Counter("gpusched_api_requests_total", "HTTP requests answered", ("method", "route", "status"))
LATENCY = Histogram("gpusched_api_request_seconds", "Time to the response's start (a stream: to its first byte)",
                    ("method", "route"), buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
DECISION_WAIT = Histogram("gpusched_api_decision_wait_seconds",
                          "JetStream's acknowledgement of the command to admission's answer, per command verb",
                          ("verb",), buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PUBLISH = Histogram("gpusched_api_publish_seconds", "A command's publish to JetStream's acknowledgement, per verb",
                    ("verb",), buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
STREAMS = Gauge("gpusched_api_open_streams", "Server-sent-event streams open")
STREAMED = Counter("gpusched_api_streamed_events_total", "Events sent on server-sent-event streams")


class Telemetry:
    """ASGI middleware: a span and the metrics of each HTTP request, labelled by its route
    template (``/v1/jobs/{job_id}``), never by the raw path."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, started = scope["method"], time.perf_counter()
        status = {"code": 500}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                LATENCY.labels(method, _route(scope)).observe(time.perf_counter() - started)
            await send(message)

        with observability.tracer().start_as_current_span(f"api {method}", kind=trace.SpanKind.SERVER) as span:
            try:
                await self.app(scope, receive, sending)
            finally:
                route = _route(scope)
                span.update_name(f"api {method} {route}")
                span.set_attribute("http.route", route)
                span.set_attribute("http.response.status_code", status["code"])
                REQUESTS.labels(method, route, str(status["code"])).inc()


def _route(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "(unmatched)"
