"""KVCOMM anchor pools: observed context offsets of earlier shared segments, and the
similarity-weighted (or averaged) estimate of a new segment's offsets.

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
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from .segments import Kind, KVSegment

__all__ = ["AnchorPool", "AnchorRegistry", "GateVerdict", "OffsetEstimate", "entropy_score", "top_p_members"]

Estimator = Literal["mean", "weighted"]
Gate = Literal["entropy", "error"]


def _zeros_like_grown(t: Optional[torch.Tensor], slots: int, tokens: int, like: torch.Tensor) -> torch.Tensor:
    """``[slots, L, H, tokens, D]`` zeros holding ``t``'s data in its leading corner."""
    shape = (slots, *like.shape[:2], tokens, like.shape[3])
    out = torch.zeros(shape, dtype=like.dtype, device=like.device)
    if t is not None:
        out[: t.shape[0], :, :, : t.shape[3]] = t
    return out


@dataclass(eq=False)
class OffsetStack:
    """Offsets of one receiver (and, for prefixes, one template piece) for every anchor slot.

    Attributes:
        keys, values: ``[slots, L-1, kv_heads, tokens, head_dim]`` canonical-frame offsets.
        has: ``[slots]`` bool, which slots hold offsets.
    """

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    has: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor, slots: int, tokens: int) -> None:
        """Store ``[L-1, H, n, D]`` offsets of tokens ``start..start+n`` in ``slot`` (the stack
        grows to at least ``slots`` x ``tokens``, the pool's capacity)."""
        n = keys.shape[2]
        tokens = max(tokens, start + n)
        cap_slots, cap_tokens = (self.keys.shape[0], self.keys.shape[3]) if self.keys is not None else (0, 0)
        if slots > cap_slots or tokens > cap_tokens:
            self.keys = _zeros_like_grown(self.keys, max(slots, cap_slots), max(tokens, cap_tokens), keys)
            self.values = _zeros_like_grown(self.values, max(slots, cap_slots), max(tokens, cap_tokens), values)
        if self.has.numel() < slots:
            self.has = torch.cat([self.has, torch.zeros(slots - self.has.numel(), dtype=torch.bool)])
        if not self.has[slot]:
            self.keys[slot].zero_()
            self.values[slot].zero_()
        self.keys[slot, :, :, start : start + n] = keys.to(self.keys.dtype)
        self.values[slot, :, :, start : start + n] = values.to(self.values.dtype)
        self.has[slot] = True

    def clear_slot(self, slot: int) -> None:
        if slot < self.has.numel():
            self.has[slot] = False


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


@dataclass
class OffsetEstimate:
    """Estimated canonical-frame offsets, ``[L-1, kv_heads, tokens, head_dim]`` float32.

    ``prefix_keys``/``prefix_values`` are for the template piece after the segment (None when the
    anchors hold none for it)."""

    keys: torch.Tensor
    values: torch.Tensor
    prefix_keys: Optional[torch.Tensor] = None
    prefix_values: Optional[torch.Tensor] = None

    @staticmethod
    def per_layer(offsets: torch.Tensor, start: int, end: int) -> list[Optional[torch.Tensor]]:
        """Per layer (layer 0 None) ``[1, kv_heads, end - start, head_dim]`` views."""
        return [None] + [offsets[layer, None, :, start:end] for layer in range(offsets.shape[0])]


