"""How an operator's tools reach a running platform: the NATS and Postgres addresses and
credentials, from the environment or from what a local `make run` wrote."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusched.userinput import UserError, read_document

if TYPE_CHECKING:  # imported when a command connects: the CLI starts without them
    import asyncpg
    import nats

    from gpusched.gateway.port import Gateway

NOT_READY = ("the read models are not ready yet: accounting has not created them ({detail}); try again in a few "
             "seconds (is the accounting service running? `make run` starts it)")


@contextlib.contextmanager
def read_models_ready() -> Iterator[None]:
    """Around a read of the read models: a table accounting has not created yet (a platform just
    started, or accounting not running) is a UserError saying so (one line, exit status 2), not a
    traceback. Every read of the CLI and the log's gateway goes through :meth:`Connection.read`,
    which uses this."""
    import asyncpg

    try:
        yield
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError) as err:
        raise UserError(NOT_READY.format(detail=str(err))) from None


CONNECTION_FILE = Path(".data/run/connection.json")
"""Where `make run` writes the connection, relative to the directory it runs in."""


def user_connection_file() -> Path:
    """The copy `make run` also writes for this user (``$XDG_STATE_HOME/gpusched``, default
    ``~/.local/state/gpusched``), so the CLI finds a running stack from any directory."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "gpusched" / "connection.json"


def save(connection: "Connection", path: Path) -> None:
    """Write ``connection`` to ``path`` and to :func:`user_connection_file`, readable by this user only."""
    for target in (path, user_connection_file()):
        _replace_private(target, json.dumps(connection.__dict__))


def _replace_private(path: Path, text: str) -> None:
    """Replace ``path`` with a new file holding ``text``, created readable by this user only and
    renamed into place: never readable by others or half written, not even for a moment, and a
    reader that had the old file open (an older version's, world-readable) never sees the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _api(saved: dict[str, Any]) -> dict[str, str | None]:
    """The API address and token: GPUSCHED_API_URL / GPUSCHED_API_TOKEN, else the file's
    ``api_url`` / ``api_token``; the file's token goes only to the file's address."""
    env_url, env_token = os.environ.get("GPUSCHED_API_URL"), os.environ.get("GPUSCHED_API_TOKEN")
    saved_url, saved_token = saved.get("api_url"), saved.get("api_token")
    if env_url:
        return {"api_url": env_url, "api_token": env_token or (saved_token if saved_url == env_url else None)}
    if os.environ.get("GPUSCHED_NATS_URL"):  # another platform than the file's
        return {"api_url": None, "api_token": env_token}
    return {"api_url": saved_url, "api_token": env_token or saved_token}


@dataclass(frozen=True)
class Connection:
    nats_url: str
    nats_user: str | None
    nats_password: str | None
    pg_dsn: str | None
    api_url: str | None = None
    api_token: str | None = None

    @classmethod
    def resolve(cls) -> "Connection":
        """Environment first (GPUSCHED_NATS_URL, GPUSCHED_NATS_USER, GPUSCHED_NATS_PASSWORD,
        GPUSCHED_PG_DSN, GPUSCHED_API_URL, GPUSCHED_API_TOKEN; TLS to NATS from
        GPUSCHED_NATS_TLS_CA/_CERT/_KEY when connecting); otherwise what a local `make run`
        wrote: the file GPUSCHED_CONNECTION_FILE names, else .data/run/connection.json in this
        directory, else this user's copy. The file's API address is used only with the file's NATS
        (not when GPUSCHED_NATS_URL names another platform), and its token only with its address."""
        saved: dict[str, Any] = {}
        if "GPUSCHED_CONNECTION_FILE" in os.environ:
            path = Path(os.environ["GPUSCHED_CONNECTION_FILE"])
        else:
            path = CONNECTION_FILE if CONNECTION_FILE.exists() else user_connection_file()
        if path.exists():
            saved = read_document(path)
            if not isinstance(saved, dict):
                raise UserError(f"{path}: (root): expected a mapping of connection settings; "
                                "remove the file, `make run` writes it again")
        return cls(
            nats_url=os.environ.get("GPUSCHED_NATS_URL") or saved.get("nats_url") or "nats://127.0.0.1:4222",
            nats_user=os.environ.get("GPUSCHED_NATS_USER") or saved.get("nats_user"),
            nats_password=os.environ.get("GPUSCHED_NATS_PASSWORD") or saved.get("nats_password"),
            pg_dsn=os.environ.get("GPUSCHED_PG_DSN") or saved.get("pg_dsn"),
            **_api(saved),
        )

    def gateway(self) -> "Gateway":
        """The applications' gateway (gpusched.gateway.port) for this connection, chosen once: the
        HTTP API when the connection names one (a tenant's token), else NATS and Postgres."""
        if self.api_url:
            from gpusched.gateway.http import HttpGateway

            return HttpGateway(self)
        from gpusched.gateway.log import LogGateway

        return LogGateway(self)

    def client(self):
        """The SDK client of the API this connection names (gpusched_sdk.Client)."""
        from gpusched_sdk import Client

        if not self.api_token:
            raise UserError(f"the API at {self.api_url} needs a token: set GPUSCHED_API_TOKEN (`gpusched token issue`)")
        try:
            return Client(self.api_url, self.api_token)
        except ValueError as err:
            raise UserError(str(err)) from None

    async def nats(self) -> "nats.NATS":
        import nats

        from runtime import eventlog
        from runtime.settings import ConfigError, NatsTls, nats_servers

        kwargs: dict[str, Any] = {}
        if self.nats_user:
            kwargs = {"user": self.nats_user, "password": self.nats_password or "",
                      "inbox_prefix": eventlog.inbox_prefix(self.nats_user)}
        try:
            tls = NatsTls.from_env()
            # one URL, or every server of a cluster, comma-separated (GPUSCHED_NATS_URL or the file's nats_url)
            servers = nats_servers(self.nats_url, "GPUSCHED_NATS_URL" if os.environ.get("GPUSCHED_NATS_URL")
                                   else "nats_url (the connection file's)")
        except ConfigError as err:
            raise UserError(str(err)) from None
        if tls is not None:
            kwargs.update(tls.connect_options())
        try:
            return await nats.connect(servers, connect_timeout=3, max_reconnect_attempts=2,
                                      allow_reconnect=False, name="gpusched-cli", **kwargs)
        except Exception as err:  # nats-py raises several unrelated types here
            raise UserError(f"cannot connect to NATS at {self.nats_url}: {err!r} (is `make run` running?)") from None

    async def read(self, query) -> Any:
        """``await query(conn)`` on a fresh read-model connection, closed after; "not ready yet"
        (:func:`read_models_ready`) before accounting has created the read models."""
        conn = await self.pg()
        try:
            with read_models_ready():
                return await query(conn)
        finally:
            await conn.close()

    async def pg(self) -> "asyncpg.Connection":
        import asyncpg

        if not self.pg_dsn:
            raise UserError("no Postgres configured: set GPUSCHED_PG_DSN or start `make run`")
        try:
            return await asyncpg.connect(self.pg_dsn, timeout=5)
        except (OSError, asyncpg.PostgresError) as err:
            raise UserError(f"cannot connect to Postgres: {err}") from None
