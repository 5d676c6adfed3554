"""Storage of one KVCOMM anchor pool: a segment kind's anchors, their offsets, their eviction.

Everything of a pool lives in stacked tensors ``[slots, L-1, kv_heads, tokens, head_dim]`` that
grow (slots by doubling up to ``max_anchors``, tokens by a quarter in steps of 64, up to the
longest anchor), so matching is a
handful of vectorised reductions with no per-call gathers of anchor tensors. What an anchor is:
:mod:`kvcomm_agents.anchors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Optional

import numpy as np
import torch

from ..kv.segments import Kind, KVSegment

__all__ = ["AnchorPool", "OffsetStack", "RecordedContext", "take", "top_p_members"]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of ``shape``. On a CPU from zeroed pages the OS hands out on first touch (numpy's
    ``calloc``): a pool's stacks are large (slots x layers x heads x tokens x head_dim) and
    mostly written later, and ``torch.zeros`` writes every byte now (measured on the vLLM
    connector's RAG hand-off: 28 stack growths took 8.2 s, 0.29 s each, on the request's path)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    raw = torch.from_numpy(np.zeros(count * torch.empty((), dtype=dtype).element_size(), dtype=np.uint8))
    return raw.view(dtype).view(shape)  # all-zero bytes are 0.0 in every float dtype


def _zeros_like_grown(t: Optional[torch.Tensor], slots: int, tokens: int, like: torch.Tensor) -> torch.Tensor:
    """``[slots, L, H, tokens, D]`` zeros holding ``t``'s data in its leading corner."""
    shape = (slots, *like.shape[:2], tokens, like.shape[3])
    out = _zeros(shape, like.dtype, like.device)
    if t is not None:
        out[: t.shape[0], :, :, : t.shape[3]] = t
    return out


@dataclass(eq=False)
class OffsetStack:
    """Offsets of one receiver (and, for own text, one piece) for every anchor slot.

    Attributes:
        keys, values: ``[slots, L-1, kv_heads, tokens, head_dim]`` canonical-frame offsets.
        has: ``[slots]`` bool, which slots hold offsets.
        contexts: per slot, the :class:`RecordedContext` its offsets were observed in (absent
            where unknown or mixed from several passes).
    """

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    has: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    contexts: dict[int, "RecordedContext"] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor, slots: int, tokens: int,
              context: Optional[tuple[int, ...]] = None, min_match: int = 0) -> None:
        """Store ``[L-1, H, n, D]`` offsets of tokens ``start..start+n`` in ``slot`` (the stack
        grows to at least ``slots`` x ``tokens``, the pool's capacity). ``context``: the ids
        before token ``start`` in the pass that observed them (None: unknown)."""
        n = keys.shape[2]
        fresh = slot >= self.has.numel() or not bool(self.has[slot])
        old = None if fresh else self.contexts.get(slot)
        if context is not None and (fresh or (old is not None and start <= old.start and start + n >= old.end)):
            self.contexts[slot] = RecordedContext(start, start + n, tuple(context), min_match)
        elif not fresh or context is None:
            self.contexts.pop(slot, None)  # offsets of several passes (or of an unknown one)
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
        self.contexts.pop(slot, None)


@dataclass(frozen=True)
class RecordedContext:
    """Where a slot's offsets were observed: segment tokens ``start..end`` and the last ids
    (at most ``CONTEXT_TOKENS``) before token ``start`` in that prompt. ``min_match``: ids of
    context a new prompt must share with ``ids`` for them to be reused as a version, beyond
    the usual minimum (a framed copy's: the minimum plus its lead-in, :mod:`kvcomm_agents.framing`)."""

    start: int
    end: int
    ids: tuple[int, ...]
    min_match: int = 0


