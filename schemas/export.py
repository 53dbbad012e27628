"""Export the contract as JSON Schema files for publishers in other languages.

    python -m schemas.export          # rewrite schemas/json/
    python -m schemas.export --check  # exit 1 if the committed files differ from the models
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic.json_schema import GenerateJsonSchema

from schemas.commands import CancelJob, ReportCheckpoint, SubmitJob
from schemas.envelope import RFC3339
from schemas.registry import ALL_EVENT_TYPES
from schemas.tenant import JobNotification, NotificationDelivery

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
    models = [SubmitJob, CancelJob, ReportCheckpoint, *ALL_EVENT_TYPES, JobNotification, NotificationDelivery]
    out = {}
    for model in models:
        schema = model.model_json_schema(schema_generator=ContractSchema)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://gpusched.dev/schemas/{model.__name__}.json"
        out[f"{model.__name__}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main(argv: list[str]) -> int:
    files = rendered()
    if "--check" in argv:
        stale = [name for name, text in files.items() if not (OUT / name).exists() or (OUT / name).read_text() != text]
        extra = [p.name for p in OUT.glob("*.json") if p.name not in files]
        if stale or extra:
            print(f"schemas/json is out of date: {stale + extra}; run `make schemas`", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(exist_ok=True)
    for p in OUT.glob("*.json"):
        if p.name not in files:
            p.unlink()
    for name, text in files.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(files)} schemas to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
