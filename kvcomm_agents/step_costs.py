"""What a decode forward of q ids costs on an engine's device, measured from its own steps.

A drafted step feeds the token and a draft of q - 1 ids in one forward (:mod:`.drafting`). Its
cost does not grow smoothly with q: on 2 cores of an AMD EPYC the embedded model's forward of 3
ids after 300 cached took 81 ms, of 5 ids 56 ms and of 1 id 42 ms (``python -m
benchmarks.batched_steps --ids 1,2,3,4,5,6,9``), and an earlier run on the same machine type had
3 ids at 1.2x one: which sizes are slow depends on the CPU, its state and the library build. A draft that
keeps its first ids and adds more never accepts fewer (the picker keeps a draft's ids while each
row's pick agrees, so the shorter draft's ids come first either way), so where a forward of more
ids was measured cheaper, the longer draft costs less and keeps at least as much:
:meth:`StepCosts.draft_length`.

The costs are medians of the engine's own recent forwards of each size (decode steps of calls
stepping alone, without copies), so they follow the machine and the cached lengths it serves; a
size not yet measured is never chosen by them.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Optional

__all__ = ["StepCosts"]


class StepCosts:
    """Recent seconds of decode forwards per number of ids fed, and the draft length they favour.

    Args:
        keep: forwards kept per size (the median of these is the size's cost).
        min_samples: forwards of a size needed before its cost is used.
        margin: a longer draft is chosen only where its forward costs at most this share of the
            wanted one's (timings on a shared machine move by several percent).
    """

    def __init__(self, keep: int = 16, min_samples: int = 3, margin: float = 0.9) -> None:
        self.keep, self.min_samples, self.margin = keep, min_samples, margin
        self._seconds: dict[int, deque] = {}
        self._lock = threading.Lock()

    def record(self, ids: int, seconds: float) -> None:
        """A decode forward of ``ids`` ids took ``seconds``."""
        with self._lock:
            self._seconds.setdefault(ids, deque(maxlen=self.keep)).append(seconds)

    def cost(self, ids: int) -> Optional[float]:
        """Median seconds of a forward of ``ids`` ids, or None until ``min_samples`` were measured."""
        with self._lock:
            samples = list(self._seconds.get(ids, ()))
        return statistics.median(samples) if len(samples) >= self.min_samples else None

    def draft_length(self, wanted: int, available: int) -> int:
        """How many of the ``available`` draft ids to feed where ``wanted`` were asked for: the
        longer length whose forward (the token and the draft) was measured cheapest, where it
        costs at most ``margin`` times the wanted length's; else ``wanted`` (``available`` where
        fewer were found). Sizes not measured yet are not weighed."""
        wanted = min(wanted, available)
        base = self.cost(wanted + 1)
        longer = [(cost, length) for length in range(wanted + 1, available + 1)
                  if (cost := self.cost(length + 1)) is not None]
        if base is None or not longer:
            return wanted
        cost, length = min(longer)  # the cheapest; of equal costs the shortest
        return length if cost <= self.margin * base else wanted

    def table(self) -> dict[int, float]:
        """Per number of ids, the median seconds measured (sizes with ``min_samples`` or more)."""
        with self._lock:
            sizes = sorted(self._seconds)
        return {ids: cost for ids in sizes if (cost := self.cost(ids)) is not None}
