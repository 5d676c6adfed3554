"""Storage of one KVCOMM anchor pool: a segment kind's anchors, their offsets, their eviction.

Each anchor slot holds its own tensors, sized to what was observed: the anchor's base KV
``[L-1, kv_heads, length, head_dim]``, and per receiver (an :class:`OffsetStack`) the offsets of
the tokens it observed, ``[L-1, kv_heads, end, head_dim]`` (zeros before the first one). Memory
is what the anchors hold, not slots x the longest anchor x receivers: the dense stacks this
replaced (``[slots, L-1, H, longest, D]`` per receiver, grown and compacted by copying) spent
4.4 s of 5.6 s of the vLLM connector's anchor bookkeeping on growth and compaction copies on
the RAG hand-off, and held each receiver's offsets at the longest document's length. Matching
reads the consulted slots' tensors (:meth:`OffsetStack.dense`, :meth:`AnchorPool.base_dense`).
What an anchor is: :mod:`kvcomm_agents.anchors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Optional

import torch

from ..kv.segments import Kind, KVSegment

__all__ = ["AnchorPool", "OffsetStack", "RecordedContext", "top_p_members"]


def _padded(parts: list[Optional[tuple[int, torch.Tensor, torch.Tensor]]],
            width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, L-1, H, width, D]`` float32 keys and values from per-slot ``(first, keys, values)``,
    each ``[L-1, H, n, D]`` holding tokens ``first..first+n`` (zeros elsewhere, and for a
    missing part). Raises ValueError when every part is missing."""
    held = [part for part in parts if part is not None]
    if not held:
        raise ValueError("none of these slots holds tensors")
    like = held[0][1]
    shape = (len(parts), like.shape[0], like.shape[1], width, like.shape[3])
    keys = torch.zeros(shape, dtype=torch.float32, device=like.device)
    values = torch.zeros(shape, dtype=torch.float32, device=like.device)
    for i, part in enumerate(parts):
        if part is not None:
            first, k, v = part
            n = min(k.shape[2], width - first)
            if n > 0:
                keys[i, :, :, first:first + n] = k[:, :, :n]
                values[i, :, :, first:first + n] = v[:, :, :n]
    return keys, values


