"""Go programs the benches build with the local toolchain (test infrastructure, not the
product), cached in ~/.cache/gpusched under a name that carries their source's key."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


class GoUnavailable(RuntimeError):
    pass


def cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpusched"


def build(source: Path, package: str, out: Path, goflags: str) -> Path:
    """``out``, built from ``package`` in ``source`` unless it exists. The binary is written under
    a temporary name and renamed, so a build cut short never leaves a half-written one."""
    if out.exists():
        return out
    go = shutil.which("go")
    if go is None:
        raise GoUnavailable(f"go is not on PATH (needed to build {source})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": goflags}
    done = subprocess.run([go, "build", "-o", str(tmp), package], cwd=source, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise GoUnavailable(f"go build of {source} failed: {done.stderr.strip()[-800:]}")
    tmp.replace(out)
    return out
