"""Whether KVCOMM's estimated offsets help, per receiver and segment kind, measured against dense.

An audit (``KVCommConfig.audit_every``) prefills a reused call densely and compares first-token
logits. On top of that, it flips the offsets of one segment kind (on where they were on, off
where they were off) in one more reuse prefill, so each audit yields a *paired* sample for one
``(receiver, kind)``: ``KL(dense || offsets on)`` and ``KL(dense || offsets off)`` (re-rotation
only for that kind), on the same prompt, with everything else equal.

A kind's offsets stay on for a receiver until its recent samples say they hurt: the mean of
``KL_on - KL_off`` over the last ``window`` samples is above zero with at least ``min_samples``
samples. Then that kind is served re-rotated without offsets (visible as ``offsets="off"`` in
the gate record), and later audits keep measuring both ways, so offsets come back if they start
helping. This is what keeps KVCOMM from drifting further from dense than re-rotation only on a
model or prompt format where offsets learned on one context do not transfer to another.

A fidelity budget on top (``KVCommConfig.kl_budget``): until the recent samples put the KL a
receiver is served with a kind's estimated offsets (offsets on or off, as the rule above serves
them) within the budget, that kind's segments are prefilled for that receiver instead (new
anchors, reason ``over_kl_budget``) except one decision in ``probe_every``, which is reused and
audited so that the measure is gathered and stays current. Until the kind has ``min_samples``
samples for that receiver a probe is served re-rotated only (offsets off; the audit's flipped
pass measures them on): a probe never drifts further than re-rotation only before anything was
measured. Versions of a segment computed after the same text
(:mod:`.versions`) are not estimates and are never held back.

Re-rotation alone is measured per receiver too (:meth:`OffsetTracker.record_rerotated`): the
first-token KL of a call served with every shared segment re-rotated only, against the same
call computed without estimates (a re-rotation check, :mod:`kvcomm_agents.rerotation_check`, or
an audit of a call served that way). Once every receiver's samples together (``min_samples``
at least, or fewer within ``clear_margin`` of the budget: the engine's default margin is the
whole budget, ``ExperimentalSettings.rerotation_trust``) and the receiver's own, where it has any, are within the
KL budget, a segment the gate would compute (new anchor, over the budget) is served re-rotated
instead (gate record ``offsets="rerotated"``) and its readers get no text copies
(:mod:`kvcomm_agents.framing.texts`): measured faithful enough, and on one device the copies
cost about what they save. Audits keep measuring those calls.

Pure bookkeeping over floats: no tensors, no model.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from ..kv.segments import Kind
from ..recent import MAX_AGENT_KINDS, MAX_AGENTS, RecentDict

__all__ = ["OffsetTracker", "PairedSample", "KindRecord", "Measurements"]


@dataclass(frozen=True)
class PairedSample:
    """One audit of one ``(receiver, kind)``: first-token KL against dense, in nats, of the same
    call with this kind's offsets on and off (every other run as served)."""

    kl_on: float
    kl_off: float


@dataclass(frozen=True)
class Measurements:
    """Samples read back from an anchor file (:meth:`OffsetTracker.parse_measurements`): paired
    audit samples per ``(receiver, kind)`` and re-rotation KLs per receiver, oldest first."""

    paired: dict
    rerotated: dict


@dataclass(frozen=True)
class KindRecord:
    """What the tracker knows about one ``(receiver, kind)`` (``OffsetTracker.records``)."""

    receiver: str
    kind: Kind
    samples: int
    mean_kl_on: float
    mean_kl_off: float
    offsets_on: bool


