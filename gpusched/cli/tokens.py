"""`gpusched token issue|revoke|list`: the HTTP API's tokens. Issuing and revoking publish
ApiTokenIssued / ApiTokenRevoked, which only the admin NATS credential may (connect as admin:
GPUSCHED_NATS_USER=admin); the token is printed once and only its hash is ever stored."""


from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Optional

import typer

from gpusched.errors import UserError

# Light on purpose (docs/performance.md, "CLI start"): nats, the event log, the API's tokens and
# the contract are imported by the functions that use them.


class Role(StrEnum):
    """The roles of schemas.auth.Role, for `--role` (the contract is imported when a command
    runs; tests/unit/test_cli_start.py checks the two agree)."""
    MEMBER = "member"
    OPERATOR = "operator"
    CHARGEBACK = "chargeback"
    ADMIN = "admin"


_DURATION = re.compile(r"^([1-9][0-9]{0,5})([hd])$")


def expiry(text: str | None, now: datetime) -> datetime | None:
    """``--expires-in``: ``<n>h`` or ``<n>d``; None: never."""
    if text is None:
        return None
    match = _DURATION.match(text)
    if match is None:
        raise UserError(f"--expires-in: {text!r} is not a duration; accepted: <n>h or <n>d, e.g. 12h, 90d")
    n, unit = int(match.group(1)), match.group(2)
    return now + (timedelta(hours=n) if unit == "h" else timedelta(days=n))


def check_issue(name: str, role: Role, team: str | None) -> None:
    from schemas.envelope import NAME_PATTERN

    if not re.match(NAME_PATTERN, name):
        raise UserError(f"--name: {name!r} is not a name; accepted: a DNS label (lowercase letters, digits, '-')")
    if role == Role.MEMBER and team is None:
        raise UserError("--team: a member token needs the team it belongs to")
    if role != Role.MEMBER and team is not None:
        raise UserError(f"--team: a {role.value} token acts for every team; give --team only with --role member")
    if team is not None and not re.match(NAME_PATTERN, team):
        raise UserError(f"--team: {team!r} is not a team name; accepted: a DNS label")


async def append(js, event) -> None:
    import nats.errors

    from runtime import eventlog

    try:
        await eventlog.EventLog(js).append(event)
    except nats.errors.Error as err:
        raise UserError(f"{event.type} was not published: {err!r}; token events are the admin's: connect as admin "
                        "(GPUSCHED_NATS_USER=admin and its password)") from None


# The commands register on the one app (gpusched.cli.common) when this module is imported.
from gpusched.cli.common import app, emit, run, with_pg, with_js, guarded  # noqa: E402
from gpusched.cli.common import Output, OutputOpt  # noqa: E402
output_option, output_enum = OutputOpt, Output

token_app = typer.Typer(help="HTTP API tokens: issue, revoke, list (docs/api.md)", no_args_is_help=True)
app.add_typer(token_app, name="token")

@token_app.command("issue")
@guarded
def issue(name: str = typer.Option(..., help="Who holds it; a member token acts as this user of its team"),
          role: Role = typer.Option(..., help="member, operator, chargeback or admin"),
          team: Optional[str] = typer.Option(None, help="The team of a member token"),
          expires_in: Optional[str] = typer.Option(None, help="e.g. 12h, 90d; default: never"),
          output: output_enum = output_option) -> None:
    """Issue a token and print it (once: it is not stored, only its hash)."""
    from gpusched.api import tokens
    from runtime import eventlog
    from schemas import auth

    now = datetime.now(UTC)
    check_issue(name, role, team)
    expires = expiry(expires_in, now)
    minted = tokens.mint()

    async def go(js):
        event = tokens.issued(minted, name=name, role=auth.Role(role.value), team=team,
                              issued_by=eventlog.credential_of(js) or "?", now=now, expires_at=expires)
        await append(js, event)
        return {"token_id": minted.token_id, "name": name, "role": role.value, "team": team,
                "expires_at": expires, "token": minted.token}
    emit(run(with_js(go)), output)

@token_app.command("revoke")
@guarded
def revoke(token_id: str, reason: str = typer.Option("", help="Recorded with the revocation"),
           output: output_enum = output_option) -> None:
    """Revoke a token: the API refuses it within seconds of accounting recording it."""
    from gpusched.api import tokens
    from runtime import eventlog

    if tokens.split(f"{tokens.PREFIX}{token_id}_{'x' * 43}") is None:
        raise UserError(f"{token_id!r} is not a token id; accepted: the 12-character id `token list` shows")

    async def go(js):
        await append(js, tokens.revoked(token_id, revoked_by=eventlog.credential_of(js) or "?", reason=reason,
                                        now=datetime.now(UTC)))
        return {"token_id": token_id, "revoked": True}
    emit(run(with_js(go)), output)

@token_app.command("list")
def list_(output: output_enum = output_option) -> None:
    """Every token (never its secret or hash), from the read model. Its times are wall-clock times,
    labelled so in the table: the tool that issued or revoked it stamped its event with the wall
    clock (the API checks ``expires_at`` against the wall clock), not the platform clock the
    scheduling events carry (which runs faster in the demo)."""
    from services.accounting import queries

    rows = run(with_pg(queries.api_tokens))
    if output == output_enum.table:
        rows = [wall_labelled(r) for r in rows]
    emit(rows, output)


WALL_TIMES = {"issued_at": "issued (wall)", "expires_at": "expires (wall)", "revoked_at": "revoked (wall)"}
"""A token row's times, all wall-clock, and their columns in `token list`'s table."""


def wall_labelled(row: dict) -> dict:
    """A token row for the table: each wall-clock time to the second under a column that says so."""
    out = {}
    for k, v in row.items():
        if k in WALL_TIMES:
            out[WALL_TIMES[k]] = None if v is None else v.astimezone(UTC).isoformat(timespec="seconds")
        else:
            out[k] = v
    return out
