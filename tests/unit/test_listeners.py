"""Listening sockets bound before their ports are told (issue 42): what a taken port says, the dev
stack's choice of the API's port, and a metrics server on a socket it inherited."""

from __future__ import annotations

import os
import socket
import urllib.request

import pytest

from gpusched.dev import run as devrun
from runtime import observability
from runtime.observability import CannotListen


@pytest.fixture
def taken():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_taken_port_says_which_why_and_what_would_help(taken):
    with pytest.raises(CannotListen) as err:
        observability.listen("127.0.0.1", taken, setting="GPUSCHED_METRICS_PORT")
    assert str(err.value) == (f"cannot listen on 127.0.0.1:{taken}: address in use (another process holds it); "
                              "set GPUSCHED_METRICS_PORT to a free port, or stop the process that holds it")


def test_the_dev_api_port_asked_for_is_that_one_or_nothing_and_the_default_gives_way(taken, monkeypatch):
    monkeypatch.delenv("GPUSCHED_API_PORT", raising=False)
    with devrun._api_listener(default_port=taken) as elsewhere:  # bound and held, on another port
        assert elsewhere.getsockname()[1] != taken
        assert elsewhere.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    monkeypatch.setenv("GPUSCHED_API_PORT", str(taken))
    with pytest.raises(CannotListen, match=f"127.0.0.1:{taken}: address in use .*GPUSCHED_API_PORT"):
        devrun._api_listener()


def test_metrics_are_served_on_the_socket_handed_down(monkeypatch):
    held = observability.listen("127.0.0.1", 0)
    port = held.getsockname()[1]
    monkeypatch.setenv(observability.METRICS_FD, str(held.fileno()))
    server = observability.serve_metrics(port)  # binding the port again here would fail: it is held
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200
        assert observability.METRICS_FD not in os.environ  # not handed on to its children
    finally:
        server.shutdown()
        server.server_close()
