"""Export the contract as JSON Schema files for publishers in other languages.

    python -m schemas.export          # rewrite schemas/json/
    python -m schemas.export --check  # exit 1 if the committed files differ from the models
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic.json_schema import GenerateJsonSchema

from .commands import (
    CancelJob,
    DeleteService,
    DeployService,
    ReportCheckpoint,
    ReportServiceLoad,
    ScaleService,
    SubmitJob,
)
from .envelope import RFC3339
from .registry import ALL_EVENT_TYPES
from .tenant import CommandRefused, JobNotification, NotificationDelivery

NO_NUL = "^[^\\u0000]*$"
"""Every string of the contract refuses NUL (the parsers do; JSON cannot carry an unpaired
surrogate to them at all); the patterns of named strings already exclude it."""




class ContractSchema(GenerateJsonSchema):
    """Pydantic's JSON Schema, plus the string rules above: NUL refused on strings that have no
    pattern of their own, times as RFC 3339 with an offset."""

    def str_schema(self, schema):
        out = super().str_schema(schema)
        out.setdefault("pattern", NO_NUL)
        return out

    def datetime_schema(self, schema):
        return {**super().datetime_schema(schema), "pattern": RFC3339}

OUT = Path(__file__).parent / "json"


def rendered() -> dict[str, str]:
    models = [SubmitJob, CancelJob, ReportCheckpoint, DeployService, ScaleService, DeleteService, ReportServiceLoad,
              *ALL_EVENT_TYPES, JobNotification, NotificationDelivery, CommandRefused]
    out = {}
    for model in models:
        schema = model.model_json_schema(schema_generator=ContractSchema)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://gpusched.dev/schemas/{model.__name__}.json"
        out[f"{model.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def write_or_check(files: dict[Path, str], argv: list[str], owned: Path | None = None) -> int:
    """Write generated ``files`` (path -> text); with ``--check`` in ``argv``, write nothing and
    return 1 if a committed one differs. ``owned``: a folder the generator owns, whose other
    ``*.json`` files are stale (removed, or reported by ``--check``)."""
    extra = [p for p in owned.glob("*.json") if p not in files] if owned is not None and owned.exists() else []
    if "--check" in argv:
        stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
        if stale or extra:
            print(f"out of date: {', '.join(str(p) for p in stale + extra)}; run `make schemas`", file=sys.stderr)
            return 1
        return 0
    for p in extra:
        p.unlink()
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    print(f"wrote {len(files)} file(s): {', '.join(sorted({str(p.parent) for p in files}))}")
    return 0


def main(argv: list[str]) -> int:
    return write_or_check({OUT / name: text for name, text in rendered().items()}, argv, owned=OUT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
