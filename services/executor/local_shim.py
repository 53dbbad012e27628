"""Runs one local-backend process and records its outcome, so that the outcome survives the
executor (``python -m services.executor.local_shim RUN_DIR -- ARGV...``).

It starts ARGV in its own process group (the executor signals the group), writes
``RUN_DIR/started`` (pid, start time) and, when ARGV ends, ``RUN_DIR/exit.json`` (exit code or
signal, finish time). SIGTERM reaches ARGV directly through the group; the shim itself ignores it
and waits, so the outcome is still written after a graceful stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m services.executor.local_shim RUN_DIR -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    run_dir, command = Path(argv[0]), argv[2:]
    signal.signal(signal.SIGTERM, lambda *_: None)  # the child got it too; wait for it
    try:
        child = subprocess.Popen(command)
    except OSError as err:
        _write(run_dir / "exit.json", {"error": f"cannot start {command[0]!r}: {err}",
                                       "finished_at": datetime.now(UTC).isoformat()})
        return 127
    _write(run_dir / "started", {"pid": child.pid, "at": datetime.now(UTC).isoformat()})
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:
            continue
    out = {"finished_at": datetime.now(UTC).isoformat()}
    if code < 0:
        out["signal"] = -code
    else:
        out["exit_code"] = code
    _write(run_dir / "exit.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
