"""The SDK's exceptions: the API's RFC 9457 problem documents, typed by status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answer of the API: its RFC 9457 problem document, parsed."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.type = problem.get("type", "")
        self.detail = problem.get("detail") or problem.get("title") or f"HTTP {status}"
        self.errors: list[dict[str, Any]] = problem.get("errors") or []
        super().__init__(f"{status}: {self.detail}")


class Unauthorized(ApiError):
    """401: no token, or not a valid one (unknown, expired, revoked)."""


class Forbidden(ApiError):
    """403: the token's role or team may not do this."""


class NotFound(ApiError):
    """404: no such job (or another team's), or not yet in the read models."""


class Rejected(ApiError):
    """409: admission rejected the job (``reason``: the RejectReason code) or refused the command."""

    @property
    def reason(self) -> str | None:
        return self.problem.get("reason")

    @property
    def job_id(self) -> str | None:
        return self.problem.get("job_id")


class InvalidInput(ApiError):
    """422: the input is not valid; ``errors`` has each field, what was wrong, what is accepted."""


class WaitTimeout(TimeoutError):
    """A wait ran out before the job reached one of the states waited for."""


class JobFileError(ValueError):
    """A job file that cannot be read or is not a job: the message names the file, the field and
    what is accepted. Raised before anything is sent."""


ERRORS: dict[int, type[ApiError]] = {401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Rejected,
                                     422: InvalidInput}
