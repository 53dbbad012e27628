"""The job id rule lives once, in the contract (schemas.commands.job_id_of): the CLI, the API and
admission all call it."""

from schemas.commands import SubmitJob, job_id_for_key, job_id_of

SPEC = {"kind": "training", "queue": "q", "team": "team-a", "image": "img", "gpus": 1}


def test_given_keyed_admission_and_client_ids():
    assert job_id_of(SubmitJob(job_id="mine", spec=SPEC), 7) == "mine"
    keyed = SubmitJob(spec={**SPEC, "idempotency_key": "k"})
    assert job_id_of(keyed) == job_id_of(keyed, 9) == job_id_for_key("team-a", "k")
    bare = SubmitJob(spec=SPEC)
    assert job_id_of(bare, 12) == "j-12"  # admission: deterministic, replay equals live
    fresh = job_id_of(bare)
    assert fresh.startswith("j-") and len(fresh) == 18 and fresh != job_id_of(bare)


def test_the_doors_call_the_contract():
    import inspect

    from gpusched.api import routes
    from gpusched.gateway import commands
    from services.admission import domain

    assert "commands.submission(" in inspect.getsource(routes.submit)  # the gateway's command, as the CLI's
    assert "job_id_of(" in inspect.getsource(commands.submission)
    assert "job_id_of(" in inspect.getsource(commands.new_job_id)
    assert "job_id_of(" in inspect.getsource(domain.AdmissionCore._new_job_id)
