"""gpusched's Python SDK: a typed client of the HTTP API and the event contract, on pydantic and
httpx only (docs/sdk.md).

    from gpusched_sdk import Client

    with Client() as gs:                      # GPUSCHED_API_URL, GPUSCHED_API_TOKEN
        job = gs.submit({"kind": "training", "queue": "research", "team": "team-research",
                         "image": "registry.example/train:1", "gpus": 8}, idempotency_key="run-42")
        final = gs.wait(job.job_id, timeout_s=3600)
        print(final.state, final.finished_at)  # a JobState, a datetime

:class:`AsyncClient` is the one implementation; :class:`Client` is made from it (the same methods,
not awaited). ``gpusched_sdk.contract`` is the event contract (commands, events, job states): the
same models the platform's services use."""

from .client import AsyncClient, StreamedEvent, event_state, job_document
from .contract.jobstate import FINAL_STATES, JobState
from .errors import (ApiError, Forbidden, InvalidInput, JobFileError, NotFound, Rejected, Unauthorized,
                     WaitTimeout)
from .models import Answered, Job, Me, Result, ServiceAnswer, Submitted, WaitReason, Why
from .sync import Client

__all__ = ["Client", "AsyncClient", "ApiError", "Unauthorized", "Forbidden", "NotFound", "Rejected", "InvalidInput",
           "WaitTimeout", "JobFileError", "Submitted", "Answered", "ServiceAnswer", "Job", "Why", "WaitReason", "Me",
           "Result", "StreamedEvent", "JobState", "FINAL_STATES", "event_state", "job_document"]
