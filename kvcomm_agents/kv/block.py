"""``KVBlock``: the one KV layout of the library (segments, exact prefixes, own text, assembly).

A block holds the keys and values of ``T`` tokens for every layer. Layers that share a device are
stacked into one ``[L_g, kv_heads, T, head_dim]`` tensor per device group (one group unless the
model is spread over devices with ``device_map``), so an operation on a block (a rotation, adding
offsets, a token window) is one tensor operation per group instead of one per layer. Per-layer
``[1, kv_heads, T, head_dim]`` views are what a transformers cache takes.

Keys are post-RoPE; whether they sit at their true positions or in the canonical frame (first
token at position 0) is up to the holder (see :mod:`.segments`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .rope import RopeRotator

__all__ = ["KVBlock", "device_groups"]


def device_groups(devices: Sequence[torch.device]) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of consecutive layers on the same device."""
    groups, start = [], 0
    for i in range(1, len(devices) + 1):
        if i == len(devices) or devices[i] != devices[start]:
            groups.append((start, i))
            start = i
    return groups


@dataclass(frozen=True, eq=False)
class KVBlock:
    """KV of ``T`` tokens for ``L`` layers, stacked per device group.

    Attributes:
        keys: one ``[L_g, kv_heads, T, head_dim]`` tensor per device group.
        values: likewise.
        starts: the first layer of each group (``starts[0] == 0``; groups are consecutive).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    starts: tuple[int, ...] = (0,)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def stacked(cls, keys: torch.Tensor, values: torch.Tensor) -> "KVBlock":
        """A one-group block of ``[L, kv_heads, T, head_dim]`` keys and values (taken as they are)."""
        return cls((keys,), (values,), (0,))

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "KVBlock":
        """Stack per-layer ``[1, kv_heads, T, head_dim]`` ``(keys, values)`` (a copy), grouping
        consecutive layers that share a device."""
        groups = device_groups([k.device for k, _ in layers])
        return cls(tuple(torch.cat([k for k, _ in layers[i:j]]) for i, j in groups),
                   tuple(torch.cat([v for _, v in layers[i:j]]) for i, j in groups),
                   tuple(i for i, _ in groups))

    @staticmethod
    def cat(blocks: Sequence["KVBlock"]) -> "KVBlock":
        """Blocks with the same grouping, concatenated along tokens (one block alone: itself)."""
        if len(blocks) == 1:
            return blocks[0]
        groups = range(len(blocks[0].keys))
        return KVBlock(
            tuple(torch.cat([b.keys[g] for b in blocks], dim=2) for g in groups),
            tuple(torch.cat([b.values[g] for b in blocks], dim=2) for g in groups),
            blocks[0].starts,
        )

    @staticmethod
    def assembled(pieces: Sequence[tuple["KVBlock", int]], rotator: RopeRotator) -> "KVBlock":
        """``(block, delta)`` pieces (same grouping), each one's keys moved by ``delta``
        positions, concatenated along tokens: every piece rotated straight into one new block
        (one pass over each piece's keys and values, where shifting then :meth:`cat` makes two).
        One piece with ``delta`` 0: that block itself."""
        if len(pieces) == 1:
            block, delta = pieces[0]
            return block.shifted(rotator, delta)
        first = pieces[0][0]
        tokens = sum(block.num_tokens for block, _ in pieces)

        def empty(t: torch.Tensor) -> torch.Tensor:
            return t.new_empty((t.shape[0], t.shape[1], tokens, t.shape[3]))

        out = KVBlock(tuple(empty(k) for k in first.keys), tuple(empty(v) for v in first.values), first.starts)
        at = 0
        for block, delta in pieces:
            end = at + block.num_tokens
            for g, (keys, values) in enumerate(zip(block.keys, block.values)):
                rotator.shift(keys, delta, out=out.keys[g][:, :, at:end])
                out.values[g][:, :, at:end].copy_(values)
            at = end
        return out

    # ---- shape ----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.starts[-1] + self.keys[-1].shape[0]

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of one layer, ``[1, kv_heads, T, head_dim]`` views."""
        g = max(i for i, start in enumerate(self.starts) if start <= index)
        local = index - self.starts[g]
        return self.keys[g][local : local + 1], self.values[g][local : local + 1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's ``(keys, values)`` views, in layer order."""
        return [self.layer(i) for i in range(self.num_layers)]

    def upper_layers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``1..L-1`` as ``[L-1, kv_heads, T, head_dim]`` keys and values: views for one
        group, else gathered onto the first group's device (a copy)."""
        if len(self.keys) == 1:
            return self.keys[0][1:], self.values[0][1:]
        device = self.keys[0].device
        rest = self.layers()[1:]
        return (torch.cat([k.to(device) for k, _ in rest]), torch.cat([v.to(device) for _, v in rest]))

    # ---- operations (new blocks; views where possible) ------------------------------------
    def window(self, start: int, end: int) -> "KVBlock":
        """Tokens ``start..end`` (views)."""
        return KVBlock(tuple(k[:, :, start:end] for k in self.keys),
                       tuple(v[:, :, start:end] for v in self.values), self.starts)

    def select(self, index: torch.Tensor) -> "KVBlock":
        """Tokens at ``index`` (``[n]`` int64), in that order (a copy)."""
        return KVBlock(tuple(k.index_select(2, index.to(k.device)) for k in self.keys),
                       tuple(v.index_select(2, index.to(v.device)) for v in self.values), self.starts)

    def shifted(self, rotator: RopeRotator, delta: int) -> "KVBlock":
        """Keys moved by ``delta`` positions (exact re-rotation); values shared."""
        if delta == 0:
            return self
        return KVBlock(tuple(rotator.shift(k, delta) for k in self.keys), self.values, self.starts)

    def with_offsets(self, key_offsets: Optional[torch.Tensor], value_offsets: Optional[torch.Tensor]) -> "KVBlock":
        """``[L-1, kv_heads, T, head_dim]`` offsets added to layers ``1..L-1`` (in float32, rounded
        once to the block's dtype); layer 0 is unchanged. None: the block itself."""
        if key_offsets is None:
            return self
        return KVBlock(self._add(self.keys, key_offsets), self._add(self.values, value_offsets), self.starts)

    def _add(self, groups: tuple[torch.Tensor, ...], offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for start, t in zip(self.starts, groups):
            wide = t.to(torch.float32, copy=True)
            if start == 0:
                wide[1:] += offsets[: t.shape[0] - 1].to(wide.device)
            else:
                wide += offsets[start - 1 : start - 1 + t.shape[0]].to(wide.device)
            out.append(wide.to(t.dtype))
        return tuple(out)
