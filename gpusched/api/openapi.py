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

OUT = Path(__file__).resolve().parents[2] / "schemas" / "openapi.json"


def rendered() -> str:
    app = create_app(ApiSettings(runtime=Settings(pg_dsn="postgresql://unused")))  # nothing connects
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = rendered()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date; run `make schemas`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
