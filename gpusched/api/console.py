"""The web console: server-rendered pages (Jinja2) over the same reads and checks as the JSON
API, with one small script (static/console.js) for the submit form, cancel, and live refresh from
the API's server-sent-event streams. No build step and nothing fetched from elsewhere at run time.

Logging in exchanges a pasted API token for an HttpOnly, SameSite=Strict cookie holding it; the
JSON API accepts that cookie too (gpusched.api.auth.bearer), so the page's script calls the API
itself. A member sees its team's jobs and queues only, exactly as the API shows them."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from markupsafe import Markup

from gpusched.gateway import history, queue_usage
from gpusched.api.auth import COOKIE, Identity, bearer
from gpusched.api.problems import Problem
from gpusched.api.routes import JOB_ID_PATTERN
from schemas.auth import Role
from schemas.envelope import NAME_PATTERN
from schemas.jobstate import FINAL_STATES, WAITING_FOR_NODES, WAITING_FOR_QUOTA, JobState
from services.accounting import queries

HERE = FilePath(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(prefix="/console", include_in_schema=False)
root = APIRouter(include_in_schema=False)
WAITING = (*WAITING_FOR_QUOTA, *WAITING_FOR_NODES)
"""States in which the console shows why a job waits (and no nodes: the last attempt's are gone)."""
PAGE = 50
JOB_ID = Path(pattern=JOB_ID_PATTERN, max_length=63)


class LoginRequired(Exception):
    """A console page without a valid token: answered by a redirect to the login page."""


class PageError(Exception):
    """A console page that cannot be shown (404, 403): an HTML error page."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def install(app: FastAPI) -> None:
    """The console's routes, its static files, and its two error pages."""
    from fastapi.staticfiles import StaticFiles

    app.include_router(root)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, exc: LoginRequired) -> RedirectResponse:
        return RedirectResponse("/console/login", status_code=303)

    @app.exception_handler(PageError)
    async def _error(request: Request, exc: PageError) -> HTMLResponse:
        response = page(request, "error.html", None, status=exc.status, message=exc.message)
        response.status_code = exc.status
        return response


async def viewer(request: Request) -> Identity:
    try:
        return await request.app.state.auth.identify(bearer(request))
    except Problem:
        raise LoginRequired() from None


def page(request: Request, name: str, me: Identity | None, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {"me": me, "now": datetime.now().astimezone(), **context})


@root.get("/")
async def home() -> RedirectResponse:
    return RedirectResponse("/console", status_code=303)


@router.get("/login")
async def login_form(request: Request, error: str | None = None) -> HTMLResponse:
    return page(request, "login.html", None, error=error)


