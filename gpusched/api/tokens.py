"""API tokens: what a token looks like, and how it is checked against its hash.

A token is ``gst_<token id>_<secret>``: the id (12 characters) finds its row, the secret
(43 characters of URL-safe base64, 256 random bits) proves it. Only ``sha256(secret)`` is kept
(``ApiTokenIssued.token_hash``), so the read model holds nothing a caller could use; 256 random
bits need no slow hash.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass
from datetime import datetime

from schemas.auth import ApiTokenIssued, ApiTokenRevoked, Role
from schemas.envelope import new_event

PREFIX = "gst_"
_ID_ALPHABET = string.ascii_lowercase + string.digits
_TOKEN = re.compile(r"^gst_([a-z0-9]{12})_([A-Za-z0-9_-]{43})$")


@dataclass(frozen=True)
class Minted:
    token_id: str
    token: str  # shown once, to whoever issued it
    token_hash: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def mint() -> Minted:
    token_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(12))
    secret = secrets.token_urlsafe(32)
    return Minted(token_id, f"{PREFIX}{token_id}_{secret}", hash_secret(secret))


def split(token: str) -> tuple[str, str] | None:
    """(token id, secret) of a well-formed token, else None."""
    match = _TOKEN.match(token)
    return (match.group(1), match.group(2)) if match else None


def matches(secret: str, token_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), token_hash)


def issued(minted: Minted, *, name: str, role: Role, team: str | None, issued_by: str, now: datetime,
           expires_at: datetime | None = None) -> ApiTokenIssued:
    return new_event(ApiTokenIssued, aggregate_id=minted.token_id, producer="admin", occurred_at=now,
                     key="issued", token_id=minted.token_id, name=name, role=role, team=team,
                     token_hash=minted.token_hash, issued_by=issued_by, expires_at=expires_at)


def revoked(token_id: str, *, revoked_by: str, reason: str, now: datetime) -> ApiTokenRevoked:
    return new_event(ApiTokenRevoked, aggregate_id=token_id, producer="admin", occurred_at=now, key="revoked",
                     token_id=token_id, revoked_by=revoked_by, reason=reason)
