"""Learned context offsets for reused segments: a running mean per (receiver agent, segment kind).

Re-rotation fixes a pasted segment's positions but not its context: above layer 0 its KV lacks
the influence of the receiver's own prefix. KVCOMM estimates that deviation from earlier
requests ("anchors"). This module keeps the cheapest estimator the prototype measured as faithful
as the paper's similarity weights: for each receiver and kind of segment, the mean over observed
anchors of ``real KV - base KV``, per layer, head, token index and channel, in the canonical RoPE
frame (token ``t`` of a segment at position ``t``), so it applies wherever the segment lands.

Observations are recorded only where the receiver computed the segment with exact context
(everything before it dense or exact-prefix), see ``CallPlan.observations``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from .segments import Kind

__all__ = ["OffsetPool", "MeanOffsets"]


@dataclass(eq=False)
class MeanOffsets:
    """Running sums of offsets for one (receiver, kind).

    Attributes:
        key_sums, value_sums: per layer (layer 0 None), ``[1, kv_heads, capacity, head_dim]``
            float32 sums of canonical-frame offsets.
        counts: ``[capacity]`` observations per token index.
        anchors: observations recorded (segments seen).
    """

    key_sums: list[Optional[torch.Tensor]]
    value_sums: list[Optional[torch.Tensor]]
    counts: torch.Tensor
    anchors: int = 0

    @property
    def capacity(self) -> int:
        return int(self.counts.numel())

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (*self.key_sums, *self.value_sums) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + self.counts.numel() * 8

    def grow(self, capacity: int) -> None:
        """Reallocate to hold at least ``capacity`` token indices (doubling)."""
        if capacity <= self.capacity:
            return
        new = max(capacity, 2 * self.capacity)
        pad = new - self.capacity
        for sums in (self.key_sums, self.value_sums):
            for i, t in enumerate(sums):
                if t is not None:
                    sums[i] = torch.cat([t, t.new_zeros(*t.shape[:2], pad, t.shape[3])], dim=2)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(pad)])


class OffsetPool:
    """All learned offsets of one engine, under a byte budget (least recently used pools go).

    Args:
        max_bytes: budget for every (receiver, kind) pool together.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pools: OrderedDict[tuple[str, Kind], MeanOffsets] = OrderedDict()
        self._lock = threading.RLock()
        self.frozen = False

    def anchors(self, agent: str, kind: Kind) -> int:
        """Observations recorded for this receiver and kind."""
        with self._lock:
            pool = self._pools.get((agent, tuple(kind)))
            return pool.anchors if pool else 0

    def estimate(
        self, agent: str, kind: Kind, start: int, end: int
    ) -> Optional[tuple[list[Optional[torch.Tensor]], list[Optional[torch.Tensor]]]]:
        """Mean offsets for segment tokens ``start..end``, canonical frame.

        Returns:
            Per layer (layer 0 None) key and value offsets ``[1, kv_heads, end - start, head_dim]``
            in float32 (zero for token indices never observed), or None without observations.
        """
        with self._lock:
            pool = self._pools.get((agent, tuple(kind)))
            if pool is None or pool.anchors == 0:
                return None
            self._pools.move_to_end((agent, tuple(kind)))
            stop = min(end, pool.capacity)
            n = end - start
            scale = (1.0 / pool.counts[start:stop].clamp_min(1).float())
            keys, values = [], []
            for sums_list, out in ((pool.key_sums, keys), (pool.value_sums, values)):
                for sums in sums_list:
                    if sums is None:
                        out.append(None)
                        continue
                    mean = sums.new_zeros(*sums.shape[:2], n, sums.shape[3])
                    if stop > start:
                        mean[:, :, : stop - start] = sums[:, :, start:stop] * scale.to(sums.device)[:, None]
                    out.append(mean)
            return keys, values

    def record(
        self,
        agent: str,
        kind: Kind,
        start: int,
        key_offsets: list[torch.Tensor],
        value_offsets: list[torch.Tensor],
    ) -> None:
        """Add one observation: offsets of segment tokens ``start..start+n`` (per layer,
        ``[1, kv_heads, n, head_dim]``, canonical frame; layer 0 is ignored)."""
        if self.frozen:
            return
        n = key_offsets[0].shape[2]
        with self._lock:
            key = (agent, tuple(kind))
            pool = self._pools.get(key)
            if pool is None:
                pool = MeanOffsets(
                    [None] + [k.new_zeros(*k.shape[:2], 0, k.shape[3], dtype=torch.float32) for k in key_offsets[1:]],
                    [None] + [v.new_zeros(*v.shape[:2], 0, v.shape[3], dtype=torch.float32) for v in value_offsets[1:]],
                    torch.zeros(0, dtype=torch.long),
                )
                self._pools[key] = pool
            pool.grow(start + n)
            for layer in range(1, len(key_offsets)):
                pool.key_sums[layer][:, :, start : start + n] += key_offsets[layer].float()
                pool.value_sums[layer][:, :, start : start + n] += value_offsets[layer].float()
            pool.counts[start : start + n] += 1
            pool.anchors = int(pool.counts.max())
            self._pools.move_to_end(key)
            self._evict()

    def nbytes(self) -> int:
        with self._lock:
            return sum(pool.nbytes for pool in self._pools.values())

    def clear(self) -> None:
        with self._lock:
            self._pools.clear()

    def _evict(self) -> None:
        while self._pools and self.nbytes() > self.max_bytes:
            self._pools.popitem(last=False)
