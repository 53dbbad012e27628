"""A dev stack's JetStream store from before team accounts: every stream was in nats-server's
global account, which no user is in any more. The dev stack moves each stream to the account
that owns it now at start, so the log (and each team's stream) is still there, not silently empty."""

from __future__ import annotations

import asyncio
import json
import subprocess

import nats
import pytest

from gpusched.dev import stack as devstack
from runtime import eventlog


def test_streams_of_the_global_account_move_into_the_platforms_and_the_teams(tmp_path):
    data = tmp_path / "nats"
    store = data / "jetstream"
    port = devstack.free_port()
    old_conf = tmp_path / "old.conf"  # the shape of the configuration before accounts: users only
    old_conf.write_text(json.dumps({"listen": f"127.0.0.1:{port}", "jetstream": {"store_dir": str(store)},
                                    "authorization": {"users": [{"user": "admin", "password": "pw"}]}}))
    proc = subprocess.Popen([devstack._bin("nats-server"), "-c", str(old_conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    devstack.wait_for_port(port, proc=proc)

    async def before() -> None:
        nc = await nats.connect(f"nats://127.0.0.1:{port}", user="admin", password="pw")
        js = nc.jetstream()
        for name, subject in ((eventlog.EVENTS_STREAM, "gpusched.job.>"),
                              (eventlog.tenant_stream("team-a"), "gpusched.tenant.team-a.>")):
            await js.add_stream(name=name, subjects=[subject])
        await js.publish("gpusched.job.j1.submitted", b"an event")
        await js.publish("gpusched.tenant.team-a.job.j1.submitted", b"its copy")
        await nc.close()
    asyncio.run(before())
    proc.terminate()
    proc.wait(10)
    assert (store / "jetstream" / "$G" / "streams" / eventlog.EVENTS_STREAM).is_dir()

    with pytest.warns(UserWarning, match="moved streams"):
        server = devstack.NatsServer(data, port=devstack.free_port(), teams=("team-a",)).start()
    try:
        async def after() -> tuple[bytes, bytes]:
            nc = await nats.connect(server.url(), user="admin", password=server.creds.users["admin"],
                                    inbox_prefix=eventlog.inbox_prefix("admin"))
            js = nc.jetstream()
            event = await js.get_msg(eventlog.EVENTS_STREAM, 1)
            copy = await eventlog.tenant_js(js, "team-a").get_msg(eventlog.tenant_stream("team-a"), 1)
            await nc.close()
            return event.data, copy.data
        assert asyncio.run(after()) == (b"an event", b"its copy")
    finally:
        server.stop()
    left = store / "jetstream" / "$G" / "streams"
    assert not left.exists() or not any(left.iterdir())
