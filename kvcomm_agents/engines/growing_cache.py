"""Decode KV written in place, into buffers with room to grow.

transformers' ``DynamicLayer`` appends a step's KV with ``torch.cat``: every decode step copies
the whole cache of every layer once more, ``2 x L x [B, kv_heads, T, head_dim]`` per step, a cost
that grows with the context while the step's matrix products do not. On 2 CPU cores with the
embedded model (fp32, weights transposed), a decode forward after 300-2,000 cached ids,
concatenated -> in place: 0.93-1.01x the time for one row of 1 or 5 ids, 0.94-0.99x for four rows
(``python -m benchmarks.batched_steps --lengths 300,1000,2000 --rows 1,4 --ids 1,5 --layouts
transposed --kv concatenated,in_place``, ``benchmarks/results/kv-in-place-steps.json``).

A :class:`GrowingLayer` keeps each layer's keys and values in a buffer
``[B, kv_heads, T + room, head_dim]`` and exposes the filled part as a view, so a step writes only
its own ids. It writes only into a buffer it allocated itself: KV it was handed (a cache built on
a stored block's views, :func:`.hf.cache_from_block`; rows taken back from a batch) is copied into
a new buffer on the first step, as a concatenation would copy it, and is never written. A cut
(:func:`.hf.keep_first`, a refused draft) keeps a view of the buffer, and the next step writes
over the dropped slots: a view read before a cut may change after it, so readers that keep KV
copy it (:func:`.hf.kv_at_positions`, :func:`.hf.take_row`). The room is ``max(MIN_ROOM, T // 8)`` ids, so a long reply reallocates
geometrically rarely.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["GrowingLayer", "MIN_ROOM", "hold", "make_growing"]

#: fewest spare slots a buffer is allocated with (a 32-token reply and its drafts fit)
MIN_ROOM = 64


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose ``keys`` / ``values`` (``[B, kv_heads, T, head_dim]``)
    are views of buffers with spare slots; ``update`` writes new KV into them in place."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states`` / ``value_states`` (``[B, kv_heads, n, head_dim]``) after the
        held slots; returns the views of all ``T + n`` slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.numel() and not self._fits(self.keys, key_states) or self.values.numel() and not self._fits(
                self.values, value_states):
            # rows, heads, dtype or device differ: transformers' own update (it concatenates, or
            # raises as ``torch.cat`` does), never a slice assignment that would broadcast or cast
            self._key_buffer = self._value_buffer = None
            return super().update(key_states, value_states, *args, **kwargs)
        held = self.keys.shape[-2] if self.keys.numel() else 0
        needed = held + key_states.shape[-2]
        if not (self._owns(self.keys, self._key_buffer) and self._owns(self.values, self._value_buffer)
                and needed <= self._key_buffer.shape[-2]):
            self._key_buffer = self._buffer(self.keys, key_states, held, needed)
            self._value_buffer = self._buffer(self.values, value_states, held, needed)
        self._key_buffer[:, :, held:needed] = key_states
        self._value_buffer[:, :, held:needed] = value_states
        self.keys, self.values = self._key_buffer[:, :, :needed], self._value_buffer[:, :, :needed]
        return self.keys, self.values

    def offload(self) -> None:
        """transformers' offload (the held KV to the CPU), letting go of the buffers the held
        KV was a view of, which would otherwise stay on the device."""
        super().offload()
        self._key_buffer = self._value_buffer = None

    @staticmethod
    def _fits(held: torch.Tensor, new: torch.Tensor) -> bool:
        """Whether ``new`` KV can be written after ``held`` slot by slot: the same rows, heads,
        head size, dtype and device."""
        return (held.shape[:2] == new.shape[:2] and held.shape[3] == new.shape[3] and held.dtype == new.dtype
                and held.device == new.device)

    @staticmethod
    def _owns(view: torch.Tensor, buffer: torch.Tensor | None) -> bool:
        """Whether ``view`` is the leading slots of ``buffer`` (so writing after it is safe)."""
        return (buffer is not None and view.numel() > 0 and view.data_ptr() == buffer.data_ptr()
                and view.stride() == buffer.stride() and view.shape[:2] == buffer.shape[:2]
                and view.shape[3] == buffer.shape[3])

    @staticmethod
    def _buffer(held: torch.Tensor, new: torch.Tensor, count: int, needed: int) -> torch.Tensor:
        """A new buffer for ``needed`` slots and room, holding ``held``'s ``count`` slots."""
        batch, heads, _, dim = new.shape
        buffer = new.new_empty((batch, heads, needed + max(MIN_ROOM, needed // 8), dim))
        if count:
            buffer[:, :, :count] = held
        return buffer


def hold(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``layer`` hold ``keys`` / ``values`` (``[B, kv_heads, T, head_dim]``, tensors it
    does not own: the next step copies them once). A growing layer lets go of its buffers, which
    would otherwise stay alive beside the new KV until that step."""
    layer.keys, layer.values = keys, values
    if isinstance(layer, GrowingLayer):
        layer._key_buffer = layer._value_buffer = None


def make_growing(cache: DynamicCache) -> DynamicCache:
    """Make ``cache``'s plain full-attention layers :class:`GrowingLayer` in place (their KV is
    kept as it is until the next step copies it once); sliding-window, quantized and other layers
    are left as they are. Returns ``cache``."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            # The layer keeps every attribute transformers gave it (keys, values, device, dtype,
            # flags): only ``update`` changes, so the class is swapped rather than rebuilt.
            layer.__class__ = GrowingLayer
    return cache
