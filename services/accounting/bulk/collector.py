"""The garbage collector while a replay allocates."""

from __future__ import annotations

import gc


class BatchCollector:
    """The garbage collector during a replay: not automatic, but after each batch. A batch
    allocates some hundred thousand objects (messages, events, rows) that live until it is
    written and form no cycles; automatic collections would scan them again and again while
    they are alive (and the whole heap at each full one), about 2 µs an event of the reader's
    time. After a batch they are freed already, so a collection there scans only what
    survived. Every ``full_every`` batches a full one, for any cycles that reach the oldest
    generation. Restores the collector as it was on exit."""

    def __init__(self, full_every: int = 50):
        self.full_every, self._batches = full_every, 0
        self._enabled = self._froze = False

    def __enter__(self) -> BatchCollector:
        self._enabled = gc.isenabled()
        gc.disable()
        self._froze = gc.get_freeze_count() == 0  # else someone froze the heap already: leave it so
        gc.freeze()  # what the process holds now (modules, the client): not rescanned meanwhile
        return self

    def after_batch(self) -> None:
        self._batches += 1
        gc.collect(2 if self._batches % self.full_every == 0 else 1)

    def __exit__(self, *exc) -> None:
        if self._froze:
            gc.unfreeze()
        gc.collect()
        if self._enabled:
            gc.enable()
