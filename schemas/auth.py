"""Who may use the HTTP API: API tokens and their roles. A token is issued and revoked by the
admin (`gpusched token issue|revoke`), as events; the API keeps only the token's SHA-256 hash
(from the accounting read model ``api_tokens``), never the token itself."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from .envelope import NAME_PATTERN, Event, Timestamp

TOKEN_ID_PATTERN = r"^[a-z0-9]{12}$"
SHA256_HEX = r"^[0-9a-f]{64}$"


class Role(StrEnum):
    """What a token may do (docs/api.md has the route table)."""

    MEMBER = "member"  # its team's jobs and queues: submit, cancel, checkpoint, read
    OPERATOR = "operator"  # every team's jobs and queues, on behalf of a user; dead letters
    CHARGEBACK = "chargeback"  # usage and chargeback of every team, metric summaries; no jobs
    ADMIN = "admin"  # everything an operator may, and the token list


class ApiTokenIssued(Event):
    """A token was issued. ``token_hash`` is the SHA-256 (hex) of the token's secret part."""

    # The cross-field rule, as JSON Schema states it (the validator below holds it too).
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"const": "member"}}, "required": ["role"]},
        "then": {"properties": {"team": {"type": "string", "pattern": NAME_PATTERN}}, "required": ["team"]},
        "else": {"properties": {"team": {"type": "null"}}},
    })

    aggregate: ClassVar[str] = "token"
    type: Literal["ApiTokenIssued"] = "ApiTokenIssued"
    token_id: str = Field(pattern=TOKEN_ID_PATTERN)
    name: str = Field(pattern=NAME_PATTERN, description="Who holds it (a user, a pipeline); a member token acts as this user")
    role: Role
    team: str | None = Field(default=None, pattern=NAME_PATTERN, description="The team of a member token")
    token_hash: str = Field(pattern=SHA256_HEX)
    issued_by: str = Field(min_length=1, max_length=64, description="The credential that issued it")
    expires_at: Timestamp | None = None

    @model_validator(mode="after")
    def _team_iff_member(self) -> "ApiTokenIssued":
        if (self.role == Role.MEMBER) != (self.team is not None):
            raise ValueError("team: a member token names its team; other roles name none")
        return self


class ApiTokenRevoked(Event):
    """A token was revoked; the API refuses it from then on."""

    aggregate: ClassVar[str] = "token"
    type: Literal["ApiTokenRevoked"] = "ApiTokenRevoked"
    token_id: str = Field(pattern=TOKEN_ID_PATTERN)
    revoked_by: str = Field(min_length=1, max_length=64)
    reason: str = Field(default="", max_length=500)
