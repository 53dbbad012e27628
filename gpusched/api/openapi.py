"""The API's OpenAPI document, committed as schemas/openapi.json.

    python -m gpusched.api.openapi          # rewrite it
    python -m gpusched.api.openapi --check  # exit 1 if the committed file differs from the app
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpusched.api.app import ApiSettings, create_app
from runtime.settings import Settings
from schemas.export import write_or_check

OUT = Path(__file__).resolve().parents[2] / "schemas" / "openapi.json"


def rendered() -> str:
    app = create_app(ApiSettings(runtime=Settings(pg_dsn="postgresql://unused")))  # nothing connects
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    return write_or_check({OUT: rendered()}, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
