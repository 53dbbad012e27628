"""The converter step of accounting's pipeline: a message that makes the converter raise, with any
exception, is poison (dead-lettered live, passed over in a rebuild), never the end of the run."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from nats.aio.msg import Msg

from schemas import JobSpec, JobSubmitted, new_event
from services.accounting import pipeline, projection

WHEN = datetime(2026, 11, 2, tzinfo=UTC)


def delivered(seq: int, data: bytes) -> Msg:
    return Msg(_client=None, subject="gpusched.job.j1.submitted", reply=f"$JS.ACK.EVENTS.acct.1.{seq}.{seq}.0.0",
               data=data, headers=None)


def submitted(job_id: str) -> bytes:
    spec = JobSpec(kind="training", queue="q", team="team-a", image="img", gpus=1)
    event = new_event(JobSubmitted, aggregate_id=job_id, producer="admission", occurred_at=WHEN, key="1", spec=spec,
                      submitter="u", intake_sequence=1)
    return event.model_dump_json().encode()


@pytest.mark.parametrize("error", [KeyError("team"), TypeError("unhashable"), RuntimeError("bug")])
def test_any_exception_from_the_converter_makes_the_message_poison(monkeypatch, error):
    real = projection.convert

    def breaks_on_j2(event, seq):
        if event.aggregate_id == "j2":
            raise error
        return real(event, seq)

    monkeypatch.setattr(projection, "convert", breaks_on_j2)
    msgs = [delivered(1, submitted("j1")), delivered(2, submitted("j2")), delivered(3, b"not json")]
    live = pipeline.convert(msgs)
    assert [seq for seq, _, _ in live.entries] == [1, 2, 3]
    assert [ops != [] for _, _, ops in live.entries] == [True, False, False]
    assert [m.reply.split(".")[5] for m, _ in live.poison] == ["2", "3"]
    assert type(error).__name__ in live.poison[0][1]
    rebuilt = pipeline.entries([(1, submitted("j1")), (2, submitted("j2")), (3, b"not json")])
    assert rebuilt == live.entries
