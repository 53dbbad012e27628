"""The web console: server-rendered pages (Jinja2) over the same reads and checks as the JSON
API, with one small script (static/console.js) for the submit form, cancel, and live refresh from
the API's server-sent-event streams. No build step and nothing fetched from elsewhere at run time.

Logging in exchanges a pasted API token for an HttpOnly, SameSite=Strict cookie holding it; the
JSON API accepts that cookie too (gpusched.api.auth.bearer), so the page's script calls the API
itself. A member sees its team's jobs and queues only, exactly as the API shows them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from gpusched.gateway import history, queue_usage
from gpusched.api import charts as chart
from gpusched.api import readable
from gpusched.api.auth import COOKIE, Identity, bearer
from gpusched.api.problems import Problem
from gpusched.api.routes import JOB_ID_PATTERN, READERS, USAGE_READERS
from schemas.auth import Role
from schemas.envelope import NAME_PATTERN
from schemas.jobstate import FINAL_STATES, WAITING_FOR_NODES, WAITING_FOR_QUOTA, JobState
from services.accounting import queries

HERE = FilePath(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
readable.install(templates.env)
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

    def __init__(self, status: int, message: str, me: Identity | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.me = status, message, me


def install(app: FastAPI) -> None:
    """The console's routes, its static files, and its two error pages."""
    from fastapi.staticfiles import StaticFiles

    app.include_router(root)
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, exc: LoginRequired) -> RedirectResponse:
        return RedirectResponse("/console/login", status_code=303)

    @app.exception_handler(Elsewhere)
    async def _elsewhere(request: Request, exc: Elsewhere) -> RedirectResponse:
        return RedirectResponse(exc.url, status_code=303)

    @app.exception_handler(PageError)
    async def _error(request: Request, exc: PageError) -> HTMLResponse:
        response = page(request, "error.html", exc.me, status=exc.status, message=exc.message)
        response.status_code = exc.status
        return response