@router.post("/login")
async def login(request: Request, token: Annotated[str, Form(max_length=200)]) -> Response:
    try:
        await request.app.state.auth.identify(token.strip())
    except Problem:
        return page(request, "login.html", None, error="That token is not valid (unknown, expired or revoked).")
    response = RedirectResponse("/console", status_code=303)
    response.set_cookie(COOKIE, token.strip(), httponly=True, samesite="strict", path="/",
                        secure=request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout() -> RedirectResponse:
    response = RedirectResponse("/console/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


def _team(me: Identity) -> str | None:
    return me.team if me.role == Role.MEMBER else None


@router.get("")
async def overview(request: Request) -> HTMLResponse:
    me = await viewer(request)
    async with request.app.state.pool.acquire() as conn:
        nodes = await queries.nodes(conn)
        summary = await queries.summary(conn, _team(me), request.app.state.js)
    return page(request, "overview.html", me, flavors=queries.gpus_by_flavor(nodes), nodes=nodes, summary=summary)


@router.get("/services")
async def services(request: Request) -> HTMLResponse:
    """The team's inference services (docs/serving.md), each with its replicas."""
    me = await viewer(request)
    async with request.app.state.pool.acquire() as conn:
        rows = await queries.services(conn, _team(me))
        replicas = {r["service"]: await queries.service_replicas(conn, r["service"]) for r in rows}
    return page(request, "services.html", me, services=rows, replicas=replicas)


@router.get("/queues")
async def queues(request: Request) -> HTMLResponse:
    me = await viewer(request)
    async with request.app.state.pool.acquire() as conn:
        rows = await queue_usage.queues_for(conn, _team(me), request.app.state.js)
        cohorts = await queries.cohorts(conn)
    return page(request, "queues.html", me, queues=rows, cohorts=cohort_totals(rows, cohorts))


def cohort_totals(queue_rows: list[dict[str, Any]], cohorts: list[queries.Cohort]) -> list[dict[str, Any]]:
    """One row per cohort and flavor: nominal, used, borrowed, lent and pending jobs summed over
    the given queues in that cohort or in the cohorts below it (a queue's pending jobs count once,
    not once per flavor). A cohort none of the given queues is in keeps one row of zeros."""
    parents = {c.name: c.parent for c in cohorts}
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    pending_seen: set[tuple[str, str]] = set()
    for q in queue_rows:
        cohort, seen = q.get("cohort"), set()
        while cohort is not None and cohort not in seen:
            seen.add(cohort)
            t = totals.setdefault((cohort, q["flavor"]), {"cohort": cohort, "parent": parents.get(cohort),
                                                          "flavor": q["flavor"], "queues": 0, "nominal": 0,
                                                          "used": 0, "borrowed": 0, "lent": 0, "pending_jobs": 0})
            t["queues"] += 1
            for key in ("nominal", "used", "borrowed", "lent"):
                t[key] += q[key] or 0
            if (cohort, q["queue"]) not in pending_seen:
                pending_seen.add((cohort, q["queue"]))
                t["pending_jobs"] += q["pending_jobs"] or 0
            cohort = parents.get(cohort)
    for c in cohorts:
        if not any(name == c.name for name, _ in totals):
            totals[(c.name, "")] = {"cohort": c.name, "parent": c.parent, "flavor": "–", "queues": 0,
                                       "nominal": 0, "used": 0, "borrowed": 0, "lent": 0, "pending_jobs": 0}
    return [totals[k] for k in sorted(totals)]


async def _jobs(request: Request, me: Identity, state: str | None, queue: str | None, kind: str | None,
                cursor: str | None) -> dict[str, Any]:
    async with request.app.state.pool.acquire() as conn:
        jobs_page = await queries.jobs_page(conn, team=_team(me), state=state, queue=queue, kind=kind, limit=PAGE,
                                            cursor=cursor)
        allowed = await queries.queue_teams(conn)
    my_queues = sorted(q for q, teams in allowed.items() if me.team is None or me.team in teams)
    return {"jobs": jobs_page.items, "next_cursor": jobs_page.next_cursor,
            "filters": {"state": state, "queue": queue, "kind": kind}, "states": [s.value for s in JobState],
            "waiting": WAITING, "queues": my_queues}


Filter = Annotated[str | None, Query(pattern=NAME_PATTERN, max_length=63)]


@router.get("/jobs")
async def jobs(request: Request, state: Filter = None, queue: Filter = None, kind: Filter = None,
               cursor: Annotated[str | None, Query(pattern=queries.CURSOR_PATTERN)] = None) -> HTMLResponse:
    me = await viewer(request)
    return page(request, "jobs.html", me, **await _jobs(request, me, state, queue, kind, cursor))


@router.get("/jobs-table")
async def jobs_table(request: Request, state: Filter = None, queue: Filter = None, kind: Filter = None,
                     cursor: Annotated[str | None, Query(pattern=queries.CURSOR_PATTERN)] = None) -> HTMLResponse:
    """The jobs table alone, for the live refresh."""
    me = await viewer(request)
    return page(request, "jobs_table.html", me, **await _jobs(request, me, state, queue, kind, cursor))


async def _job(request: Request, me: Identity, job_id: str) -> dict[str, Any]:
    async with request.app.state.pool.acquire() as conn:
        job = await queries.get_job(conn, job_id)
        position = await queries.job_position(conn, job_id) if job else None
    if job is None or not me.sees_team(job["team"]):
        raise PageError(404, f"No job {job_id} (or not yet in the read models).")
    events = await history.job_events(request.app.state.js, job_id)
    why = history.explain(job_id, events) if events else None
    return {"job": job, "timeline": timeline(events), "why": why, "position": position, "waiting": WAITING,
            "final": FINAL_STATES}


@router.get("/jobs/{job_id}")
async def job(request: Request, job_id: Annotated[str, JOB_ID]) -> HTMLResponse:
    me = await viewer(request)
    return page(request, "job.html", me, **await _job(request, me, job_id))


@router.get("/jobs/{job_id}/detail")
async def job_detail(request: Request, job_id: Annotated[str, JOB_ID]) -> HTMLResponse:
    """The job page's live part, for the refresh."""
    me = await viewer(request)
    return page(request, "job_detail.html", me, **await _job(request, me, job_id))


@router.get("/charts")
async def charts(request: Request, hours: Annotated[int, Query(ge=1, le=168)] = 24) -> HTMLResponse:
    me = await viewer(request)
    bucket = max(60, hours * 3600 // 48)
    async with request.app.state.pool.acquire() as conn:
        points = await queries.series(conn, _team(me), hours, bucket, request.app.state.js)
    series = {
        "GPU utilization (mean)": [p["utilization"] for p in points],
        "Median wait, seconds (jobs started)": [p["wait_p50_s"] for p in points],
        "Waiting jobs (congestion)": [p["waiting"] for p in points],
        "Jobs submitted": [p["submitted"] for p in points],
    }
    labels = [p["t0"] for p in points]
    return page(request, "charts.html", me, hours=hours,
                charts=[(title, svg_chart(values), _last(values)) for title, values in series.items()],
                first=labels[0] if labels else None, last=labels[-1] if labels else None)


@router.get("/usage")
async def usage(request: Request) -> HTMLResponse:
    me = await viewer(request)
    statement = None
    async with request.app.state.pool.acquire() as conn:
        rows = await queries.team_usage(conn, _team(me), ["team", "flavor"], None, request.app.state.js)
        now = await queries.log_now(conn, request.app.state.js)
        currency = await queries.currency_at(conn, now)  # the price book's, for every role
        if me.role in CHARGEBACK_READERS:  # the roles /v1/chargeback answers
            statement = await queries.statement(conn, now.strftime("%Y-%m"), "team", log=request.app.state.js)
    return page(request, "usage.html", me, rows=rows, statement=statement, currency=currency)


CHARGEBACK_READERS = (Role.CHARGEBACK, Role.OPERATOR, Role.ADMIN)
"""Who reads chargeback statements: every team's lines (as GET /v1/chargeback)."""


@router.get("/deadletters")
async def deadletters(request: Request) -> HTMLResponse:
    me = await viewer(request)
    if not me.is_operator:
        raise PageError(403, "Dead letters are for operators.")
    return page(request, "deadletters.html", me, rows=await history.dead_letters(request.app.state.js, 100))


WHATIF_MAX_BYTES = 1024 * 1024
"""A queues file for the what-if page: at most 1 MiB, as `gpusched whatif --apply` reads one."""


@router.get("/whatif")
async def whatif_form(request: Request) -> HTMLResponse:
    me = await _operator(request)
    return page(request, "whatif.html", me, result=None, error=None, text="")


@router.post("/whatif")
async def whatif_run(request: Request, queues: Annotated[str, Form(max_length=WHATIF_MAX_BYTES)] = "",
                     file: Annotated[UploadFile | None, File()] = None) -> HTMLResponse:
    """The whole log replayed with no change and under the queues file uploaded (or, with none,
    pasted): the three columns per team, the baseline's fidelity first (gpusched.api.whatif)."""
    from gpusched.api import whatif as run
    from gpusched.errors import UserError

    me = await _operator(request)
    text, source = queues, "queues (pasted)"
    if file is not None and file.filename:
        raw = await file.read(WHATIF_MAX_BYTES + 1)
        source = f"queues file {file.filename!r}"
        if len(raw) > WHATIF_MAX_BYTES:
            return _whatif_error(request, me, text, f"{source}: larger than {WHATIF_MAX_BYTES} bytes; accepted: "
                                                    "files of at most 1 MiB")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _whatif_error(request, me, text, f"{source}: not UTF-8 text; accepted: a YAML or JSON queues file")
    if not text.strip():
        return _whatif_error(request, me, text, "queues: nothing given; accepted: a queues file (gpusched apply's "
                                                "format: priority_classes, preemption_limits, cohorts, queues), "
                                                "uploaded or pasted")
    try:
        result = await run.run_text(request.app.state.js, text, source)
    except UserError as err:
        return _whatif_error(request, me, text, str(err))
    return page(request, "whatif.html", me, result=result, error=None, text=text, fidelity=run.fidelity_lines(result),
                figures=run.whatif.FIGURES, number=run.number)


def _whatif_error(request: Request, me: Identity, text: str, message: str) -> HTMLResponse:
    response = page(request, "whatif.html", me, result=None, error=message, text=text)
    response.status_code = 400
    return response


async def _operator(request: Request) -> Identity:
    me = await viewer(request)
    if not me.is_operator:
        raise PageError(403, "The what-if is for operators.")
    return me


def timeline(events: list) -> list[dict[str, Any]]:
    """A job's events as timeline rows: when, what, which attempt, and the detail that matters."""
    rows = []
    for _, e in events:
        detail = {k: v for k, v in e.model_dump(mode="json").items()
                  if k in ("queue", "reason", "message", "flavor", "exit_code", "next_attempt", "after", "grace_seconds",
                           "step", "location", "by_job", "position") and v not in (None, "", [])}
        if getattr(e, "placement", None):
            detail["nodes"] = ", ".join(p.node for p in e.placement)
        rows.append({"time": e.occurred_at, "type": e.type, "attempt": getattr(e, "attempt", None),
                     "producer": e.producer, "detail": detail})
    return rows


def svg_chart(values: list[float | int | None], width: int = 560, height: int = 120) -> Markup:
    """A polyline of ``values`` (None: a gap) scaled to the box, with its maximum marked. Markup
    (the template inserts it as is) built only by ``Markup.format``, which escapes every value it
    puts in: nothing but numbers goes in today, and a label added later is escaped all the same."""
    known = [float(v) for v in values if v is not None]
    top = max(known, default=0.0) or 1.0
    step = width / max(1, len(values) - 1)
    lines, current = [], []
    for i, v in enumerate(values):
        if v is None:
            if current:
                lines.append(current)
            current = []
            continue
        current.append((f"{i * step:.1f}", f"{height - 4 - (float(v) / top) * (height - 8):.1f}"))
    if current:
        lines.append(current)
    paths = Markup("").join(
        Markup('<polyline fill="none" stroke="currentColor" stroke-width="2" points="{}"/>').format(
            " ".join(f"{x},{y}" for x, y in pts))
        if len(pts) > 1 else Markup('<circle r="3" fill="currentColor" cx="{}" cy="{}"/>').format(*pts[0])
        for pts in lines)
    return Markup('<svg viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img">'
                  '<line x1="0" y1="{base}" x2="{w}" y2="{base}" stroke="#ccc"/>{paths}'
                  '<text x="4" y="12" font-size="11">max {top}</text></svg>').format(
        w=width, h=height, base=height - 4, paths=paths, top=_fmt(top))


def _fmt(x: float) -> str:
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}"


def _last(values: list) -> str:
    known = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return _fmt(float(known[-1])) if known else "–"
