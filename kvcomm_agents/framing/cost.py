"""Whether text copies save this engine time: their measured cost against the prefill they spare.

A text copy (:mod:`.texts`) computes shared text once more, after a later reader's prefix, so
that the reader reuses it instead of computing it. Where the copy rides on the sender's decode
steps (CUDA: a step is bound by reading the weights) it is assumed nearly free. Where it is
computed in a forward of its own (a CPU, :func:`~.decode.texts_alone`) it costs what it costs:
the reader's prefix computed again where it is short, the text, the versions recorded. If that
is more per text id than the engine's own prefill per id, the copy only moves work into the
sender's turn: a graph run on one engine then finishes later, and the reader's first token
comes no sooner counted from the graph's start (on the development range, (c): 1.47-3.78 s of
copies per request against 1.2-2.9 s of readers' prefill spared).

:class:`CopyCost` keeps both rates from the engine's own calls (recent ones, per text id and
per prefilled id) and says whether copies pay. Until it has seen both it says they do, so the
first copies are fed and measured; once they lose, no more are fed (the rates are a property of
the model and device, not of the prompt), and a reader computes what the copy would have held.

Pure bookkeeping over floats: no tensors, no model.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Optional

__all__ = ["CopyCost", "MIN_PREFILL_IDS"]

#: A prefill counts toward the engine's rate only where it computed at least this many ids
#: (short forwards are dominated by per-forward overheads a copy of a long text does not pay).
MIN_PREFILL_IDS = 128


class CopyCost:
    """Seconds per text id of the text copies computed alone, against seconds per id of the
    engine's prefills (thread-safe).

    Args:
        window: recent measurements kept of each.
        min_samples: measurements of each needed before copies may be judged to lose.
    """

    def __init__(self, window: int = 8, min_samples: int = 2) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError("window >= 1 and 1 <= min_samples <= window")
        self.min_samples = min_samples
        self._copies: deque[tuple[int, float]] = deque(maxlen=window)
        self._prefills: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record_prefill(self, computed_ids: int, seconds: float) -> None:
        """A call's prefill computed ``computed_ids`` prompt ids in ``seconds`` (ignored under
        :data:`MIN_PREFILL_IDS` ids)."""
        if computed_ids >= MIN_PREFILL_IDS and seconds > 0:
            with self._lock:
                self._prefills.append((computed_ids, seconds))

    def record_copies(self, text_ids: int, seconds: float) -> None:
        """One call's text copies spared their readers ``text_ids`` ids of prefill and took
        ``seconds`` (the readers' prefixes they computed again and the versions recorded
        included)."""
        if text_ids > 0 and seconds > 0:
            with self._lock:
                self._copies.append((text_ids, seconds))

    @staticmethod
    def _rate(samples) -> float:
        """The median of the samples' seconds per id: one forward slowed by something else on
        the machine (a prefill sample is taken once per long call, and is kept for ``window``
        of them) does not decide on its own."""
        return statistics.median(s / n for n, s in samples)

    def rates(self) -> Optional[tuple[float, float]]:
        """(copy seconds per text id, prefill seconds per id), each the median over the recent
        measurements, or None until each has ``min_samples``."""
        with self._lock:
            if len(self._copies) < self.min_samples or len(self._prefills) < self.min_samples:
                return None
            return self._rate(self._copies), self._rate(self._prefills)

    def pays(self) -> bool:
        """Whether a text copy is worth feeding: not measured yet, or it costs at most the
        prefill it spares, per id."""
        rates = self.rates()
        return rates is None or rates[0] <= rates[1]

    def clear(self) -> None:
        with self._lock:
            self._copies.clear()
            self._prefills.clear()
