"""Whether copies save this engine time: their measured cost against the prefill they spare.

A copy (:mod:`.texts`, :mod:`.replies`) computes text once more, in the context a later reader
will read it in, so that the reader reuses it instead of computing it. That only pays where the
copy costs less than the reader's own prefill of the same ids: otherwise it moves work into the
sender's turn, and a graph run on one engine finishes later (the reader's first token comes no
sooner counted from the graph's start).

- **Text copies** computed in a forward of their own (a CPU, :func:`~.decode.texts_alone`) cost
  what they cost: the reader's prefix computed again where it is short, the text, the versions
  recorded (on the development range, (c): 1.47-3.78 s of copies per request against 1.2-2.9 s
  of readers' prefill spared). Where they ride on CUDA decode steps they are assumed nearly free
  and not measured (their share of a step cannot be told from the sender's).
- **Reply copies** ride on the sender's decode steps: their cost is what those steps took beyond
  as many plain steps (the engine's recent decode steps without copies; the copies' queries and
  the 4-D mask every step of a framed call carries), plus the copies fed after the reply. Fed
  after an audit they are a forward of their own, timed whole. On the report range's debate
  (b) on a CPU they cost 5.3 s for 830 copy ids against 0.4 s of readers' prefill spared.
- **Copies riding together** (text copies on CUDA decode steps beside reply copies, or alone
  on them): the steps' cost beyond plain ones is the cost of every copy id they carried, and
  counts against each kind that rode.

:class:`CopyCost` keeps each kind's seconds per copy id and the engine's seconds per prefilled
id (recent calls) and says whether a kind pays. Until it has seen both it says it does, so the
first copies are fed and measured; once they lose, no more of that kind are fed (the rates are a
property of the model and device, not of the prompt), and a reader computes what the copy would
have held. A kind loses on the median of ``min_samples`` measurements, or on its first one
where that costs more than :data:`CLEAR_FACTOR` times the prefill per id: a graph gives one
measurement of reply copies per sender (its steps are weighed once the engine has decoded
without copies, which the graph's last agent does, so a graph's first senders are weighed at
its end), and copies five to fifteen times dearer than prefill (the debate above) should not
run for several graphs before they are stopped.

Pure bookkeeping over floats: no tensors, no model.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Literal, Mapping, Optional

__all__ = ["CLEAR_FACTOR", "CopyCost", "CopyKind", "MIN_PREFILL_IDS", "STEP_WINDOW"]

#: A prefill counts toward the engine's rate only where it computed at least this many ids
#: (short forwards are dominated by per-forward overheads a copy of a long text does not pay).
MIN_PREFILL_IDS = 128
#: Plain decode steps kept for the baseline reply copies are weighed over (single steps are
#: noisy; a median over this many is not).
STEP_WINDOW = 64
#: A kind of copy measured once at more than this many times the prefill's seconds per id loses
#: without waiting for ``min_samples`` (the margin covers one noisy measurement: a copy sample
#: and a prefill sample each slowed by up to about half by something else on the machine).
CLEAR_FACTOR = 2.0

#: The two kinds of copy (:mod:`.texts`, :mod:`.replies`).
CopyKind = Literal["text", "reply"]


class CopyCost:
    """Seconds per copy id of each kind of copy, against seconds per id of the engine's
    prefills (thread-safe).

    Args:
        window: recent measurements kept of each kind of copy and of prefills.
        min_samples: measurements of each needed before copies may be judged to lose (and plain
            decode steps before a riding copy can be measured at all).
    """

    def __init__(self, window: int = 8, min_samples: int = 2) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("window >= 1 and 1 <= min_samples <= window")
        self.min_samples = min_samples
        self._copies: dict[str, deque[tuple[int, float]]] = {kind: deque(maxlen=window) for kind in ("text", "reply")}
        self._prefills: deque[tuple[int, float]] = deque(maxlen=window)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)
        #: riding copies measured before there was a baseline to weigh them against
        self._unweighed: deque[tuple[dict, int, float, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record_prefill(self, computed_ids: int, seconds: float) -> None:
        """A call's prefill computed ``computed_ids`` prompt ids in ``seconds`` (ignored under
        :data:`MIN_PREFILL_IDS` ids)."""
        if computed_ids >= MIN_PREFILL_IDS and seconds > 0:
            with self._lock:
                self._prefills.append((computed_ids, seconds))

    def record_step(self, seconds: float) -> None:
        """One decode step of a call that fed no copies took ``seconds``; riding copies measured
        before ``min_samples`` such steps were seen are weighed now."""
        if seconds > 0:
            with self._lock:
                self._steps.append(seconds)
                if len(self._steps) >= self.min_samples:
                    while self._unweighed:
                        self._weigh(*self._unweighed.popleft())

    def record_copies(self, kind: CopyKind, copy_ids: int, seconds: float) -> None:
        """One call's copies of ``kind`` spared their readers ``copy_ids`` ids of prefill and took
        ``seconds`` (for text copies: the readers' prefixes computed again and the versions
        recorded included)."""
        if copy_ids > 0 and seconds > 0:
            with self._lock:
                self._copies[kind].append((copy_ids, seconds))

    def record_riding(self, copy_ids: Mapping[CopyKind, int], steps: int, steps_s: float,
                      after_s: float = 0.0) -> None:
        """One call's copies, ``copy_ids`` ids of each kind, rode on its ``steps`` decode steps,
        which took ``steps_s`` seconds together, and took ``after_s`` more after the reply (the
        ids fed then, the versions recorded). Their cost: what the steps took beyond as many
        plain steps (:meth:`record_step`'s median), plus ``after_s``, spread over every copy id
        and recorded for each kind that rode (their shares of one step cannot be told apart).
        Measured before ``min_samples`` plain steps were seen (a graph's first senders, before
        any agent decoded without copies), it is kept and weighed once they are."""
        riding = {kind: n for kind, n in copy_ids.items() if n > 0}
        if not riding or steps <= 0:
            return
        with self._lock:
            if len(self._steps) < self.min_samples:
                self._unweighed.append((riding, steps, steps_s, after_s))
            else:
                self._weigh(riding, steps, steps_s, after_s)

    def _weigh(self, riding: dict, steps: int, steps_s: float, after_s: float) -> None:
        """Record one call's riding copies against the plain steps' median (lock held)."""
        extra = max(0.0, steps_s - steps * statistics.median(self._steps)) + max(0.0, after_s)
        for kind in riding:
            self._copies[kind].append((sum(riding.values()), extra))

    @staticmethod
    def _rate(samples) -> float:
        """The median of the samples' seconds per id: one forward slowed by something else on
        the machine (a prefill sample is taken once per long call, and is kept for ``window``
        of them) does not decide on its own."""
        return statistics.median(s / n for n, s in samples)

    def rates(self, kind: CopyKind = "text") -> Optional[tuple[float, float]]:
        """(copy seconds per id of ``kind``, prefill seconds per id), each the median over the
        recent measurements, or None until each has ``min_samples``."""
        with self._lock:
            copies = self._copies[kind]
            if len(copies) < self.min_samples or len(self._prefills) < self.min_samples:
                return None
            return self._rate(copies), self._rate(self._prefills)

    def pays(self, kind: CopyKind = "text") -> bool:
        """Whether a copy of ``kind`` is worth feeding: not measured yet, or it costs at most
        the prefill it spares, per id (the medians of ``min_samples`` measurements each; before
        that, at most :data:`CLEAR_FACTOR` times it)."""
        with self._lock:
            copies = self._copies[kind]
            if not copies or not self._prefills:
                return True
            copy_rate, prefill_rate = self._rate(copies), self._rate(self._prefills)
            if len(copies) >= self.min_samples and len(self._prefills) >= self.min_samples:
                return copy_rate <= prefill_rate
            return copy_rate <= CLEAR_FACTOR * prefill_rate

    def clear(self) -> None:
        with self._lock:
            for copies in self._copies.values():
                copies.clear()
            self._prefills.clear()
            self._steps.clear()
            self._unweighed.clear()
