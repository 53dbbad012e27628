"""The HTTP API before accounting has created the read models: every read answers 503, a problem
document saying the read models are not ready yet, with Retry-After, never a 500 (docs/api.md,
"Errors"). The API runs as its process against a real Postgres database with no tables (no
accounting process), then with only the tokens table (authentication works, the reads still
find no tables)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from gpusched.api import tokens
from tests.api.stack import ApiStack, job_document

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "accounting" / "migrations"
READS = ["/v1/jobs", "/v1/jobs/j-1", "/v1/jobs/j-1/events", "/v1/jobs/j-1/why", "/v1/queues", "/v1/cohorts",
         "/v1/nodes", "/v1/gpus", "/v1/usage", "/v1/chargeback?period=2026-12", "/v1/metrics/summary",
         "/v1/metrics/series",
         "/v1/services", "/v1/services/chat"]


class BareApi(ApiStack):
    """The API process alone: nobody creates the read models or projects a token."""

    async def _issue_tokens(self) -> dict[str, str]:
        minted = tokens.mint()
        self.minted = minted
        return {"root": minted.token}


@pytest.fixture(scope="module")
def bare_api(postgres, tmp_path_factory) -> BareApi:
    stack = BareApi(tmp_path_factory.mktemp("bare-api"), postgres, processes=("api",)).start()
    yield stack
    crashed = stack.stop()
    assert not crashed, f"tracebacks in the API's log: {stack.log('api')[-3000:]}"


def assert_not_ready(response, path: str) -> None:
    assert response.status_code == 503, (path, response.status_code, response.text[:500])
    assert response.headers["content-type"].startswith("application/problem+json"), path
    assert response.headers["retry-after"] == "5", path
    doc = response.json()
    assert doc["status"] == 503 and doc["type"].endswith("/not-ready") and doc["instance"] == path.split("?")[0]
    assert doc["detail"].startswith("the read models are not ready yet; retry in 5 s"), doc
    assert "does not exist" in doc["detail"], doc


async def _tokens_table_only(dsn: str, minted: tokens.Minted) -> None:
    """The tokens table as accounting's migration creates it, and the admin token's row as its
    projection writes it: authentication works; every other table is still missing."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute((MIGRATIONS / "010_api_tokens.sql").read_text())
        await conn.execute("INSERT INTO api_tokens (token_id, name, role, team, token_hash, issued_by, issued_at, "
                           "sequence) VALUES ($1, 'root', 'admin', NULL, $2, 'admin', $3, 1)",
                           minted.token_id, minted.token_hash, datetime.now(UTC))
    finally:
        await conn.close()


def test_reads_before_the_read_models_exist_answer_503_not_ready_with_retry_after(bare_api):
    with bare_api.client("root") as client:
        # no table at all: authenticating the token is the first read
        for path in [*READS, "/v1/tokens", "/v1/whoami"]:
            assert_not_ready(client.get(path), path)
        response = client.post("/v1/jobs", json=job_document(None, "team-a"))
        assert_not_ready(response, "/v1/jobs")
        assert client.get("/v1/jobs").json()["detail"].endswith('relation "api_tokens" does not exist)')

        asyncio.run(_tokens_table_only(bare_api.dsn, bare_api.minted))
        assert client.get("/v1/whoami").json()["role"] == "admin"
        for path in READS:  # the reads themselves find no table
            assert_not_ready(client.get(path), path)
        assert "api_tokens" not in client.get("/v1/queues").json()["detail"]
    assert "Traceback" not in bare_api.log("api")
