"""``python -m gpusched.api``: the API under uvicorn (settings: gpusched.api.app.ApiSettings)."""

from __future__ import annotations

import sys

import uvicorn

from gpusched.api.app import ApiSettings, create_app
from runtime import observability
from runtime.settings import ConfigError


def main() -> int:
    try:
        settings = ApiSettings.from_env()
    except ConfigError as err:
        print(f"gpusched api: {err}", file=sys.stderr)
        return 2
    rt = settings.runtime
    observability.setup("api", level=rt.log_level, fmt=rt.log_format, metrics_port=rt.metrics_port,
                        metrics_addr=rt.metrics_addr, otel_exporter=rt.otel_exporter, trace_dir=rt.trace_dir)
    uvicorn.run(create_app(settings), host=settings.addr, port=settings.port, log_config=None, access_log=False,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
