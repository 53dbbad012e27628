"""Who is calling: the bearer token (``Authorization: Bearer gst_…``, or the console's cookie)
checked against the hashes in the ``api_tokens`` read model, and what its role may do.

A token's row is cached for :data:`CACHE_S`, so a revocation takes effect within that time of
accounting projecting it. An unknown, malformed, expired or revoked token is a 401 with the same
answer for each (nothing tells a caller which of them it was)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
from fastapi import Request

from gpusched.api import tokens
from gpusched.api.problems import Problem
from schemas.auth import Role
from schemas.commands import OPERATOR, Principal
from services.accounting import queries

CACHE_S = 5.0
COOKIE = "gpusched_token"


@dataclass(frozen=True)
class Identity:
    token_id: str
    name: str
    role: Role
    team: str | None  # a member's team

    @property
    def is_operator(self) -> bool:
        return self.role in (Role.OPERATOR, Role.ADMIN)

    def sees_team(self, team: str | None) -> bool:
        """Whether this identity may see the jobs, queues and usage of ``team``."""
        return self.role != Role.MEMBER or team == self.team

    def principal(self, team: str, verb: str) -> Principal:
        """Who a command of ``team`` is sent as: a member as its user of its team (403 for any
        other team), an operator or admin as the operator on behalf of its token's name."""
        if self.is_operator:
            return Principal(team=team, user=OPERATOR, verb=verb, operator=True)
        if self.role == Role.MEMBER and team == self.team:
            return Principal(team=team, user=self.name, verb=verb)
        raise forbidden(f"a {self.role.value} token of {self.team or 'no team'} may not {verb} for team {team!r}")


def unauthorized() -> Problem:
    return Problem(401, "unauthorized", "Unauthorized",
                   "a valid API token is required: Authorization: Bearer gst_… (issued by `gpusched token issue`)",
                   headers={"WWW-Authenticate": 'Bearer realm="gpusched"'})


def forbidden(detail: str) -> Problem:
    return Problem(403, "forbidden", "Forbidden", detail)


class Authenticator:
    """Token -> Identity, from the read model, with a short cache of rows (not of secrets)."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._rows: dict[str, tuple[float, asyncpg.Record | None]] = {}

    async def _row(self, token_id: str) -> asyncpg.Record | None:
        now = time.monotonic()
        cached = self._rows.get(token_id)
        if cached is not None and now - cached[0] < CACHE_S:
            return cached[1]
        row = await queries.api_token(self.pool, token_id)
        if len(self._rows) > 10_000:
            self._rows.clear()
        self._rows[token_id] = (now, row)
        return row

    async def identify(self, token: str | None) -> Identity:
        parts = tokens.split(token or "")
        if parts is None:
            raise unauthorized()
        row = await self._row(parts[0])
        if (row is None or row["revoked_at"] is not None or not tokens.matches(parts[1], row["token_hash"])
                or (row["expires_at"] is not None and row["expires_at"] <= datetime.now(UTC))):
            raise unauthorized()
        return Identity(token_id=parts[0], name=row["name"], role=Role(row["role"]), team=row["team"])


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    return request.cookies.get(COOKIE)


async def identity(request: Request) -> Identity:
    """FastAPI dependency: the caller, or 401."""
    return await request.app.state.auth.identify(bearer(request))


def require(ident: Identity, *roles: Role) -> Identity:
    if ident.role not in roles:
        raise forbidden(f"this route needs one of the roles {', '.join(r.value for r in roles)}; "
                        f"the token is a {ident.role.value} token")
    return ident


def team_filter(ident: Identity, team: str | None) -> str | None:
    """The team a listing is limited to: a member's own (403 for another), else ``team`` (None: all)."""
    if ident.role == Role.MEMBER:
        if team not in (None, ident.team):
            raise forbidden(f"a member of {ident.team} sees only its own team, not {team!r}")
        return ident.team
    return team
