"""``python -m gpusched.api``: the API under uvicorn (settings: gpusched.api.app.ApiSettings).

It serves on the socket GPUSCHED_API_FD names when the process that started it bound one for it
(the dev stack: the port it advertises is then the port bound, and stays the API's across
restarts), else on GPUSCHED_API_ADDR:GPUSCHED_API_PORT, bound here before anything else starts.
A port another process holds ends it with exit status 4 (runtime.observability.EXIT_CANNOT_LISTEN)
and says so, instead of failing the same way at every restart."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gpusched.api.app import ApiSettings, create_app
from runtime import observability
from runtime.settings import ConfigError

API_FD = "GPUSCHED_API_FD"
"""The number of an inherited socket, bound and listening, to serve the API on."""

log = logging.getLogger("gpusched.api")


def main() -> int:
    try:
        settings = ApiSettings.from_env()
    except ConfigError as err:
        print(f"gpusched api: {err}", file=sys.stderr)
        return 2
    rt = settings.runtime
    observability.setup("api", level=rt.log_level, fmt=rt.log_format, metrics_port=rt.metrics_port,
                        metrics_addr=rt.metrics_addr, otel_exporter=rt.otel_exporter, trace_dir=rt.trace_dir)
    try:
        listener = (observability.inherited_listener(API_FD)
                    or observability.listen(settings.addr, settings.port, setting="GPUSCHED_API_PORT"))
    except observability.CannotListen as err:
        observability.exit_cannot_listen("api", err)
    addr, port = listener.getsockname()[:2]
    log.info("serving the API on %s:%s", addr, port)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=addr, port=port, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=5))
    server.run(sockets=[listener])
    return 0 if server.started else 3  # 3: uvicorn's own status when the app did not start


if __name__ == "__main__":
    sys.exit(main())