class OffsetTracker:
    """Paired audit samples per ``(receiver, kind)`` and the on/off rule built on them.

    Args:
        window: samples kept per ``(receiver, kind)`` (the most recent).
        min_samples: samples needed before offsets may be turned off; also the audits a kind
            gets early (``wants_audit``) before audits fall back to their period.
        clear_margin: fewer than ``min_samples`` re-rotation samples are enough for
            :meth:`rerotation_within_budget` where every one is at most this share of the budget
            (1: one sample within the budget, ``rerotation_trust="one_sample"``; 0.25:
            ``"clear_sample"``).
        trust_unmeasured: :meth:`rerotation_within_budget` holds before any receiver has a
            sample (the first call served re-rotated is then audited: :meth:`rerotation_unconfirmed`).
        warmup_gap: those early audits come at most once every ``warmup_gap`` reused calls of
            a receiver (the first on its ``warmup_gap``-th).
    """

    def __init__(self, window: int = 8, min_samples: int = 2, warmup_gap: int = 4, probe_every: int = 4,
                 clear_margin: float = 1.0, trust_unmeasured: bool = False) -> None:
        if window < 1 or min_samples < 1 or warmup_gap < 1 or probe_every < 0 or not 0 <= clear_margin <= 1:
            raise ValueError("window, min_samples and warmup_gap must be >= 1, probe_every >= 0, "
                             "clear_margin in [0, 1]")
        self.window, self.min_samples, self.warmup_gap = window, min_samples, warmup_gap
        self.clear_margin, self.trust_unmeasured = clear_margin, trust_unmeasured
        self.probe_every = probe_every
        # bounded: a server whose agents are named per user meets receivers and kinds without end
        self._held_back: RecentDict = RecentDict(MAX_AGENT_KINDS)  # (receiver, kind) -> decisions held back
        self._samples: RecentDict = RecentDict(MAX_AGENT_KINDS)  # (receiver, kind) -> deque[PairedSample]
        self._since_audit: RecentDict = RecentDict(MAX_AGENTS)  # receiver -> reused calls since its audit
        self._rerotated: RecentDict = RecentDict(MAX_AGENTS)  # receiver -> deque of re-rotation KLs
        self._remembered: deque[float] = deque(maxlen=window)
        self.rerotation_recorded = 0  # samples recorded by this tracker: a remembered file is behind when it grows
        self._lock = threading.Lock()

    def warmup_audit_due(self, receiver: str, kinds: Iterable[Kind]) -> bool:
        """Count one reused call of ``receiver`` carrying estimated offsets of ``kinds``; True
        when one of them still wants samples (:meth:`wants_audit`) and ``warmup_gap`` such calls
        have passed since this receiver's last audit, which bounds what the warm-up audits cost
        (one call in ``warmup_gap``), and always for a probe of a kind the KL budget holds back
        (:meth:`within_budget`). Call :meth:`audited` when any audit of it runs."""
        kinds = list(kinds)
        with self._lock:
            count = self._since_audit[receiver] = self._since_audit.get(receiver, 0) + 1
            probe = any(self._held_back.get((receiver, tuple(k)), 0) for k in kinds)
        # a kind held back by the KL budget reaches a call only as a probe: always audited
        return probe or (count >= self.warmup_gap and self.wants_audit(receiver, kinds))

    def audited(self, receiver: str) -> None:
        """An audit of ``receiver`` ran: its warm-up gap starts again."""
        with self._lock:
            self._since_audit[receiver] = 0

    def offsets_on(self, receiver: str, kind: Kind) -> bool:
        """Whether ``receiver`` gets estimated offsets for segments of ``kind``."""
        with self._lock:
            samples = self._samples.get((receiver, tuple(kind)))
            if not samples or len(samples) < self.min_samples:
                return True
            return sum(s.kl_on - s.kl_off for s in samples) <= 0.0

    def served_kl(self, receiver: str, kind: Kind) -> Optional[float]:
        """Mean first-token KL of ``receiver``'s audited calls with ``kind``'s estimated offsets
        as served (on or off, :meth:`offsets_on`); None with fewer than ``min_samples``."""
        on = self.offsets_on(receiver, kind)
        with self._lock:
            samples = list(self._samples.get((receiver, tuple(kind)), ()))
        if len(samples) < self.min_samples:
            return None
        return sum(s.kl_on if on else s.kl_off for s in samples) / len(samples)

    def within_budget(self, receiver: str, kind: Kind, budget: Optional[float]) -> bool:
        """Whether ``receiver`` may reuse ``kind``'s segments with estimated offsets under the
        KL ``budget`` (None: no budget): only once at least ``min_samples`` audits measured it
        within the budget (faithful until measured). Otherwise every ``probe_every``-th call
        still may (a probe, audited: :meth:`wants_audit`), which is how samples are gathered
        and follow the anchors; ``probe_every=0`` (a runtime that cannot audit): never."""
        if budget is None:
            return True
        served = self.served_kl(receiver, kind)
        key = (receiver, tuple(kind))
        if served is not None and served <= budget:
            with self._lock:
                self._held_back.pop(key, None)
            return True
        with self._lock:
            count = self._held_back[key] = self._held_back.get(key, 0) + 1
        return bool(self.probe_every) and count % self.probe_every == 0

    def unmeasured_probe(self, receiver: str, kind: Kind) -> bool:
        """Whether a decision :meth:`within_budget` just let through is a probe of a kind with
        fewer than ``min_samples`` samples for ``receiver``: such a probe is served re-rotated
        only (offsets off), the one drift the default must never exceed, while the audit's
        flipped pass still measures the offsets (faithful until measured)."""
        with self._lock:
            key = (receiver, tuple(kind))
            return bool(self._held_back.get(key)) and len(self._samples.get(key, ())) < self.min_samples

    def wants_audit(self, receiver: str, kinds: Iterable[Kind]) -> bool:
        """True while one of ``kinds`` has fewer than ``min_samples`` samples for ``receiver``,
        or is held back by the KL budget (a probe's call)."""
        with self._lock:
            return any(len(self._samples.get((receiver, tuple(k)), ())) < self.min_samples
                       or self._held_back.get((receiver, tuple(k)), 0) for k in kinds)

    def kind_to_flip(self, receiver: str, kinds: Iterable[Kind]) -> Optional[Kind]:
        """The kind among ``kinds`` with the fewest samples for ``receiver`` (first one on ties),
        or None when ``kinds`` is empty."""
        with self._lock:
            ordered = list(dict.fromkeys(tuple(k) for k in kinds))
            if not ordered:
                return None
            return min(ordered, key=lambda k: len(self._samples.get((receiver, k), ())))

    def record(self, receiver: str, kind: Kind, kl_on: float, kl_off: float) -> None:
        """Add one paired sample (the oldest beyond ``window`` is dropped)."""
        with self._lock:
            key = (receiver, tuple(kind))
            samples = self._samples.touch(key, lambda: deque(maxlen=self.window))
            samples.append(PairedSample(float(kl_on), float(kl_off)))

    def record_rerotated(self, receiver: str, kl: float) -> None:
        """Add the first-token KL of one of ``receiver``'s calls with its shared text re-rotated
        only (the oldest beyond ``window`` is dropped); it takes the place of the oldest
        remembered sample, if any (this engine's measures supersede earlier engines')."""
        with self._lock:
            self._rerotated.touch(receiver, lambda: deque(maxlen=self.window)).append(float(kl))
            if self._remembered:
                self._remembered.popleft()
            self.rerotation_recorded += 1

    def remember(self, samples: Iterable[float]) -> None:
        """Replace the re-rotation samples remembered from earlier engines on this model
        (:mod:`.remembered`; the last ``window`` kept): pooled with every receiver's samples in
        :meth:`rerotation_within_budget`, never a receiver's own, each giving way to one sample
        this engine records."""
        with self._lock:
            self._remembered = deque((float(kl) for kl in samples), maxlen=self.window)

    def pooled_rerotation_samples(self) -> list[float]:
        """The remembered samples, then every receiver's (KL in nats): what the pooled trust
        averages, and what an engine remembers for the next (:mod:`.remembered`)."""
        with self._lock:
            return list(self._remembered) + [kl for samples in self._rerotated.values() for kl in samples]

    def rerotation_samples(self, receiver: str) -> list[float]:
        """``receiver``'s re-rotation samples (KL in nats), oldest first."""
        with self._lock:
            return list(self._rerotated.get(receiver, ()))

    def wants_rerotation_sample(self, receiver: str) -> bool:
        """True while ``receiver`` has fewer than ``min_samples`` re-rotation samples."""
        with self._lock:
            return len(self._rerotated.get(receiver, ())) < self.min_samples

    def rerotation_within_budget(self, receiver: str, budget: Optional[float]) -> bool:
        """Whether re-rotation alone was measured within ``budget`` for ``receiver`` (never
        without a budget: then the gate alone decides): every receiver's samples together (at
        least ``min_samples``, or fewer where each is within ``clear_margin`` of the budget)
        average within it, and so do ``receiver``'s own, where it has any.

        Pooled because re-rotation's error comes mostly from the model and the text, not from
        who reads it (the readers of one document measure alike: 5e-5 to 1e-4 on the
        prefill-heavy workload); a receiver's own samples (from audits, or calls it computed
        before the pool was trusted) keep one that reads differently from riding on the others.
        An agent new to the graph is then served re-rotated from its first call: requiring a
        sample of its own first cost a dense prefill plus a masked one per new agent, and on the
        development range that left the shared-history, RAG and fan-out graphs (f), (c), (i) at
        0.94-1.07x dense where re-rotation only ran at 1.00-1.34x (with it: 1.00-1.35x, at
        re-rotation only's tokens and KL). One sample far under the budget is enough: on a
        graph's first request the second reader would otherwise compute the shared text again
        only to confirm a measure a quarter of the budget or less (with the 16-token head,
        re-rotation measured 0.0000-0.0051 per workload at 16-token replies, 0.0084-0.0326 at
        32). With ``clear_margin=1`` (the engine's default) one sample within the budget does:
        a graph whose first sample lands between a quarter of the budget and the budget, as the
        held-out prompt formats' do, is served re-rotated from its second reader, and later
        audits keep measuring."""
        if budget is None:
            return False
        with self._lock:
            own = list(self._rerotated.get(receiver, ()))
        pooled = self.pooled_rerotation_samples()
        if not pooled:
            return self.trust_unmeasured
        enough = len(pooled) >= self.min_samples or max(pooled) <= self.clear_margin * budget
        return bool((not own or sum(own) / len(own) <= budget) and enough and sum(pooled) / len(pooled) <= budget)

    def rerotation_unconfirmed(self) -> bool:
        """True while every receiver's re-rotation samples together are fewer than
        ``min_samples`` (remembered ones do not count: under ``rerotation_trust="audited"`` a
        restarted engine still audits its first calls served re-rotated)."""
        with self._lock:
            return sum(len(samples) for samples in self._rerotated.values()) < self.min_samples

    def records(self) -> list[KindRecord]:
        """One :class:`KindRecord` per ``(receiver, kind)`` sampled so far."""
        with self._lock:
            items = [(key, list(samples)) for key, samples in self._samples.items()]
        out = []
        for (receiver, kind), samples in items:
            n = len(samples)
            out.append(KindRecord(receiver, kind, n, sum(s.kl_on for s in samples) / n,
                                  sum(s.kl_off for s in samples) / n, self.offsets_on(receiver, kind)))
        return out

    # ---- warm start -----------------------------------------------------------------------
    def measurements(self) -> dict:
        """Every sample as plain JSON data, for an anchor file (:meth:`restore`):
        ``{"paired": [[receiver, kind, [[kl_on, kl_off], ...]], ...], "rerotated": {receiver:
        [kl, ...]}}``, oldest first. What was measured travels with the anchors it measured: an
        engine started from the file knows at its first call what re-rotation and the estimates
        cost on this model, and needs no new sample before trusting them."""
        finite = math.isfinite  # a NaN sample (NaN logits) would make the whole file unloadable
        with self._lock:
            paired = [[receiver, list(kind), [[s.kl_on, s.kl_off] for s in samples
                                              if finite(s.kl_on) and finite(s.kl_off)]]
                      for (receiver, kind), samples in self._samples.items()]
            rerotated = {receiver: [kl for kl in samples if finite(kl)] for receiver, samples in self._rerotated.items()}
        return {"paired": [entry for entry in paired if entry[2]],
                "rerotated": {receiver: kls for receiver, kls in rerotated.items() if kls}}

    @staticmethod
    def parse_measurements(data: dict) -> "Measurements":
        """``data`` of :meth:`measurements` as samples, for :meth:`restore`. Raises ValueError,
        TypeError or AttributeError where it is malformed (a negative or infinite KL included)."""
        def kl(value) -> float:
            value = float(value)
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"a KL sample of {value}")
            return value

        def kind_of(value) -> Kind:
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"a kind of {value!r}")
            name, detail = value  # a kind is (name, detail or None)
            return str(name), None if detail is None else str(detail)

        def nonempty(samples: list) -> list:
            if not samples:
                raise ValueError("an empty list of samples")
            return samples

        paired = {(str(receiver), kind_of(kind)): nonempty([PairedSample(kl(on), kl(off)) for on, off in samples])
                  for receiver, kind, samples in data.get("paired", ())}
        rerotated = {str(receiver): nonempty([kl(x) for x in samples])
                     for receiver, samples in data.get("rerotated", {}).items()}
        return Measurements(paired, rerotated)

    def restore(self, measured: "Measurements") -> None:
        """Replace every sample with ``measured`` (:meth:`parse_measurements`; the last
        ``window`` of each kept; the remembered ones go: an anchor file's measurements are
        likely the same an earlier engine remembered); the audit counters start again."""
        with self._lock:
            self._samples = RecentDict(MAX_AGENT_KINDS, ((key, deque(samples, maxlen=self.window))
                                                         for key, samples in measured.paired.items()))
            self._rerotated = RecentDict(MAX_AGENTS, ((receiver, deque(samples, maxlen=self.window))
                                                      for receiver, samples in measured.rerotated.items()))
            self._held_back.clear()
            self._since_audit.clear()
            self._remembered.clear()

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self._since_audit.clear()
            self._held_back.clear()
            self._rerotated.clear()
            self._remembered.clear()
