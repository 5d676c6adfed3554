"""KVCOMM anchors across an engine: the pools of every segment kind under one byte budget, the
shareability gate, and the recording of observed offsets (with the estimate-error measurement).
The pools themselves (storage, eviction, estimation) are in :mod:`.anchor_pool`.

An *anchor* is one earlier shared segment of a kind (the user question, agent X's reply, a tool
result): its base KV (canonical frame, layers 1..L-1) plus, for each receiving agent that computed
it with exact context, the observed offsets ``real - base`` of the segment itself ("placeholder")
and of the receiver's template piece that follows it ("prefix", keyed by the piece's ids).

Everything of a pool lives in stacked tensors ``[slots, L-1, kv_heads, tokens, head_dim]`` that
grow by doubling (slots up to ``max_anchors``, tokens up to the longest anchor), so matching is a
handful of vectorised reductions with no per-call gathers of anchor tensors. Keys are in the
canonical RoPE frame (token ``t`` at position ``t``): offsets apply wherever a segment lands.
Layer 0 is never offset (it is exact after re-rotation) and is not stored.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from .anchor_pool import AnchorPool, Estimator, OffsetEstimate, stacked_kv, top_p_members
from .segments import Kind, KVSegment

__all__ = ["AnchorPool", "AnchorRegistry", "GateVerdict", "OffsetEstimate", "entropy_score", "top_p_members"]

Gate = Literal["entropy", "error"]


@dataclass
class GateVerdict:
    """The shareability decision for one segment and receiver.

    Attributes:
        reuse: True to reuse the segment with estimated offsets.
        reason: why not (``"new_anchor"``) or None.
        anchors: length-compatible anchors holding this receiver's offsets (consulted).
        entropy: the paper's score ``H / log2 N`` (None with fewer than two anchors).
        error: the measured relative KV error of this receiver's estimate for the kind (None
            before the pool could measure one).
        score: the score the configured gate compared with its threshold.
        weights: ``[N]`` softmax over the consulted anchors' value distances.
        candidates: ``[N]`` their slots.
    """

    reuse: bool
    reason: Optional[str]
    anchors: int
    entropy: Optional[float] = None
    error: Optional[float] = None
    score: Optional[float] = None
    weights: Optional[torch.Tensor] = None
    candidates: Optional[torch.Tensor] = None


def entropy_score(distances: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The paper's gate score: ``p = softmax(-d)``, ``H = -sum p log2 p``, score ``H / log2 N``.

    Args:
        distances: ``[N]`` float32, ``N >= 2``.

    Returns:
        ``(score in [0, 1], p)``.
    """
    p = torch.softmax(-distances.double(), dim=0)
    entropy = float(-(p * torch.log2(p.clamp_min(1e-300))).sum())
    return entropy / math.log2(distances.numel()), p.float()


