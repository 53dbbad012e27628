"""Go's random draws for the FGD protocol, so that gpusched's cores replay the very task sequence
the FGD paper's simulator builds for a seed (bench/gorand/main.go says which draws).

The Go program is built once with the local Go toolchain into ~/.cache/gpusched (standard library
only, about a second); without Go, bench.placement falls back to Python's RNG and says so.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from bench import gobuild

SOURCE = Path(__file__).resolve().parent / "gorand"


def binary() -> Path:
    """The built gorand, keyed by the hash of its source; built here if missing."""
    digest = hashlib.sha256(b"".join((SOURCE / f).read_bytes() for f in ("go.mod", "main.go"))).hexdigest()[:12]
    return gobuild.build(SOURCE, ".", gobuild.cache() / f"gorand-{digest}", "-mod=mod")


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