class Elsewhere(Exception):
    """A page this identity may not open, asked for as its landing page: a redirect to the first
    page it may open (a chargeback token lands on Charts)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.url = url


OPERATORS = (Role.OPERATOR, Role.ADMIN)
PAGES: tuple[tuple[str, str, tuple[Role, ...]], ...] = (
    ("/console", "Cluster", READERS),
    ("/console/queues", "Queues", READERS),
    ("/console/jobs", "Jobs", READERS),
    ("/console/services", "Services", READERS),
    ("/console/charts", "Charts", USAGE_READERS),
    ("/console/usage", "Usage", USAGE_READERS),
    ("/console/deadletters", "Dead letters", OPERATORS),
    ("/console/whatif", "What-if", OPERATORS),
)
"""The console's pages (path, name in the menu, the roles that may open it), as the JSON API
answers the roles (gpusched.api.routes): a page's parts and subpages (``/console/jobs/<id>``,
``/console/jobs-table``) go with the longest path they start with. The menu lists only the pages
the viewer may open; any other answers a 403 page that says who may open it."""


def page_of(path: str) -> tuple[str, str, tuple[Role, ...]]:
    return max((p for p in PAGES if path.startswith(p[0])), key=lambda p: len(p[0]), default=PAGES[0])


def pages_for(me: Identity) -> list[tuple[str, str]]:
    """The (path, name) of the pages ``me`` may open, in menu order."""
    return [(path, name) for path, name, roles in PAGES if me.role in roles]


async def viewer(request: Request) -> Identity:
    """Who asks (a login page when nobody valid does), refused with a 403 page where the page
    asked for is not for its role (:data:`PAGES`)."""
    try:
        me = await request.app.state.auth.identify(bearer(request))
    except Problem:
        raise LoginRequired() from None
    _, name, roles = page_of(request.url.path)
    if me.role not in roles:
        mine = pages_for(me)
        if request.url.path in ("/console", "/console/") and mine:
            raise Elsewhere(mine[0][0])
        raise PageError(403, f"{name} is for {_roles(roles)}; you are logged in as {me.name} "
                             f"({me.role.value}{' of ' + me.team if me.team else ''}).", me)
    return me


def _roles(roles: tuple[Role, ...]) -> str:
    names = [f"{r.value}s" for r in roles]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def page(request: Request, name: str, me: Identity | None, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {"me": me, "now": datetime.now().astimezone(),
                                                      "menu": pages_for(me) if me else [], **context})


@root.get("/")
async def home() -> RedirectResponse:
    return RedirectResponse("/console", status_code=303)


@root.get("/favicon.ico")
async def favicon() -> FileResponse:
    """The console's icon where browsers look for one unasked (base.html names the same file)."""
    return FileResponse(HERE / "static" / "favicon.svg", media_type="image/svg+xml",
                        headers={"Cache-Control": "public, max-age=86400"})


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
    """The cluster at a glance: the occupancy map (live), GPU allocation by team over the last
    day, each queue's quota bar, then the tables."""
    me = await viewer(request)
    async with request.app.state.pool.acquire() as conn:
        summary = await queries.summary(conn, _team(me), request.app.state.js)
        allocation = await queries.allocation_series(conn, _team(me), 24, 24 * 3600 // 48, request.app.state.js)
        queue_rows = await queue_usage.queues_for(conn, _team(me), request.app.state.js)
    by_team = [chart.Series(t, v) for t, v in allocation["by_team"].items()]
    return page(request, "overview.html", me, summary=summary, quota_bars=chart.quota_bars(queue_rows),
                allocation=chart.time_chart(allocation["t0"], by_team, "GPUs", kind="area"),
                **await _occupancy(request, me))


async def _occupancy(request: Request, me: Identity) -> dict[str, Any]:
    async with request.app.state.pool.acquire() as conn:
        nodes = await queries.nodes(conn)
        holders = await queries.gpu_holders(conn)
    teams = sorted({h["team"] for h in holders if me.sees_team(h["team"])})
    if any(not me.sees_team(h["team"]) for h in holders):
        teams.append("other teams")
    return {"nodes": nodes, "flavors": queries.gpus_by_flavor(nodes),
            "occupancy": chart.occupancy_map(nodes, holders, _team(me)), "legend": chart.team_legend(teams)}


@router.get("/occupancy-part")
async def occupancy_part(request: Request) -> HTMLResponse:
    """The overview's live part (the occupancy map and the GPU tables), for the refresh."""
    me = await viewer(request)
    return page(request, "occupancy.html", me, **await _occupancy(request, me))


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
    return page(request, "queues.html", me, queues=rows, cohorts=cohort_totals(rows, cohorts),
                quota_bars=chart.quota_bars(rows))


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
        if job is None or not me.sees_team(job["team"]):
            raise PageError(404, f"No job {job_id} (or not yet in the read models).")
        position = await queries.job_position(conn, job_id)
        costs = await queries.job_costs(conn, job_id)  # per attempt, in the price book's currency
        currency = await queries.currency_at(conn, await queries.log_now(conn, request.app.state.js))
    events = await history.job_events(request.app.state.js, job_id, seen_by=_team(me))
    why = history.explain(job_id, events) if events else None
    return {"job": job, "timeline": readable.timeline(events), "why": why, "position": position, "waiting": WAITING,
            "final": FINAL_STATES, "costs": costs, "currency": currency}


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
    """Charts over the last ``hours`` in 48 buckets, from the reads GET /v1/metrics/series and
    /v1/usage use (services.accounting.queries), scoped as they are: a member's team only."""
    me = await viewer(request)
    bucket = max(60, hours * 3600 // 48)
    team, log = _team(me), request.app.state.js
    async with request.app.state.pool.acquire() as conn:
        points = await queries.series(conn, team, hours, bucket, log)
        allocation = await queries.allocation_series(conn, team, hours, bucket, log)
        waits = await queries.wait_series(conn, team, hours, bucket, log)
        outcomes = await queries.outcome_series(conn, team, hours, bucket, log)
        simulated = "simulated" in await queries.telemetry_sources(conn, allocation["t0"][0])
    S, t0, currency = chart.Series, allocation["t0"], allocation["currency"]
    series_t0 = [p["t0"] for p in points]
    utilization = [None if p["utilization"] is None else p["utilization"] * 100 for p in points]
    sim = " (simulated)" if simulated else ""
    figures = [  # (id, title, note, svg)
        ("allocation-team", "GPU allocation by team", "GPUs held, mean over each bucket",
         chart.time_chart(t0, [S(k, v) for k, v in allocation["by_team"].items()], "GPUs", kind="area")),
        ("allocation-flavor", "GPU allocation by flavor", "GPUs held, mean over each bucket",
         chart.time_chart(t0, [S(k, v) for k, v in allocation["by_flavor"].items()], "GPUs", kind="area")),
        ("utilization", f"GPU utilization{sim}", "mean over the GPUs that reported telemetry, every team's"
         + ("; simulated: the sim executor's model, not measured" if simulated else ""),
         chart.time_chart(series_t0, [S(f"utilization{sim}", utilization)], "%", top=100, join_gaps=True)),
        ("waits", "Wait from queued to started, per priority class", "p50 (solid) and p90 (dashed) of the attempts "
         "started in each bucket",
         chart.time_chart(waits["t0"], [S(f"{c} {p}", v[p], chart.colour(c), dashed=p == "p90")
                                        for c, v in waits["classes"].items() for p in ("p50", "p90")],
                          "wait", fmt=chart.fmt_duration, step_of=chart.nice_duration_step, join_gaps=True)),
        ("outcomes", "Preemptions and failures", "attempts that ended preempted or failed, per bucket",
         chart.time_chart(outcomes["t0"], [S("preempted", outcomes["preempted"], "#f79009"),
                                           S("failed", outcomes["failed"], "#d92d20")], "attempts", kind="bars",
                          step_of=chart.count_step)),
        ("cost", f"Cost by team ({currency})", "usage cost per bucket, priced by the price book as it is now",
         chart.time_chart(t0, [S(k, v) for k, v in allocation["cost_by_team"].items()], currency, kind="bars")),
        ("congestion", "Congestion", "jobs waiting at each bucket's end, and jobs submitted in it",
         chart.time_chart(series_t0, [S("waiting", [p["waiting"] for p in points], "#b54708"),
                                      S("submitted", [p["submitted"] for p in points], "#2d5bd7")], "jobs",
                          step_of=chart.count_step)),
    ]
    return page(request, "charts.html", me, hours=hours, bucket=chart.fmt_duration(bucket), charts=figures,
                first=t0[0], last=t0[-1])


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
    async with request.app.state.pool.acquire() as conn:  # the price book's, as the usage page shows
        currency = await queries.currency_at(conn, await queries.log_now(conn, request.app.state.js))
    return page(request, "whatif.html", me, result=result, error=None, text=text, fidelity=run.fidelity_lines(result),
                figures=run.whatif.FIGURES, cell=run.cell, delta_cell=run.delta_cell, currency=currency)


def _whatif_error(request: Request, me: Identity, text: str, message: str) -> HTMLResponse:
    response = page(request, "whatif.html", me, result=None, error=message, text=text)
    response.status_code = 400
    return response


async def _operator(request: Request) -> Identity:
    me = await viewer(request)
    if not me.is_operator:
        raise PageError(403, "The what-if is for operators.")
    return me