def take(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``t[slots]``, as a view (no copy) when the slots are ``0..N-1``, the usual case."""
    n = slots.numel()
    if n and int(slots[0]) == 0 and int(slots[-1]) == n - 1 and n <= t.shape[0]:
        return t[:n]
    return t[slots.to(t.device)]


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


def top_p_members(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """Indices of the smallest set of largest weights whose sum reaches ``top_p``."""
    order = torch.argsort(weights, descending=True)
    cumulative = torch.cumsum(weights[order], dim=0)
    count = int((cumulative < top_p).sum()) + 1
    return order[: min(count, weights.numel())]


class AnchorPool:
    """Anchors of one segment kind (at most ``max_anchors``).

    Args:
        kind: the segment kind.
        max_anchors: slot limit; when full, the least-activated of the ``eviction_window`` oldest
            anchors is replaced.
        eviction_window: how many of the oldest anchors compete for eviction.
    """

    def __init__(self, kind: Kind, max_anchors: int, eviction_window: int) -> None:
        self.kind = kind
        self.max_anchors = max_anchors
        self.eviction_window = eviction_window
        self.segment_ids: list[Optional[str]] = []
        self.lengths = torch.zeros(0, dtype=torch.long)
        self.activations = torch.zeros(0, dtype=torch.long)
        self.created: list[int] = []
        self.base_keys: Optional[torch.Tensor] = None  # [slots, L-1, H, tokens, D]
        self.base_values: Optional[torch.Tensor] = None
        self.placeholder: dict[str, OffsetStack] = {}
        self.prefix: dict[tuple[str, str], OffsetStack] = {}
        self._clock = 0

    # ---- membership -----------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(sid is not None for sid in self.segment_ids)

    def slot_of(self, segment_id: str) -> Optional[int]:
        try:
            return self.segment_ids.index(segment_id)
        except ValueError:
            return None

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.base_keys, self.base_values) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(
            s.nbytes for s in (*self.placeholder.values(), *self.prefix.values())
        )

    def add(self, segment: KVSegment) -> int:
        """Make ``segment`` an anchor (evicting one if the pool is full); returns its slot."""
        existing = self.slot_of(segment.id)
        if existing is not None:
            return existing
        slot = self._free_slot()
        keys = torch.stack([k[0] for k in segment.keys[1:]])  # [L-1, H, T, D]
        values = torch.stack([v[0] for v in segment.values[1:]])
        slots = len(self.segment_ids)
        tokens = keys.shape[2]
        cap_tokens = self.base_keys.shape[3] if self.base_keys is not None else 0
        cap_slots = self.base_keys.shape[0] if self.base_keys is not None else 0
        if slots > cap_slots or tokens > cap_tokens:
            new_slots = min(self.max_anchors, max(slots, 2 * cap_slots))
            new_tokens = max(tokens, 2 * cap_tokens) if tokens > cap_tokens else cap_tokens
            self.base_keys = _zeros_like_grown(self.base_keys, new_slots, new_tokens, keys)
            self.base_values = _zeros_like_grown(self.base_values, new_slots, new_tokens, values)
        self.base_keys[slot].zero_()
        self.base_values[slot].zero_()
        self.base_keys[slot, :, :, :tokens] = keys
        self.base_values[slot, :, :, :tokens] = values
        self.segment_ids[slot] = segment.id
        self.lengths[slot] = tokens
        self.activations[slot] = 0
        self._clock += 1
        self.created[slot] = self._clock
        for stack in (*self.placeholder.values(), *self.prefix.values()):
            stack.clear_slot(slot)
        return slot

    def _free_slot(self) -> int:
        if None in self.segment_ids:
            return self.segment_ids.index(None)
        if len(self.segment_ids) < self.max_anchors:
            self.segment_ids.append(None)
            self.created.append(0)
            self.lengths = torch.cat([self.lengths, torch.zeros(1, dtype=torch.long)])
            self.activations = torch.cat([self.activations, torch.zeros(1, dtype=torch.long)])
            return len(self.segment_ids) - 1
        return self.evict_one()

    def evict_one(self) -> int:
        """Empty the least-activated of the ``eviction_window`` oldest anchors; returns its slot."""
        occupied = [i for i, sid in enumerate(self.segment_ids) if sid is not None]
        oldest = sorted(occupied, key=lambda i: self.created[i])[: self.eviction_window]
        victim = min(oldest, key=lambda i: (int(self.activations[i]), self.created[i]))
        self.segment_ids[victim] = None
        self.lengths[victim] = 0
        for stack in (*self.placeholder.values(), *self.prefix.values()):
            stack.clear_slot(victim)
        return victim

    def record(self, slot: int, receiver: str, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Placeholder offsets ``[L-1, H, n, D]`` of segment tokens ``start..start+n``."""
        stack = self.placeholder.setdefault(receiver, OffsetStack())
        stack.write(slot, start, keys, values, *self._capacity)

    def record_prefix(self, slot: int, receiver: str, piece: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Offsets ``[L-1, H, P, D]`` of the receiver's template piece ``piece`` after the segment."""
        stack = self.prefix.setdefault((receiver, piece), OffsetStack())
        stack.write(slot, 0, keys, values, self._capacity[0], 0)

    @property
    def _capacity(self) -> tuple[int, int]:
        return self.base_keys.shape[0], self.base_keys.shape[3]

    # ---- matching -------------------------------------------------------------------------
    def candidates(self, receiver: str, length: int, exclude: Optional[int] = None) -> torch.Tensor:
        """``[N]`` slots of anchors at least ``length`` tokens long holding ``receiver``'s offsets."""
        stack = self.placeholder.get(receiver)
        if stack is None or not self.segment_ids:
            return torch.zeros(0, dtype=torch.long)
        has = torch.zeros(len(self.segment_ids), dtype=torch.bool)
        has[: stack.has.numel()] = stack.has[: len(self.segment_ids)]
        ok = has & (self.lengths >= length)
        if exclude is not None:
            ok[exclude] = False
        return ok.nonzero().flatten()

    def value_distances(self, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[N]`` L2 distances between ``values`` ``[L-1, H, T, D]`` and the anchors' first T tokens."""
        t = values.shape[2]
        diff = take(self.base_values, slots)[:, :, :, :t].float() - values.float().to(self.base_values.device)[None]
        return diff.flatten(1).norm(dim=1).cpu()

    def credit(self, slots: torch.Tensor, weights: torch.Tensor, top_p: float) -> None:
        """Raise the activation count of the anchors among the nearest (top-p of ``weights``)."""
        self.activations[slots[top_p_members(weights, top_p)]] += 1

    def estimate(
        self,
        receiver: str,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        estimator: Estimator,
        temperature: float,
        piece: Optional[str] = None,
    ) -> OffsetEstimate:
        """Offsets of a new segment with canonical base ``keys``/``values`` ``[L-1, H, T, D]``.

        ``"weighted"`` (the paper): per-token softmax weights over anchors (left-aligned) for the
        placeholder, per (layer, head, channel) weights over anchors (right-aligned) for the
        prefix piece. ``"mean"``: the plain average over the same anchors.
        """
        t = keys.shape[2]
        stack = self.placeholder[receiver]
        device = stack.keys.device
        k_off, v_off = take(stack.keys, slots)[:, :, :, :t].float(), take(stack.values, slots)[:, :, :, :t].float()
        query_k, query_v = keys.float().to(device), values.float().to(device)
        if estimator == "weighted":
            base_k = take(self.base_keys, slots)[:, :, :, :t].float()
            base_v = take(self.base_values, slots)[:, :, :, :t].float()
            w_k = torch.softmax(-(base_k - query_k[None]).abs().mean(dim=(1, 2, 4)) / temperature, dim=0)  # [N, T]
            w_v = torch.softmax(-(base_v - query_v[None]).abs().mean(dim=(1, 2, 4)) / temperature, dim=0)
            est_k = torch.einsum("nt,nlhtd->lhtd", w_k, k_off)
            est_v = torch.einsum("nt,nlhtd->lhtd", w_v, v_off)
        else:
            est_k, est_v = k_off.mean(dim=0), v_off.mean(dim=0)
        result = OffsetEstimate(est_k, est_v)
        pre = self.prefix.get((receiver, piece)) if piece is not None else None
        if pre is not None:
            has = torch.zeros(len(self.segment_ids), dtype=torch.bool)
            has[: pre.has.numel()] = pre.has[: len(self.segment_ids)]
            chosen = slots[has[slots]]
            if chosen.numel():
                pk, pv = take(pre.keys, chosen).float(), take(pre.values, chosen).float()
                if estimator == "weighted":
                    # right-aligned: each anchor's last T tokens, nearest the following piece
                    index = (self.lengths[chosen] - t)[:, None] + torch.arange(t)[None]  # [N, T]
                    gather = index.to(device)[:, None, None, :, None].expand(-1, *keys.shape[:2], -1, keys.shape[3])
                    near_k = take(self.base_keys, chosen).float().gather(3, gather)
                    near_v = take(self.base_values, chosen).float().gather(3, gather)
                    u_k = torch.softmax(-(near_k - query_k[None]).norm(dim=3) / temperature, dim=0)  # [N, L, H, D]
                    u_v = torch.softmax(-(near_v - query_v[None]).norm(dim=3) / temperature, dim=0)
                    result.prefix_keys = torch.einsum("nlhd,nlhpd->lhpd", u_k, pk)
                    result.prefix_values = torch.einsum("nlhd,nlhpd->lhpd", u_v, pv)
                else:
                    result.prefix_keys, result.prefix_values = pk.mean(dim=0), pv.mean(dim=0)
        return result


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
            values = torch.stack([v[0] for v in segment.values[1:]])
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
            keys = torch.stack([k[0] for k in segment.keys[1:]])
            values = torch.stack([v[0] for v in segment.values[1:]])
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
        base_k = torch.stack([k[0] for k in segment.keys[1:]])
        base_v = torch.stack([v[0] for v in segment.values[1:]])
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
            self._shrink(pool)

    @staticmethod
    def _shrink(pool: AnchorPool) -> None:
        """Drop emptied trailing slots' storage so eviction actually frees bytes."""
        while pool.segment_ids and pool.segment_ids[-1] is None:
            pool.segment_ids.pop()
            pool.created.pop()
        n = len(pool.segment_ids)
        pool.lengths, pool.activations = pool.lengths[:n].clone(), pool.activations[:n].clone()
        occupied = [i for i, sid in enumerate(pool.segment_ids) if sid is not None]
        if len(occupied) < n:  # compact: move the last occupied slots into holes
            order = occupied
            pool.segment_ids = [pool.segment_ids[i] for i in order]
            pool.created = [pool.created[i] for i in order]
            index = torch.tensor(order)
            pool.lengths, pool.activations = pool.lengths[index], pool.activations[index]
            n = len(order)
        else:
            index = torch.arange(n)
        pool.base_keys = pool.base_keys[index].clone() if n else None
        pool.base_values = pool.base_values[index].clone() if n else None
        for stack in (*pool.placeholder.values(), *pool.prefix.values()):
            if stack.keys is None:
                continue
            keep = index[index < stack.keys.shape[0]]
            stack.keys, stack.values = stack.keys[keep].clone(), stack.values[keep].clone()
            has = torch.zeros(n, dtype=torch.bool)
            has[: keep.numel()] = stack.has[keep]
            stack.has = has