class AnchorRegistry:
    """Every anchor pool of one engine, under one byte budget, with the shareability gate.

    Args:
        max_anchors, eviction_window: per pool (see :class:`AnchorPool`).
        max_bytes: budget for all pools together; beyond it anchors are evicted (by the pool's
            rule) from the least recently used pool.
        estimator: ``"mean"`` or ``"weighted"`` (the paper's similarity weights).
        gate: ``"entropy"`` (the paper: reuse if ``H <= gamma * log2 N``) or ``"error"``
            (reuse if the estimate's measured relative KV error for this receiver and kind is at
            most ``max_error``).
        gamma, max_error: the gates' thresholds.
        min_anchors: fewer consulted anchors means "new anchor".
        temperature: softmax temperature of the weights.
        activation_top_p: anchors credited per reuse decision.
    """

    def __init__(
        self,
        *,
        max_anchors: int = 20,
        eviction_window: int = 5,
        max_bytes: int = 1 << 30,
        estimator: Estimator = "mean",
        gate: Gate = "entropy",
        gamma: float = 0.3,
        max_error: float = 0.5,
        min_anchors: int = 2,
        temperature: float = 1.0,
        activation_top_p: float = 0.9,
        error_window: int = 5,
    ) -> None:
        self.max_anchors, self.eviction_window, self.max_bytes = max_anchors, eviction_window, max_bytes
        self.estimator, self.gate, self.gamma, self.max_error = estimator, gate, gamma, max_error
        self.min_anchors, self.temperature, self.activation_top_p = min_anchors, temperature, activation_top_p
        self._pools: OrderedDict[Kind, AnchorPool] = OrderedDict()
        self._errors: dict[tuple[str, Kind], deque] = {}
        self._error_window = error_window
        self._lock = threading.RLock()
        self.frozen = False

    def pool(self, kind: Kind) -> Optional[AnchorPool]:
        return self._pools.get(tuple(kind))

    def anchors(self, kind: Kind) -> int:
        pool = self.pool(kind)
        return len(pool) if pool else 0

    def measured_error(self, receiver: str, kind: Kind) -> Optional[float]:
        """Mean relative KV error of the last estimates checked against dense for this pair."""
        errors = self._errors.get((receiver, tuple(kind)))
        return sum(errors) / len(errors) if errors else None

    def nbytes(self) -> int:
        with self._lock:
            return sum(pool.nbytes for pool in self._pools.values())

    def clear(self) -> None:
        with self._lock:
            self._pools.clear()
            self._errors.clear()

    # ---- the gate -------------------------------------------------------------------------
    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def judge(self, receiver: str, segment: KVSegment) -> GateVerdict:
        """Reuse ``segment`` for ``receiver`` with estimated offsets, or make it a new anchor."""
        with self._lock:
            pool = self.pool(segment.ref.kind)
            if pool is None:
                return GateVerdict(False, "new_anchor", 0)
            own = pool.slot_of(segment.id)
            if own is not None:
                stack = pool.placeholder.get(receiver)
                if stack is not None and own < stack.has.numel() and bool(stack.has[own]):
                    # the receiver recorded this very segment: its own offsets, weight 1
                    return GateVerdict(True, None, 1, weights=torch.ones(1), candidates=torch.tensor([own]), score=0.0)
            slots = pool.candidates(receiver, segment.num_tokens, exclude=own)
            verdict = GateVerdict(False, "new_anchor", int(slots.numel()), candidates=slots,
                                  error=self.measured_error(receiver, segment.ref.kind))
            if slots.numel() == 0:
                return verdict
            _, values = stacked_kv(segment)
            distances = pool.value_distances(values, slots)
            if slots.numel() >= 2:
                verdict.entropy, verdict.weights = entropy_score(distances)
            else:
                verdict.weights = torch.ones(1)
            if slots.numel() < self.min_anchors or slots.numel() < 2:
                return verdict
            if self.gate == "entropy":
                verdict.score = verdict.entropy
                verdict.reuse = verdict.entropy <= self.gamma
            else:
                verdict.score = verdict.error
                verdict.reuse = verdict.error is not None and verdict.error <= self.max_error
            if verdict.reuse:
                verdict.reason = None
                if not self.frozen:
                    pool.credit(slots, verdict.weights, self.activation_top_p)
            return verdict

    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def estimate(self, receiver: str, segment: KVSegment, verdict: GateVerdict, piece: Optional[str] = None) -> OffsetEstimate:
        """Offsets for a segment the gate let through (``verdict.reuse``)."""
        with self._lock:
            pool = self._pools[tuple(segment.ref.kind)]
            self._pools.move_to_end(tuple(segment.ref.kind))
            keys, values = stacked_kv(segment)
            return pool.estimate(receiver, keys, values, verdict.candidates, self.estimator, self.temperature, piece)

    # ---- recording ------------------------------------------------------------------------
    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def record(
        self,
        receiver: str,
        segment: KVSegment,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        new_anchor: bool = True,
    ) -> Optional[int]:
        """Observed offsets ``[L-1, H, n, D]`` of segment tokens ``start..start+n`` computed with
        exact context. With ``new_anchor`` the segment becomes an anchor of its pool if it is not
        one yet; otherwise the offsets only go to an existing anchor. Before storing, the estimate the pool would have made is checked against the
        observation (the ``error`` gate's measurement). Returns the anchor's slot or None."""
        if self.frozen:
            return None
        kind = tuple(segment.ref.kind)
        with self._lock:
            pool = self._pools.get(kind)
            if pool is None:
                if not new_anchor:
                    return None
                pool = self._pools[kind] = AnchorPool(kind, self.max_anchors, self.eviction_window)
            slot = pool.slot_of(segment.id)
            if slot is None:
                if not new_anchor:
                    return None
                slot = pool.add(segment)
            if start == 0 and keys.shape[2] == segment.num_tokens:
                self._measure_error(pool, receiver, segment, slot, keys, values)
            pool.record(slot, receiver, start, keys, values)
            self._pools.move_to_end(kind)
            self._enforce_budget()
            return slot if pool.slot_of(segment.id) == slot else None

    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def record_prefix(self, receiver: str, segment: KVSegment, piece: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Observed offsets ``[L-1, H, P, D]`` of ``receiver``'s template piece after ``segment``."""
        if self.frozen:
            return
        with self._lock:
            pool = self.pool(segment.ref.kind)
            slot = pool.slot_of(segment.id) if pool is not None else None
            if slot is None:
                return
            pool.record_prefix(slot, receiver, piece, keys, values)
            self._enforce_budget()

    def _measure_error(self, pool: AnchorPool, receiver: str, segment: KVSegment, slot: int, keys, values) -> None:
        slots = pool.candidates(receiver, segment.num_tokens, exclude=slot)
        if slots.numel() == 0:
            return
        base_k, base_v = stacked_kv(segment)
        est = pool.estimate(receiver, base_k, base_v, slots, self.estimator, self.temperature)
        real = torch.cat([keys.float().flatten(), values.float().flatten()]).to(est.keys.device)
        guess = torch.cat([est.keys.flatten(), est.values.flatten()])
        error = float((guess - real).norm() / real.norm().clamp_min(1e-12))
        self._errors.setdefault((receiver, pool.kind), deque(maxlen=self._error_window)).append(error)

    def _enforce_budget(self) -> None:
        while self._pools and self.nbytes() > self.max_bytes:
            kind, pool = next(iter(self._pools.items()))
            if len(pool) <= 1:
                del self._pools[kind]
                continue
            pool.evict_one()
            pool.compact()
