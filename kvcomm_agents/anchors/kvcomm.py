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

from ..errors import BudgetWarning
from ..kv.block import KVBlock
from ..kv.blocks import BlockCount
from ..kv.rope import RopeRotator
from ..kv.segments import CONTEXT_TOKENS, Kind, KVSegment
from ..plan import CallPlan, OwnTextPiece, ReusedRun
from .estimate import Estimator, OffsetEstimate, estimate_offsets
from .gate import GateVerdict, judge
from .persist import load_pools, save_pools
from .budget import fit_budget
from .pool import AnchorPool
from .tracker import OffsetTracker
from .versions import VersionHomes
from ..token_texts import TokenTexts
from .versions import best_recorded_version

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
        length_share: consult anchors at least this share of a segment's length (1: the paper;
            below 1 with the mean estimator only: covered tokens from the anchors' starts, the
            rest from their ends).
        recorded_versions: before the gate, reuse the version of a segment (its base, or a
            receiver's recorded offsets) computed after the same text as here (:mod:`.versions`).
        kl_budget: audited first-token KL above which a receiver's segments of a kind are
            prefilled rather than reused with estimated offsets (:mod:`.tracker`; None: none).
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
        length_share: float = 1.0,
        recorded_versions: bool = True,
        kl_budget: Optional[float] = None,
    ) -> None:
        self.recorded_versions, self.kl_budget = recorded_versions, kl_budget
        self.length_share = length_share if estimator == "mean" else 1.0
        self.max_anchors, self.eviction_window, self.max_bytes = max_anchors, eviction_window, max_bytes
        self.estimator, self.gamma, self.min_anchors = estimator, gamma, min_anchors
        self.temperature, self.activation_top_p = temperature, activation_top_p
        self._pools: OrderedDict[Kind, AnchorPool] = OrderedDict()
        self.homes = VersionHomes()  # where partial versions of short texts were recorded
        # the tokenizer's id texts: version contexts compared as text, the same text split into
        # other ids still matching (from_config's tokenizer; None compares ids)
        self.texts: Optional[TokenTexts] = None
        self._lock = threading.RLock()
        self._batch = threading.local()  # segments recorded inside this thread's recording() block
        self._freeze = freeze or BlockCount()
        self._warned = False
        self.tracker = OffsetTracker()
        self.spread = False  # estimates carry the anchors' disagreement (experimental.recompute_spread)

    @classmethod
    def from_config(cls, config, *, default_max_bytes: int, freeze: Optional[BlockCount] = None,
                    can_audit: bool = True, tokenizer=None) -> "KVCommAnchors":
        """The anchors a :class:`~kvcomm_agents.config.KVCommConfig` asks for;
        ``default_max_bytes`` applies when ``config.anchor_max_bytes`` is None; with
        ``tokenizer``, version contexts are compared as its text (:attr:`texts`). The KL budget is
        off without audits (``audit_every=0``): nothing would ever measure it. ``can_audit=False``
        (a runtime with no dense shadow pass, :mod:`kvcomm_agents.broker`): the budget holds and
        nothing probes, so estimated offsets are never used (set ``kl_budget=None`` to use
        them unmeasured)."""
        c, x = config, config.experimental
        anchors = cls(
            max_anchors=c.max_anchors, eviction_window=x.eviction_window,
            max_bytes=c.anchor_max_bytes if c.anchor_max_bytes is not None else default_max_bytes,
            estimator=x.estimator, gamma=c.gamma, min_anchors=x.min_anchors, temperature=x.anchor_temperature,
            activation_top_p=x.activation_top_p, freeze=freeze,
            length_share={"at_least": 1.0, "most": 0.75, "any": 0.0}[x.anchor_lengths],
            recorded_versions=x.recorded_versions,
            kl_budget=c.kl_budget if c.audit_every or not can_audit else None,
        )
        if not can_audit:
            anchors.tracker.probe_every = 0
        anchors.spread = x.recompute_spread > 0
        if tokenizer is not None and c.method == "kvcomm":
            anchors.texts = TokenTexts.of(tokenizer)
        return anchors

    # ---- inspection -----------------------------------------------------------------------
    def pool(self, kind: Kind) -> Optional[AnchorPool]:
        return self._pools.get(tuple(kind))

    def anchors(self, kind: Kind) -> int:
        """Anchors held for ``kind``."""
        pool = self.pool(kind)
        return len(pool) if pool else 0

    def nbytes(self) -> int:
        with self._lock:
            return sum(pool.nbytes for pool in self._pools.values())

    def clear(self) -> None:
        with self._lock:
            self._pools.clear()
            self.homes.clear()
            self.tracker.clear()

    @property
    def frozen(self) -> bool:
        """True inside a ``freeze_anchors`` block: nothing is added, evicted, credited or recorded."""
        return self._freeze.active

    # ---- warm start ---------------------------------------------------------------------------
    def save(self, path, header: dict) -> int:
        """Write every pool to ``path`` (:mod:`.persist`); returns the anchors written."""
        with self._lock:
            pools = list(self._pools.values())
            save_pools(pools, path, header)
            return sum(len(pool) for pool in pools)

    def load(self, path, *, fingerprint: str, shape: tuple[int, int, int], device, dtype) -> int:
        """Replace the pools with those in ``path`` (refused with ``AnchorFileError`` without any
        change when the file is unreadable or of another model); returns the anchors loaded."""
        pools, _ = load_pools(path, fingerprint=fingerprint, shape=shape, max_anchors=self.max_anchors,
                              eviction_window=self.eviction_window, device=device, dtype=dtype)
        with self._lock:
            self._pools = OrderedDict((pool.kind, pool) for pool in pools)
            self._enforce_budget()
            return sum(len(pool) for pool in self._pools.values())

    # ---- 1. decide --------------------------------------------------------------------------
    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def decide(self, receiver: str, segment: KVSegment, tokens: Optional[tuple[int, int]] = None,
               context: Sequence[int] = ()) -> GateVerdict:
        """Reuse ``segment`` for ``receiver`` with recorded or estimated offsets, or make it a
        new anchor. ``tokens``: the segment tokens ``(first, last)`` (exclusive) the prompt
        reuses; ``context``: the prompt's ids before token ``first``. A recorded version of the
        segment whose context matches better than the base's is reused first (:mod:`.versions`);
        otherwise the gate judges (:mod:`.gate`)."""
        with self._lock:
            pool = self.pool(segment.ref.kind)
            if tokens is not None:
                recorded = self.recorded(receiver, segment, tokens, context)
                if recorded is not None:
                    return recorded
            verdict = judge(pool, receiver, segment, gamma=self.gamma, min_anchors=self.min_anchors,
                            length_share=self.length_share)
            # the receiver's own offsets of this very segment, found by the gate but recorded
            # after other text than here (no version matched this context), are an estimate
            # like any other: the KL budget and the offset check apply to them too
            if verdict.reuse and not verdict.context_matched:
                if not self.tracker.within_budget(receiver, segment.ref.kind, self.kl_budget):
                    verdict.reuse, verdict.over_budget = False, True
                    return verdict
                verdict.offsets_on = (self.tracker.offsets_on(receiver, segment.ref.kind)
                                      and not self.tracker.unmeasured_probe(receiver, segment.ref.kind))
                if not self.frozen and not verdict.own_offsets:
                    pool.credit(verdict.candidates, verdict.weights, self.activation_top_p)
            return verdict

    @torch.inference_mode()
    def recorded(self, receiver: str, segment: KVSegment, tokens: Optional[tuple[int, int]],
                 context: Sequence[int]) -> Optional[GateVerdict]:
        """A reuse verdict with the version of ``segment`` (its base, or a receiver's recorded
        offsets) whose context fits ``context`` (the prompt's ids before segment token
        ``tokens[0]``) longest, or None when none fits (:mod:`.versions`; also None with
        ``recorded_versions`` off)."""
        if not self.recorded_versions or tokens is None:
            return None
        with self._lock:
            version = best_recorded_version(self.pool(segment.ref.kind), receiver, segment, tokens[0], tokens[1],
                                            context, self.texts.matched if self.texts else None)
        if version is None:
            return None
        if version.receiver is None:
            return GateVerdict(True, 0, score=0.0, base_fits=True, context_matched=True)
        return GateVerdict(True, 1, score=0.0, weights=torch.ones(1), candidates=torch.tensor([version.slot]),
                           own_offsets=version.receiver == receiver, source=version.receiver, context_matched=True)

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
            if run.verdict is None or (run.verdict.base_fits and not run.own_text):
                kept.append(run)
            elif not run.own_text:
                est = estimates.get((run.segment.id, id(run.verdict)))
                if est is None:
                    after = [p for p in pieces if p.after is run.segment and p.reused]
                    est = self._estimate(receiver, run.segment, run.verdict, after[0].key if after else None)
                    estimates[(run.segment.id, id(run.verdict))] = est
                window = slice(run.segment_start, run.segment_start + run.length)
                kept.append(replace(run, key_offsets=est.keys[:, :, window], value_offsets=est.values[:, :, window],
                                    offsets_on=run.verdict.offsets_on,
                                    spread=None if est.spread is None else est.spread[window]))
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
        with self._lock:
            kind = tuple(segment.ref.kind)
            pool = self._pools[kind]
            self._pools.move_to_end(kind)
            keys, values = segment.kv.upper_layers()
            return estimate_offsets(pool, receiver, keys, values, verdict.candidates, self.estimator,
                                    self.temperature, piece, source=verdict.source,
                                    spread=self.spread and not verdict.context_matched)

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
        first re-rotated token (anywhere with ``plan.observe_after_reuse``), ``real - base`` KV
        of layers ``1..L-1`` in the canonical frame.

        Args:
            receiver: the agent whose prompt this was.
            plan: the pass's plan (for an audit's dense pass: ``plan.as_observed()``).
            exact_kv: the pass's KV at given prompt positions.
            rotator: moves real keys into the canonical frame of the base.
            own_text: base KV of the plan's own-text pieces, by piece start.
        """
        exact_until = plan.num_prompt if plan.observe_after_reuse else plan.observable_until()
        if not self.frozen:
            for seen in plan.observations:
                if seen.length <= 0 or seen.prompt_start + seen.length > exact_until:
                    continue
                keys, values = offsets(exact_kv(seen.prompt_start, seen.length), seen.segment.kv,
                                       seen.prompt_start - seen.segment_start, seen.segment_start, rotator)
                context = tuple(plan.prompt_ids[max(0, seen.prompt_start - CONTEXT_TOKENS):seen.prompt_start].tolist())
                self._record(receiver, seen.segment, seen.segment_start, keys, values, context)
        for piece in plan.pieces:
            base = own_text.get(piece.start)
            if piece.reused or base is None or not piece.observed or piece.end > exact_until:
                continue
            keys, values = offsets(exact_kv(piece.start, piece.end - piece.start), base.kv, piece.start, 0, rotator)
            self._record_own_text(receiver, piece.after, piece.key, keys, values)

    @torch.inference_mode()
    def record_version(self, receiver: str, segment: KVSegment, real: KVBlock, prompt_start: int,
                       context: tuple[int, ...], rotator: RopeRotator, min_match: int = 0,
                       segment_start: int = 0) -> bool:
        """Record ``real`` (``n`` tokens of ``segment`` from token ``segment_start``, all of them
        by default; keys at prompt positions ``prompt_start..+n``, computed after the ids
        ``context``) as ``receiver``'s version of those tokens, reused only where a prompt shares
        at least ``min_match`` ids of that context (:mod:`kvcomm_agents.framing`). Returns whether
        it was recorded (not inside ``freeze_anchors``)."""
        if self.frozen:
            return False
        keys, values = offsets(real, segment.kv, prompt_start - segment_start, segment_start, rotator)
        self._record(receiver, segment, segment_start, keys, values, context, min_match)
        return True

    def version_span(self, receiver: str, segment: KVSegment) -> Optional[tuple[int, int]]:
        """The segment tokens ``(start, end)`` of ``receiver``'s recorded version of ``segment``
        ((0, 0) for offsets whose context is unknown), or None when it holds none."""
        with self._lock:
            pool = self._pools.get(tuple(segment.ref.kind))
            slot = pool.slot_of(segment.id) if pool is not None else None
            stack = pool.placeholder.get(receiver) if slot is not None else None
            if stack is None or slot >= stack.has.numel() or not bool(stack.has[slot]):
                return None
            context = stack.contexts.get(slot)
            return (0, 0) if context is None else (context.start, context.end)

    def forget_version(self, receiver: str, segment: KVSegment) -> None:
        """Drop ``receiver``'s recorded offsets of ``segment`` (the slot stays an anchor)."""
        with self._lock:
            pool = self._pools.get(tuple(segment.ref.kind))
            slot = pool.slot_of(segment.id) if pool is not None else None
            stack = pool.placeholder.get(receiver) if slot is not None else None
            if stack is not None:
                stack.clear_slot(slot)

    def _record(self, receiver: str, segment: KVSegment, start: int, keys: torch.Tensor, values: torch.Tensor,
                context: Optional[tuple[int, ...]] = None, min_match: int = 0) -> None:
        """Offsets ``[L-1, H, n, D]`` of segment tokens ``start..start+n``, observed after the ids
        ``context``; the segment becomes an anchor of its kind's pool if it is not one yet."""
        kind = tuple(segment.ref.kind)
        with self._lock:
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
        with self._lock:
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


