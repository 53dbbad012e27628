"""The committed OpenAPI document is the application's (`make schemas` rewrites it)."""

from __future__ import annotations

from gpusched.api import openapi


def test_the_committed_openapi_document_is_current():
    assert openapi.OUT.read_text() == openapi.rendered(), "run `make schemas`"


def test_every_v1_operation_documents_its_problems():
    import json

    doc = json.loads(openapi.rendered())
    for path, ops in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, op in ops.items():
            assert {"401", "403", "422"} <= set(op["responses"]), (method, path)
            assert op["responses"]["401"]["content"]["application/problem+json"], (method, path)
