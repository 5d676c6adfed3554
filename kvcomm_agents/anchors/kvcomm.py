"""``KVCommAnchors``: every anchor pool of one engine, and the three calls the engine makes.

1. :meth:`~KVCommAnchors.decide` (planning, per shared segment): reuse it with estimated offsets
   or prefill it as a new anchor (the gate, :mod:`.gate`).
2. :meth:`~KVCommAnchors.attach_offsets` (planning, once the runs are known): the estimated
   offsets of every reused run (:mod:`.estimate`), before the plan is frozen.
3. :meth:`~KVCommAnchors.observe` (after a pass with exact context, a call's prefill or an
   audit's dense pass): record ``real - base`` KV of the segments and own-text pieces it computed.

Pools are kept per segment kind under one byte budget (:mod:`.budget`).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import replace
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..errors import AnchorFileError, BudgetWarning
from ..kv.block import KVBlock
from ..kv.block_count import BlockCount
from ..kv.rope import RopeRotator
from ..kv.segments import CONTEXT_TOKENS, Kind, KVSegment, is_reply
from ..plan import CallPlan, OwnTextPiece, ReusedRun
from .estimate import Estimator, OffsetEstimate, estimate_offsets
from .gate import GateVerdict, judge
from .persist import load_pools, measured_alike, save_pools
from .budget import fit_budget
from .pool import AnchorPool
from .tracker import OffsetTracker

__all__ = ["KVCommAnchors", "ExactKV"]

#: ``(prompt_start, length) -> KVBlock`` of those prompt positions, computed with exact context,
#: keys at their true positions.
ExactKV = Callable[[int, int], KVBlock]


class KVCommAnchors:
    """Anchor pools of one engine under one byte budget.

    Args:
        max_anchors, eviction_window: per pool (see :class:`~.pool.AnchorPool`).
        max_bytes: budget for all pools together; beyond it anchors are evicted (by the pool's
            rule) from the least recently used pool.
        estimator: ``"mean"`` or ``"weighted"`` (:mod:`.estimate`).
        gamma: the entropy gate's threshold (paper: 0.3).
        min_anchors: fewer consulted anchors means "new anchor".
        temperature: softmax temperature of the weighted estimator.
        activation_top_p: anchors credited per reuse decision (eviction keeps the credited).
        freeze: the engine's freeze count (shared with its own-text store).
        kl_budget: audited first-token KL above which a receiver's segments of a kind are
            prefilled rather than reused with estimated offsets (:mod:`.tracker`; None: none).
        rerotate_replies: a reply the gate refuses may be served re-rotated alone, as other
            texts are, where re-rotation was measured within the budget (:meth:`decide`).
    """

    def __init__(
        self,
        *,
        max_anchors: int = 20,
        eviction_window: int = 5,
        max_bytes: int = 1 << 30,
        estimator: Estimator = "mean",
        gamma: float = 0.3,
        min_anchors: int = 2,
        temperature: float = 1.0,
        activation_top_p: float = 0.9,
        freeze: Optional[BlockCount] = None,
        kl_budget: Optional[float] = None,
        rerotate_replies: bool = False,
    ) -> None:
        self.kl_budget, self.rerotate_replies = kl_budget, rerotate_replies
        self.max_anchors, self.eviction_window, self.max_bytes = max_anchors, eviction_window, max_bytes
        self.estimator, self.gamma, self.min_anchors = estimator, gamma, min_anchors
        self.temperature, self.activation_top_p = temperature, activation_top_p
        self._pools: OrderedDict[Kind, AnchorPool] = OrderedDict()
        #: guards the pools (recorded versions, :class:`~kvcomm_agents.versions.Versions`, take it too)
        self.lock = threading.RLock()
        self._batch = threading.local()  # segments recorded inside this thread's recording() block
        self._freeze = freeze or BlockCount()
        self._warned = False
        self.tracker = OffsetTracker()

    @classmethod
    def from_config(cls, config, *, default_max_bytes: int, freeze: Optional[BlockCount] = None,
                    can_audit: bool = True) -> "KVCommAnchors":
        """The anchors a :class:`~kvcomm_agents.config.KVCommConfig` asks for;
        ``default_max_bytes`` applies when ``config.anchor_max_bytes`` is None. The KL budget is
        off without audits (``audit_every=0``): nothing would ever measure it. ``can_audit=False``
        (a runtime with no dense shadow pass, :mod:`kvcomm_agents.paged.broker`): the budget holds and
        nothing probes, so estimated offsets are never used (set ``kl_budget=None`` to use
        them unmeasured)."""
        c, x = config, config.experimental
        anchors = cls(
            max_anchors=c.max_anchors, eviction_window=x.eviction_window,
            max_bytes=c.anchor_max_bytes if c.anchor_max_bytes is not None else default_max_bytes,
            estimator=x.estimator, gamma=c.gamma, min_anchors=x.min_anchors, temperature=x.anchor_temperature,
            activation_top_p=x.activation_top_p, freeze=freeze,
            kl_budget=c.kl_budget if c.audit_every or not can_audit else None, rerotate_replies=x.rerotate_replies,
        )
        anchors.tracker.clear_margin = 0.25 if x.rerotation_trust == "clear_sample" else 1.0
        if not can_audit:
            anchors.tracker.probe_every = 0
        else:  # trusted before any sample only where the first calls so served can be audited
            anchors.tracker.trust_unmeasured = x.rerotation_trust == "audited"
        return anchors

    # ---- inspection -----------------------------------------------------------------------
    def pool(self, kind: Kind) -> Optional[AnchorPool]:
        return self._pools.get(tuple(kind))

    def anchors(self, kind: Kind) -> int:
        """Anchors held for ``kind``."""
        pool = self.pool(kind)
        return len(pool) if pool else 0

    def nbytes(self) -> int:
        with self.lock:
            return sum(pool.nbytes for pool in self._pools.values())

    def clear(self) -> None:
        with self.lock:
            self._pools.clear()
            self.tracker.clear()

    @property
    def frozen(self) -> bool:
        """True inside a ``freeze_anchors`` block: nothing is added, evicted, credited or recorded."""
        return self._freeze.active

    # ---- warm start ---------------------------------------------------------------------------
    def save(self, path, header: dict) -> int:
        """Write every pool to ``path`` (:mod:`.persist`), with what the tracker measured
        (:meth:`.tracker.OffsetTracker.measurements`, header ``"measurements"``); returns the
        anchors written."""
        with self.lock:
            pools = list(self._pools.values())
            save_pools(pools, path, {**header, "measurements": self.tracker.measurements()})
            return sum(len(pool) for pool in pools)

    def load(self, path, *, fingerprint: str, shape: tuple[int, int, int], device, dtype,
             settings: Optional[dict] = None) -> int:
        """Replace the pools with those in ``path`` (refused with ``AnchorFileError`` without any
        change when the file is unreadable or of another model); returns the anchors loaded.
        The file's measurements replace the tracker's where it was saved under ``settings`` (the
        engine's, as JSON) on :data:`.persist.MEASURED_WITH` (else, and in files without any,
        the tracker keeps its own)."""
        pools, meta = load_pools(path, fingerprint=fingerprint, shape=shape, max_anchors=self.max_anchors,
                                 eviction_window=self.eviction_window, device=device, dtype=dtype)
        measured = None
        if meta.get("measurements") is not None:
            try:
                measured = OffsetTracker.parse_measurements(meta["measurements"])
            except (ValueError, TypeError, AttributeError) as error:
                raise AnchorFileError(f"{path} holds malformed measurements ({error})") from error
        with self.lock:
            if measured is not None and measured_alike(meta, settings or {}):
                self.tracker.restore(measured)
            self._pools = OrderedDict((pool.kind, pool) for pool in pools)
            self._enforce_budget()
            return sum(len(pool) for pool in self._pools.values())

    # ---- 1. decide --------------------------------------------------------------------------
    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def decide(self, receiver: str, segment: KVSegment) -> GateVerdict:
        """Reuse ``segment`` for ``receiver`` with estimated offsets, or make it a new anchor: the
        gate judges (:mod:`.gate`), then the KL budget. Ask the recorded versions first
        (:meth:`kvcomm_agents.versions.Versions.recorded`): one computed after the same text as
        here is reused without the gate."""
        with self.lock:
            pool = self.pool(segment.ref.kind)
            verdict = judge(pool, receiver, segment, gamma=self.gamma, min_anchors=self.min_anchors)
            # the receiver's own offsets of this very segment, found by the gate but recorded
            # after other text than here (no version matched this context), are an estimate
            # like any other: the KL budget and the offset check apply to them too
            if verdict.reuse and not verdict.context_matched:
                if not self.tracker.within_budget(receiver, segment.ref.kind, self.kl_budget):
                    verdict.reuse, verdict.over_budget = False, True
                    return self._rerotated_instead(receiver, verdict, segment)
                verdict.offsets_on = (self.tracker.offsets_on(receiver, segment.ref.kind)
                                      and not self.tracker.unmeasured_probe(receiver, segment.ref.kind))
                if not self.frozen and not verdict.own_offsets:
                    pool.credit(verdict.candidates, verdict.weights, self.activation_top_p)
            return verdict if verdict.reuse else self._rerotated_instead(receiver, verdict, segment)

    def _rerotated_instead(self, receiver: str, verdict: GateVerdict, segment: KVSegment) -> GateVerdict:
        """A refused ``verdict`` turned into re-rotation alone where the receiver's re-rotation
        was measured within the KL budget (:meth:`.tracker.OffsetTracker.rerotation_within_budget`),
        never for a reply unless ``rerotate_replies``: a reply re-rotated alone deviates far more,
        and far less predictably, than the texts the samples measure (``ExperimentalSettings.rerotate_replies``)."""
        if (self.rerotate_replies or not is_reply(segment.ref.kind)) and \
                self.tracker.rerotation_within_budget(receiver, self.kl_budget):
            verdict.reuse, verdict.rerotated, verdict.offsets_on = True, True, False
        return verdict

    # ---- 2. attach offsets ----------------------------------------------------------------
    @torch.inference_mode()
    def attach_offsets(
        self, receiver: str, runs: Sequence[ReusedRun], pieces: Sequence[OwnTextPiece]
    ) -> tuple[list[ReusedRun], list[OwnTextPiece]]:
        """Runs with their estimated offsets (one estimate per segment), and the own-text pieces.

        A run the gate let through gets its segment's offsets (applied unless the tracker turned
        its kind off for this receiver: they stay on the run for an audit's flipped pass); an
        own-text run gets the own-text offsets of the segment before it, or is dropped (and its
        piece computed) when the anchors hold none. Runs without a verdict (the exact-prefix side, re-rotation only) stay as they are.
        """
        estimates: dict[tuple[str, int], OffsetEstimate] = {}  # per segment and verdict (context-dependent)
        reused_pieces = {piece.start: piece for piece in pieces if piece.reused}
        dropped: set[int] = set()
        kept = []
        for run in runs:
            if run.verdict is None or (run.verdict.base_fits and not run.own_text) or run.verdict.rerotated:
                kept.append(run)
            elif not run.own_text:
                est = estimates.get((run.segment.id, id(run.verdict)))
                if est is None:
                    after = [p for p in pieces if p.after is run.segment and p.reused]
                    est = self._estimate(receiver, run.segment, run.verdict, after[0].key if after else None)
                    estimates[(run.segment.id, id(run.verdict))] = est
                window = slice(run.segment_start, run.segment_start + run.length)
                kept.append(replace(run, key_offsets=est.keys[:, :, window], value_offsets=est.values[:, :, window],
                                    offsets_on=run.verdict.offsets_on))
            else:
                piece = reused_pieces[run.prompt_start]
                est = estimates.get((piece.after.id, id(run.verdict)))  # the segment run's verdict
                if est is None or est.own_text_keys is None:
                    dropped.add(piece.start)  # no own-text offsets for this piece yet: compute it
                    continue
                kept.append(replace(run, key_offsets=est.own_text_keys[:, :, : run.length],
                                    value_offsets=est.own_text_values[:, :, : run.length]))
        pieces = [replace(p, reused=False) if p.start in dropped else p for p in pieces]
        return kept, pieces

    def _estimate(self, receiver: str, segment: KVSegment, verdict: GateVerdict, piece: Optional[str]) -> OffsetEstimate:
        with self.lock:
            kind = tuple(segment.ref.kind)
            pool = self._pools[kind]
            self._pools.move_to_end(kind)
            keys, values = segment.kv.upper_layers()
            return estimate_offsets(pool, receiver, keys, values, verdict.candidates, self.estimator,
                                    self.temperature, piece, source=verdict.source)

    # ---- 3. observe -------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(
        self,
        receiver: str,
        plan: CallPlan,
        exact_kv: ExactKV,
        rotator: RopeRotator,
        own_text: Mapping[int, KVSegment] = {},
    ) -> None:
        """Record the offsets a pass observed: for each of ``plan.observations`` and each observed
        own-text piece (its base KV in ``own_text``, by piece start) lying wholly before the
        first re-rotated token, ``real - base`` KV
        of layers ``1..L-1`` in the canonical frame.

        Args:
            receiver: the agent whose prompt this was.
            plan: the pass's plan (for an audit's dense pass: ``plan.as_observed()``).
            exact_kv: the pass's KV at given prompt positions.
            rotator: moves real keys into the canonical frame of the base.
            own_text: base KV of the plan's own-text pieces, by piece start.
        """
        observed_until = plan.first_estimated()
        if not self.frozen:
            for seen in plan.observations:
                if seen.length <= 0 or seen.prompt_start + seen.length > observed_until:
                    continue
                keys, values = offsets(exact_kv(seen.prompt_start, seen.length), seen.segment.kv,
                                       seen.prompt_start - seen.segment_start, seen.segment_start, rotator)
                context = tuple(plan.prompt_ids[max(0, seen.prompt_start - CONTEXT_TOKENS):seen.prompt_start].tolist())
                self.record_offsets(receiver, seen.segment, seen.segment_start, keys, values, context)
        for piece in plan.pieces:
            base = own_text.get(piece.start)
            if piece.reused or base is None or not piece.observed or piece.end > observed_until:
                continue
            keys, values = offsets(exact_kv(piece.start, piece.end - piece.start), base.kv, piece.start, 0, rotator)
            self._record_own_text(receiver, piece.after, piece.key, keys, values)

    def record_offsets(self, receiver: str, segment: KVSegment, start: int, keys: torch.Tensor, values: torch.Tensor,
                context: Optional[tuple[int, ...]] = None, min_match: int = 0) -> None:
        """Record ``receiver``'s offsets ``[L-1, H, n, D]`` of segment tokens ``start..start+n``,
        observed after the ids ``context`` (reused as a version only where a prompt shares at
        least ``min_match`` of them); the segment becomes an anchor of its kind's pool if it is
        not one yet."""
        kind = tuple(segment.ref.kind)
        with self.lock:
            pool = self._pools.get(kind)
            if pool is None:
                pool = self._pools[kind] = AnchorPool(kind, self.max_anchors, self.eviction_window)
            slot = pool.slot_of(segment.id)
            if slot is None:
                slot = pool.add(segment)
            pool.record(slot, receiver, start, keys, values, context, min_match)
            self._pools.move_to_end(kind)
            batch = getattr(self._batch, "recorded", None)
            if batch is not None:
                batch.add((kind, segment.id))
            self._enforce_budget(protect={(kind, segment.id)} | (batch or set()))

    def _record_own_text(self, receiver: str, segment: KVSegment, piece: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Offsets ``[L-1, H, P, D]`` of ``receiver``'s own-text piece after ``segment`` (an anchor)."""
        if self.frozen:
            return
        with self.lock:
            pool = self.pool(segment.ref.kind)
            slot = pool.slot_of(segment.id) if pool is not None else None
            if slot is None:
                return
            pool.record_own_text(slot, receiver, piece, keys, values)
            self._enforce_budget()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """A block whose records protect each other from the budget's evictions (one call's
        versions: a reply's copies and its text copies), in this thread."""
        outer = getattr(self._batch, "recorded", None)
        self._batch.recorded = set() if outer is None else outer
        try:
            yield
        finally:
            self._batch.recorded = outer

    def _enforce_budget(self, protect: Optional[set[tuple[Kind, str]]] = None) -> None:
        """Evict until the pools fit ``max_bytes`` (:func:`.budget.fit_budget`; ``protect``: the
        segments just recorded); warns once where one anchor alone is over the budget."""
        forced = fit_budget(self._pools, self.max_bytes, protect or ())
        if forced is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"anchor_max_bytes ({self.max_bytes} bytes) cannot hold one anchor of kind {forced[0]} "
                f"({forced[1]} bytes): KVCOMM keeps prefilling what it cannot record; raise "
                "anchor_max_bytes", BudgetWarning, stacklevel=4,
            )


def offsets(real: KVBlock, base: KVBlock, shift: int, base_start: int, rotator: RopeRotator) -> tuple[torch.Tensor, torch.Tensor]:
    """``real - base`` of layers ``1..L-1``, ``[L-1, H, n, D]`` float32 each: ``real`` holds ``n``
    tokens at true positions, ``shift`` later than ``base``'s tokens ``base_start..+n`` in the
    canonical frame (keys are compared there)."""
    real_k, real_v = real.upper_layers()
    base_k, base_v = base.upper_layers()
    window = slice(base_start, base_start + real.num_tokens)
    key_offsets = rotator.shift(real_k, -shift).float() - base_k[:, :, window].float().to(real_k.device)
    value_offsets = real_v.float() - base_v[:, :, window].float().to(real_v.device)
    return key_offsets, value_offsets


