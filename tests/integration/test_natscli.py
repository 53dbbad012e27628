"""The plain `nats` CLI (tests/natscli.py) against the project's nats-server: the commands a team
uses (docs/events.md) work with the generated configuration: the admin's on the platform's
streams, the team's own on its tenant stream (in the team's account); the per-role permissions
have their own tests (test_permission_matrix.py, test_tenant_wall.py)."""

from __future__ import annotations

import json
import subprocess

from runtime import eventlog
from tests.natscli import VERSION, nats_cli, run_nats  # noqa: F401  (nats_cli is a fixture)

TEAM = "team-a"


def admin(nats_cli, nats_server, *args: str, user: str = "admin", **kw) -> subprocess.CompletedProcess[str]:
    out = run_nats(nats_cli, nats_server.url(), user, nats_server.creds.users[user], *args,
                   inbox_prefix=eventlog.inbox_prefix(user), **kw)
    assert out.returncode == 0, f"nats {' '.join(args)} exited {out.returncode}: {out.stderr}"
    return out


def team(nats_cli, nats_server, *args: str, **kw) -> subprocess.CompletedProcess[str]:
    return admin(nats_cli, nats_server, *args, user=TEAM, **kw)


def test_the_binary_is_the_pinned_version(nats_cli):
    out = subprocess.run([nats_cli, "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert (out.stdout + out.stderr).strip() == VERSION


async def test_stream_ls_names_the_provisioned_streams(nats_cli, nats_server, admin_js):
    expected = {eventlog.EVENTS_STREAM, eventlog.INTAKE_STREAM, eventlog.DLQ_STREAM}
    names = set(admin(nats_cli, nats_server, "stream", "ls", "--names").stdout.split())
    assert expected <= names
    assert not any(n.startswith(eventlog.TENANT_STREAM_PREFIX) for n in names)  # each in its team's account
    # the JSON listing leaves out Object Store and KV streams (the services' snapshot buckets)
    plain = {n for n in names if not n.startswith(("OBJ_", "KV_"))}
    assert set(json.loads(admin(nats_cli, nats_server, "stream", "ls", "--json").stdout)) == plain
    table = admin(nats_cli, nats_server, "stream", "ls").stdout
    assert all(name in table for name in expected)


async def test_pub_and_req_store_in_jetstream(nats_cli, nats_server, admin_js):
    subject = f"{eventlog.INTAKE_SUBJECTS[0].removesuffix('>')}{TEAM}.submit"
    out = admin(nats_cli, nats_server, "pub", "--jetstream", subject, '{"n": 1}')
    assert f"Stored in Stream: {eventlog.INTAKE_STREAM} Sequence: 1" in out.stderr
    assert (await admin_js.get_msg(eventlog.INTAKE_STREAM, 1)).data == b'{"n": 1}'

    # A request on a stream's subject answers with JetStream's publish ack (stdin as the body).
    out = admin(nats_cli, nats_server, "req", subject, "--raw", "--force-stdin", input='{"n": 2}')
    assert json.loads(out.stdout) == {"stream": eventlog.INTAKE_STREAM, "seq": 2}
    assert (await admin_js.get_msg(eventlog.INTAKE_STREAM, 2)).data == b'{"n": 2}'


async def test_pull_consumer_and_stream_subscription_read_one_jobs_events(nats_cli, nats_server, admin_js):
    stream, prefix = eventlog.tenant_stream(TEAM), eventlog.tenant_subjects(TEAM).removesuffix(">")
    for job, event in [("j1", "admitted"), ("j2", "admitted"), ("j1", "started"), ("j1", "succeeded")]:
        await admin_js.publish(f"{prefix}job.{job}.{event}", json.dumps({"job": job, "event": event}).encode())
    wanted = [{"job": "j1", "event": e} for e in ("admitted", "started", "succeeded")]

    team(nats_cli, nats_server, "consumer", "add", stream, "cli-probe", "--pull", "--filter", f"{prefix}job.j1.>",
         "--deliver", "all", "--ack", "explicit", "--defaults")
    out = team(nats_cli, nats_server, "consumer", "next", stream, "cli-probe", "--count", "3", "--raw")
    assert [json.loads(line) for line in out.stdout.splitlines() if line.strip()] == wanted
    info = await eventlog.tenant_js(admin_js, TEAM).consumer_info(stream, "cli-probe")
    assert (info.num_pending, info.num_ack_pending) == (0, 0)  # each one acknowledged

    out = team(nats_cli, nats_server, "sub", "--stream", stream, "--all", "--terminate-at-end", "--raw",
               f"{prefix}job.j1.>")
    assert [json.loads(line) for line in out.stdout.splitlines() if line.strip()] == wanted