def take(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``t[slots]``, as a view (no copy) when the slots are ``0..N-1``, the usual case."""
    n = slots.numel()
    if n and int(slots[0]) == 0 and int(slots[-1]) == n - 1 and n <= t.shape[0]:
        return t[:n]
    return t[slots.to(t.device)]


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
        self.own_text: dict[tuple[str, str], OffsetStack] = {}
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
            s.nbytes for s in (*self.placeholder.values(), *self.own_text.values())
        )

    def add(self, segment: KVSegment) -> int:
        """Make ``segment`` an anchor (evicting one if the pool is full); returns its slot."""
        existing = self.slot_of(segment.id)
        if existing is not None:
            return existing
        slot = self._free_slot()
        keys, values = segment.kv.upper_layers()  # [L-1, H, T, D]
        slots = len(self.segment_ids)
        tokens = keys.shape[2]
        cap_tokens = self.base_keys.shape[3] if self.base_keys is not None else 0
        cap_slots = self.base_keys.shape[0] if self.base_keys is not None else 0
        if slots > cap_slots or tokens > cap_tokens:
            new_slots = min(self.max_anchors, max(slots, 2 * cap_slots))
            # tokens grow by a quarter, in steps of 64: a pool holds its longest anchor's length
            # for every slot and every receiver, so doubling would waste up to half the budget
            new_tokens = -(-max(tokens, cap_tokens + cap_tokens // 4) // 64) * 64 if tokens > cap_tokens else cap_tokens
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
        for stack in (*self.placeholder.values(), *self.own_text.values()):
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

    def evict_one(self, keep_newest: bool = False, protect: Collection[str] = ()) -> Optional[int]:
        """Empty the least-activated of the ``eviction_window`` oldest anchors (``keep_newest``:
        never the newest; never a segment in ``protect``); returns its slot, or None where no
        anchor may go."""
        occupied = [i for i, sid in enumerate(self.segment_ids) if sid is not None]
        newest = max(occupied, key=lambda i: self.created[i]) if keep_newest and occupied else None
        occupied = [i for i in occupied if i != newest and self.segment_ids[i] not in protect]
        if not occupied:
            return None
        oldest = sorted(occupied, key=lambda i: self.created[i])[: self.eviction_window]
        victim = min(oldest, key=lambda i: (int(self.activations[i]), self.created[i]))
        self.segment_ids[victim] = None
        self.lengths[victim] = 0
        for stack in (*self.placeholder.values(), *self.own_text.values()):
            stack.clear_slot(victim)
        return victim

    def record(self, slot: int, receiver: str, start: int, keys: torch.Tensor, values: torch.Tensor,
               context: Optional[tuple[int, ...]] = None, min_match: int = 0) -> None:
        """Placeholder offsets ``[L-1, H, n, D]`` of segment tokens ``start..start+n``, observed
        after ``context`` (the ids before token ``start``; None: unknown); ``min_match``: see
        :class:`RecordedContext`."""
        stack = self.placeholder.setdefault(receiver, OffsetStack())
        stack.write(slot, start, keys, values, *self._capacity, context=context, min_match=min_match)

    def record_own_text(self, slot: int, receiver: str, piece: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Offsets ``[L-1, H, P, D]`` of the receiver's own-text piece ``piece`` after the segment."""
        stack = self.own_text.setdefault((receiver, piece), OffsetStack())
        stack.write(slot, 0, keys, values, self._capacity[0], 0)

    @property
    def capacity_slots(self) -> int:
        """Slots the pool's tensors hold (occupied or not)."""
        return self.base_keys.shape[0] if self.base_keys is not None else 0

    @property
    def _capacity(self) -> tuple[int, int]:
        return self.base_keys.shape[0], self.base_keys.shape[3]

    # ---- matching -------------------------------------------------------------------------
    def candidates(self, receiver: str, length: int, exclude: Optional[int] = None,
                   length_share: float = 1.0) -> torch.Tensor:
        """``[N]`` slots of anchors at least ``length_share x length`` tokens long (and at least
        one) holding ``receiver``'s offsets."""
        stack = self.placeholder.get(receiver)
        if stack is None or not self.segment_ids:
            return torch.zeros(0, dtype=torch.long)
        ok = self.held_by(stack) & (self.lengths >= max(1, math.ceil(length_share * length)))
        if exclude is not None:
            ok[exclude] = False
        return ok.nonzero().flatten()

    def held_by(self, stack: OffsetStack) -> torch.Tensor:
        """``[slots]`` bool: which of the pool's slots hold offsets in ``stack``."""
        has = torch.zeros(len(self.segment_ids), dtype=torch.bool)
        has[: stack.has.numel()] = stack.has[: len(self.segment_ids)]
        return has

    def value_distances(self, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[N]`` L2 distances between ``values`` ``[L-1, H, T, D]`` and the anchors' first T
        tokens; an anchor shorter than ``T`` is compared over its ``n`` tokens and its distance
        scaled by ``sqrt(T / n)`` (the same per-token scale)."""
        t = values.shape[2]
        base = take(self.base_values, slots)[:, :, :, :t].float()
        query = values.float().to(base.device)[None, :, :, : base.shape[3]]
        covered = torch.clamp(self.lengths[slots], max=t).clamp_min(1)
        mask = (torch.arange(base.shape[3])[None] < covered[:, None]).to(base.device)  # [N, t']
        diff = (base - query) * mask[:, None, None, :, None]
        return (diff.flatten(1).norm(dim=1).cpu() * torch.sqrt(t / covered.float()))

    def credit(self, slots: torch.Tensor, weights: torch.Tensor, top_p: float) -> None:
        """Raise the activation count of the anchors among the nearest (top-p of ``weights``)."""
        self.activations[slots[top_p_members(weights, top_p)]] += 1

    def compact(self) -> None:
        """Drop the storage of emptied slots (occupied ones keep their order), so that an
        eviction for the byte budget actually frees bytes."""
        keep = [i for i, sid in enumerate(self.segment_ids) if sid is not None]
        index = torch.tensor(keep, dtype=torch.long)
        self.segment_ids = [self.segment_ids[i] for i in keep]
        self.created = [self.created[i] for i in keep]
        self.lengths, self.activations = self.lengths[index], self.activations[index]
        n = len(keep)
        # indexing with a tensor copies already: no clone
        self.base_keys = self.base_keys[index] if n else None
        self.base_values = self.base_values[index] if n else None
        for stack in (*self.placeholder.values(), *self.own_text.values()):
            if stack.keys is None:
                continue
            kept = index[index < stack.keys.shape[0]]  # ascending: a prefix of the new slots
            has = torch.zeros(n, dtype=torch.bool)
            has[: kept.numel()] = stack.has[kept]
            stack.keys, stack.values, stack.has = stack.keys[kept], stack.values[kept], has
            moved = {old: new for new, old in enumerate(keep)}
            stack.contexts = {moved[old]: c for old, c in stack.contexts.items() if old in moved}
