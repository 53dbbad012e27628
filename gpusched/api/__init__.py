"""The HTTP front door: a FastAPI application (``gpusched.api.app.create_app``) served by uvicorn
as its own process (``python -m gpusched.api``). It changes the platform only by publishing
commands on the intake subjects of the caller's team, as the caller; it reads the accounting read
models in Postgres and, for a job's history and live events, the log. docs/api.md has the routes,
the roles and the error shape."""
