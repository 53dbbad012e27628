"""Go's random draws for the FGD protocol, so that gpusched's cores replay the very task sequence
the FGD paper's simulator builds for a seed (bench/gorand/main.go says which draws).

The Go program is built once with the local Go toolchain into ~/.cache/gpusched (standard library
only, about a second); without Go, bench.placement falls back to Python's RNG and says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "gorand"


class GoUnavailable(RuntimeError):
    pass


def binary() -> Path:
    """The built gorand, keyed by the hash of its source; built here if missing."""
    digest = hashlib.sha256(b"".join((SOURCE / f).read_bytes() for f in ("go.mod", "main.go"))).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpusched"
    out = cache / f"gorand-{digest}"
    if out.exists():
        return out
    go = shutil.which("go")
    if go is None:
        raise GoUnavailable("go is not on PATH (needed to build bench/gorand)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
    done = subprocess.run([go, "build", "-o", str(tmp), "."], cwd=SOURCE, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise GoUnavailable(f"go build of bench/gorand failed: {done.stderr.strip()[-500:]}")
    tmp.replace(out)
    return out


class GoDraws:
    """The peer's draws for one seed: ``shuffle`` applies its rand.Shuffle of ``n`` items, and
    ``randrange(n)`` returns its successive rand.Intn(n) (tracesim.Draws)."""

    def __init__(self, seed: int, n: int, draws: int) -> None:
        done = subprocess.run([str(binary()), str(seed), str(n), str(draws)], capture_output=True, text=True,
                              check=True)
        order, values = done.stdout.split("\n")[:2]
        self.n = n
        self.order = [int(x) for x in order.split()]
        self.values = [int(x) for x in values.split()]
        self.used = 0

    def shuffle(self, x: list, /) -> None:
        if len(x) != self.n:
            raise ValueError(f"the Go draws were made for {self.n} items, not {len(x)}")
        x[:] = [x[i] for i in self.order]

    def randrange(self, n: int, /) -> int:
        if n != self.n:
            raise ValueError(f"the Go draws are Intn({self.n}), not Intn({n})")
        if self.used == len(self.values):
            raise ValueError(f"all {len(self.values)} Go draws are used; ask for more")
        self.used += 1
        return self.values[self.used - 1]
