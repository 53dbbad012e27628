"""The publishing examples of docs/publishing.md, each run as a team would run it, with nothing but
the team's NATS credential, against the running platform: Go (nats.go), JavaScript (the `nats`
npm package), Python (nats-py) and the plain `nats` CLI. Each submits a job with an idempotency
key and reads admission's decision from the team's own stream; a second run with the same key is
a duplicate of the first, and a job for a queue the team may not use is rejected with the reason.
An example is skipped only when its toolchain (go, node) is not on the machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.natscli import nats_cli  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "publishing"


@pytest.fixture(scope="module")
def toolchains() -> dict[str, str]:
    """What scripts/publishing-examples.sh built: "go" -> the Go example, "js" -> node_modules."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "publishing-examples.sh")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines())


def commands(toolchains: dict[str, str], nats_cli: str) -> dict[str, tuple[list[str], dict[str, str]] | None]:
    return {
        "go": ([toolchains["go"]], {}) if "go" in toolchains else None,
        "js": (["node", str(EXAMPLES / "js" / "publish.cjs")], {"NODE_PATH": toolchains["js"]})
        if "js" in toolchains else None,
        "python": ([sys.executable, str(EXAMPLES / "python" / "publish.py")], {}),
        "cli": (["sh", str(EXAMPLES / "cli.sh")], {"NATS": nats_cli}),
    }


@pytest.mark.parametrize("language", ["go", "js", "python", "cli"])
def test_the_example_submits_and_reads_the_decision(api_stack, toolchains, nats_cli, language):  # noqa: F811
    example = commands(toolchains, nats_cli)[language]
    if example is None:
        pytest.skip(f"no {language} toolchain on this machine")
    argv, extra = example
    server = api_stack.nats_server
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "NATS_"))},
           # a cluster's form, comma-separated (here the one server twice): each example splits it
           "GPUSCHED_NATS_URL": f"{server.url()},{server.url()}", "GPUSCHED_NATS_USER": "team-a",
           "GPUSCHED_NATS_PASSWORD": server.creds.users["team-a"], **extra}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=90, cwd=EXAMPLES)

    job_id, key = f"{language}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = run(job_id, "q-team-a", key)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"admitted {job_id}" in first.stdout
    with api_stack.client("alice") as alice:  # the platform has it, submitted by the team's credential
        deadline = time.monotonic() + 30  # once accounting has read it: the admission answers first
        while (reply := alice.get(f"/v1/jobs/{job_id}/events")).status_code == 404 and time.monotonic() < deadline:
            time.sleep(0.2)
        job = reply.json()
        assert job[0]["type"] == "JobSubmitted" and job[0]["submitter"] == "team-a", job
    again = run(job_id, "q-team-a", key)  # a retry: JetStream drops the copy, the decision stands
    assert again.returncode == 0 and f"admitted {job_id}" in again.stdout, again.stdout + again.stderr
    assert re.search(r'duplicate"?:? ?true', again.stdout.lower()), again.stdout
    rejected = run(f"{language}-x-{uuid.uuid4().hex[:8]}", "q-team-b")
    assert rejected.returncode == 1 and "rejected" in rejected.stdout, rejected.stdout + rejected.stderr


def test_the_toolchains_of_this_machine_are_used():
    """Where `make test` runs (CI, or GPUSCHED_REQUIRE_BROWSER=1, which it sets) Go and Node must
    be present, so that no example above is skipped there."""
    if not (os.environ.get("CI") or os.environ.get("GPUSCHED_REQUIRE_BROWSER") == "1"):
        pytest.skip("a bare pytest run may lack a toolchain; `make test` and CI require both")
    missing = [tool for tool in ("go", "node") if shutil.which(tool) is None]
    assert not missing, f"{missing} not on PATH: the Go and JavaScript examples would be skipped"


def test_the_quotes_in_the_guide_are_the_examples_word_for_word():
    guide = (ROOT / "docs" / "publishing.md").read_text()
    quotes = re.findall(r"<!-- quoted from (\S+) -->\n```\w*\n(.*?)```", guide, re.S)
    assert len(quotes) >= 2
    for path, text in quotes:
        assert text in (ROOT / path).read_text(), f"docs/publishing.md quotes {path} as it no longer is"
