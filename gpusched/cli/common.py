"""What every `gpusched` command shares: the one Typer app, the output option and ``emit``,
``run`` (a coroutine, with a UserError as one line on stderr and exit status 2), ``guarded``,
the consoles, and the connection helpers. Each sub-CLI module imports what it needs from here
and registers its commands on :data:`app`.

Light on purpose: ``gpusched --help`` imports this module and the command modules, so anything
heavy (nats, asyncpg, httpx, rich's tables, the contract's models, the services) is imported
inside the command that needs it (docs/performance.md, "CLI start")."""

from __future__ import annotations

import functools
import json
from datetime import date, datetime
from enum import Enum
from typing import Any

import typer

app = typer.Typer(help="gpusched: GPU job scheduling on an event log.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
dev_app = typer.Typer(help="Local platform for development and demos.", no_args_is_help=True)
app.add_typer(dev_app, name="dev")


class _Console:
    """A rich Console made on first use (rich's import is not free)."""

    def __init__(self, stderr: bool = False) -> None:
        self._stderr, self._console = stderr, None

    def _made(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=self._stderr,
                                    width=None if Console(stderr=self._stderr).is_terminal else 200)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self._made(), name)

    # rich's Live (under Progress) uses the console it is given as a context manager, and special
    # methods are looked up on the type, not through __getattr__.
    def __enter__(self) -> Any:
        return self._made().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._made().__exit__(*exc)


console: Any = _Console()
err_console: Any = _Console(stderr=True)


class Output(str, Enum):
    table = "table"
    json = "json"


OutputOpt = typer.Option(Output.table, "--output", "-o", help="table or json")
OnBehalfOpt = typer.Option(
    None, "--on-behalf-of",
    help="With the operator's credential: the user it acts for, recorded in the event (default: $USER)")


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return str(value)


def emit(data: Any, output: Output, columns: list[str] | None = None, title: str | None = None) -> None:
    if output == Output.json:
        print(json.dumps(data, default=_json_default, indent=2))
        return
    from rich.table import Table
    from rich.text import Text

    rows = data if isinstance(data, list) else [data]
    if not rows:
        console.print("(nothing)")
        return
    columns = columns or list(rows[0].keys())
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        # Text, not markup: values such as "[3, 4]" or a pattern are shown as they are.
        table.add_row(*(Text("" if r.get(c) is None else str(r.get(c))) for c in columns))
    console.print(table)


def print_error(message: str) -> None:
    from gpusched import userinput

    userinput.print_error(err_console, message)


def run(coro) -> Any:
    import asyncio

    from gpusched.errors import UserError

    try:
        return asyncio.run(coro)
    except UserError as err:
        print_error(str(err))
        raise typer.Exit(2) from None


def guarded(fn):
    """A UserError raised before connecting (a bad file or argument) ends the command like one
    raised later: one line on stderr, exit status 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from gpusched.errors import UserError

        try:
            return fn(*args, **kwargs)
        except UserError as err:
            print_error(str(err))
            raise typer.Exit(2) from None
    return wrapper


def connection():
    from gpusched.gateway.connection import Connection

    return Connection.resolve()


async def with_pg(query) -> Any:
    """Run ``query(conn)`` on a fresh read-model connection ("not ready yet", exit status 2,
    before accounting has created the read models: gpusched.gateway.connection.Connection.read)."""
    return await connection().read(query)


async def with_js(action) -> Any:
    """Run ``action(js)`` on a fresh NATS connection."""
    nc = await connection().nats()
    try:
        return await action(nc.jetstream())
    finally:
        await nc.close()


async def with_pg_and_log(query) -> Any:
    """Run ``query(conn, js)`` on fresh read-model and NATS connections: a read that needs the
    log's now (services.accounting.queries.log_now) beside the read models."""
    return await with_js(lambda js: with_pg(lambda conn: query(conn, js)))


def through_gateway(call) -> Any:
    """``await call(gateway)`` on the connection's gateway (gpusched.gateway.port): the same
    for every transport."""
    async def go():
        async with connection().gateway() as gateway:
            return await call(gateway)
    return run(go())