@dataclass(eq=False)
class OffsetStack:
    """Offsets of one receiver (and, for own text, one piece) for the anchor slots it observed.

    Attributes:
        parts: per slot, canonical-frame offsets ``(keys, values)``, each ``[L-1, kv_heads, n,
            head_dim]`` float32: anchor tokens ``starts[slot]..starts[slot] + n`` (zeros where a
            gap between passes was not observed).
        has: ``[slots]`` bool, which slots hold offsets.
        contexts: per slot, the :class:`RecordedContext` its offsets were observed in (absent
            where unknown or mixed from several passes).
    """

    parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    has: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    contexts: dict[int, "RecordedContext"] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)  # per slot: the anchor token parts[slot] starts at

    _nbytes: Optional[int] = field(default=None, init=False, repr=False)  # cached; every change of parts drops it

    @property
    def nbytes(self) -> int:
        """Bytes of the parts (read at every budget check of every pool: cached)."""
        if self._nbytes is None:
            self._nbytes = sum(t.numel() * t.element_size() for part in self.parts.values() for t in part)
        return self._nbytes

    def slot(self, slot: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The slot's ``(keys, values)`` ``[L-1, H, end, D]`` from anchor token 0 (zeros before
        the first observed token), or None where it holds none."""
        if not self.holds(slot) or slot not in self.parts:
            return None
        first = self.starts.get(slot, 0)
        if not first:
            return self.parts[slot]
        keys, values = self.dense(torch.tensor([slot]), first + self.parts[slot][0].shape[2])
        return keys[0], values[0]

    def holds(self, slot: int) -> bool:
        return slot < self.has.numel() and bool(self.has[slot])

    def end(self, slot: int) -> int:
        """The anchor token after the slot's last observed one (0 where it holds none)."""
        part = self.parts.get(slot)
        return self.starts.get(slot, 0) + part[0].shape[2] if part is not None else 0

    def width(self, slots: torch.Tensor) -> int:
        """The longest ``end`` among ``slots`` (``[n]`` int64 anchor slots)."""
        return max((self.end(int(s)) for s in slots), default=0)

    def dense(self, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, L-1, H, width, D]`` float32 offsets of ``slots`` (zeros where not observed)."""
        return _padded([(self.starts.get(int(s), 0), *self.parts[int(s)])
                        if self.holds(int(s)) and int(s) in self.parts else None for s in slots], width)

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor, slots: int,
              context: Optional[tuple[int, ...]] = None, min_match: int = 0) -> None:
        """Store ``[L-1, H, n, D]`` offsets of tokens ``start..start+n`` in ``slot`` (of a pool
        of ``slots`` slots). ``context``: the ids before token ``start`` in the pass that
        observed them (None: unknown). The slot holds the tokens from its first observed one to
        its last (zeros between passes that left a gap)."""
        n = keys.shape[2]
        fresh = not self.holds(slot)
        old = None if fresh else self.contexts.get(slot)
        if context is not None and (fresh or (old is not None and start <= old.start and start + n >= old.end)):
            self.contexts[slot] = RecordedContext(start, start + n, tuple(context), min_match)
        elif not fresh or context is None:
            self.contexts.pop(slot, None)  # offsets of several passes (or of an unknown one)
        if self.has.numel() < slots:
            self.has = torch.cat([self.has, torch.zeros(slots - self.has.numel(), dtype=torch.bool)])
        held = None if fresh else self.parts.get(slot)
        held_first = self.starts.get(slot, 0) if held is not None else start
        first = min(start, held_first)
        end = max(start + n, self.end(slot) if held is not None else 0)
        if held is not None and first == held_first and held[0].shape[2] >= end - first:
            part = held
        else:
            shape = (*keys.shape[:2], end - first, keys.shape[3])
            part = (torch.zeros(shape, dtype=torch.float32, device=keys.device),
                    torch.zeros(shape, dtype=torch.float32, device=keys.device))
            if held is not None:
                at = held_first - first
                part[0][:, :, at:at + held[0].shape[2]] = held[0]
                part[1][:, :, at:at + held[1].shape[2]] = held[1]
        part[0][:, :, start - first:start - first + n] = keys.to(torch.float32)
        part[1][:, :, start - first:start - first + n] = values.to(torch.float32)
        self.parts[slot] = part
        self._nbytes = None
        self.starts[slot] = first
        self.has[slot] = True

    def clear_slot(self, slot: int) -> None:
        if slot < self.has.numel():
            self.has[slot] = False
        self.parts.pop(slot, None)
        self._nbytes = None
        self.starts.pop(slot, None)
        self.contexts.pop(slot, None)

    def renumber(self, moved: dict[int, int], slots: int) -> None:
        """Slots renumbered ``old -> new`` (the others dropped); the pool now has ``slots``."""
        has = torch.zeros(slots, dtype=torch.bool)
        for old, new in moved.items():
            if self.holds(old):
                has[new] = True
        kept = [old for old in self.parts if old in moved and self.holds(old)]
        self.parts = {moved[old]: self.parts[old] for old in kept}
        self._nbytes = None
        self.starts = {moved[old]: self.starts.get(old, 0) for old in kept}
        self.contexts = {moved[old]: c for old, c in self.contexts.items() if old in moved}
        self.has = has


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


def top_p_members(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """``[m]`` int64 indices of the smallest set of largest ``weights`` (``[N]``, summing to 1)
    whose sum reaches ``top_p``."""
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
        self.bases: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = []  # per slot: [L-1, H, length, D] x 2
        self.placeholder: dict[str, OffsetStack] = {}
        self.own_text: dict[tuple[str, str], OffsetStack] = {}
        self.clock = 0  # anchors added so far: a slot's creation time (eviction takes the oldest)

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
        tensors = [t for base in self.bases if base is not None for t in base]
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
        tokens = keys.shape[2]
        self.bases[slot] = (keys.clone(), values.clone())  # the store may evict the segment
        self.segment_ids[slot] = segment.id
        self.lengths[slot] = tokens
        self.activations[slot] = 0
        self.clock += 1
        self.created[slot] = self.clock
        self._clear_slot(slot)
        return slot

    def _clear_slot(self, slot: int) -> None:
        """Every receiver's offsets for ``slot`` gone; a receiver left with none is dropped (an
        empty stack weighs nothing against the budget, yet every walk of the stacks pays for it)."""
        for stacks in (self.placeholder, self.own_text):
            for key, stack in list(stacks.items()):
                stack.clear_slot(slot)
                if not stack.parts:
                    del stacks[key]

    def _free_slot(self) -> int:
        if None in self.segment_ids:
            return self.segment_ids.index(None)
        if len(self.segment_ids) < self.max_anchors:
            self.segment_ids.append(None)
            self.bases.append(None)
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
        self.bases[victim] = None
        self.lengths[victim] = 0
        self._clear_slot(victim)
        return victim

    def record(self, slot: int, receiver: str, start: int, keys: torch.Tensor, values: torch.Tensor,
               context: Optional[tuple[int, ...]] = None, min_match: int = 0) -> None:
        """Placeholder offsets ``[L-1, H, n, D]`` of segment tokens ``start..start+n``, observed
        after ``context`` (the ids before token ``start``; None: unknown); ``min_match``: see
        :class:`RecordedContext`."""
        stack = self.placeholder.setdefault(receiver, OffsetStack())
        stack.write(slot, start, keys, values, len(self.segment_ids), context=context, min_match=min_match)

    def record_own_text(self, slot: int, receiver: str, piece: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Offsets ``[L-1, H, P, D]`` of the receiver's own-text piece ``piece`` after the segment."""
        stack = self.own_text.setdefault((receiver, piece), OffsetStack())
        stack.write(slot, 0, keys, values, len(self.segment_ids))

    def base(self, slot: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The anchor's base ``(keys, values)`` ``[L-1, H, length, D]`` (None: an empty slot)."""
        return self.bases[slot] if slot < len(self.bases) else None

    def base_dense(self, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, L-1, H, width, D]`` float32 base KV of ``slots`` (zero padded)."""
        return _padded([(0, *self.base(int(s))) if self.base(int(s)) is not None else None for s in slots], width)

    # ---- matching -------------------------------------------------------------------------
    def candidates(self, receiver: str, length: int, exclude: Optional[int] = None) -> torch.Tensor:
        """``[N]`` slots of anchors at least ``length`` tokens long (and at least one) holding
        ``receiver``'s offsets (the paper's rule: an anchor covers the whole segment)."""
        stack = self.placeholder.get(receiver)
        if stack is None or not self.segment_ids:
            return torch.zeros(0, dtype=torch.long)
        ok = self.held_by(stack) & (self.lengths >= max(1, length))
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
        norms, scales = [], []
        for slot in slots.tolist():
            base = self.bases[slot][1]
            n = max(1, min(t, base.shape[2]))
            norms.append((base[:, :, :n].float() - values[:, :, :n].to(base.device, torch.float32)).norm())
            scales.append(math.sqrt(t / n))
        if not norms:
            return torch.zeros(0)
        return torch.stack([x.to(norms[0].device) for x in norms]).cpu() * torch.tensor(scales)

    def credit(self, slots: torch.Tensor, weights: torch.Tensor, top_p: float) -> None:
        """Raise the activation count of the anchors among the nearest (top-p of ``weights``,
        ``[N]``, one per slot of ``slots``, ``[N]`` int64)."""
        self.activations[slots[top_p_members(weights, top_p)]] += 1

    def compact(self) -> None:
        """Drop emptied slots (occupied ones keep their order): the bookkeeping shrinks with them
        (their tensors went when they were emptied)."""
        keep = [i for i, sid in enumerate(self.segment_ids) if sid is not None]
        index = torch.tensor(keep, dtype=torch.long)
        self.segment_ids = [self.segment_ids[i] for i in keep]
        self.created = [self.created[i] for i in keep]
        self.bases = [self.bases[i] for i in keep]
        self.lengths, self.activations = self.lengths[index], self.activations[index]
        moved = {old: new for new, old in enumerate(keep)}
        for stacks in (self.placeholder, self.own_text):
            for key, stack in list(stacks.items()):
                stack.renumber(moved, len(keep))
                if not stack.parts:
                    del stacks[key]
