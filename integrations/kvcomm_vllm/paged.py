"""Tokens' KV in and out of vLLM's paged KV memory.

Writing goes through each attention layer's own ``impl.do_kv_cache_update`` (the op vLLM's
forward uses), so whatever a backend does inside a block (the CPU backend stores keys
channel-major, ``[head_dim, block_size]`` per block and head) is done by vLLM itself. Reading has
no such op, so a :class:`BlockReader` per layout reads it back; the one in use is chosen at start
by a round trip (random K/V written with the backend's op into a scratch copy of two blocks, read
back, compared exactly), and a layout no reader understands disables capture, with a warning,
rather than returning wrong KV.

Slots: token ``p`` of a request lives in slot ``block_ids[p // block_size] * block_size +
p % block_size``.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from kvcomm_agents.paged import KVBlock

__all__ = ["BlockReader", "READERS", "PagedKV", "slots_of"]

logger = logging.getLogger("kvcomm_agents.vllm")

#: ``(cache, blocks [T], offsets [T], head_dim) -> (keys, values)``, each ``[T, kv_heads, head_dim]``.
BlockReader = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _read_channel_major_keys(cache, blocks, offsets, head_dim):
    """vLLM's CPU backend: ``[B, H, N, 2D]`` holds, per block and head, the keys as ``[D, N]``
    then the values as ``[N, D]``."""
    b, h, n, _ = cache.shape
    halves = cache.view(b, h, 2, n * head_dim)
    keys = halves[:, :, 0].view(b, h, head_dim, n)[blocks, :, :, offsets]
    values = halves[:, :, 1].view(b, h, n, head_dim)[blocks, :, offsets, :]
    return keys, values


def _read_split_last(cache, blocks, offsets, head_dim):
    """FlashAttention-style backends: ``[B, H, N, 2D]`` logical view, keys then values in the
    last dimension of each token."""
    rows = cache[blocks, :, offsets]  # [T, H, 2D]
    return rows[..., :head_dim], rows[..., head_dim:]


#: Readers by name, tried in order at start.
READERS: dict[str, BlockReader] = {"channel_major_keys": _read_channel_major_keys, "split_last": _read_split_last}


def slots_of(block_ids: Sequence[int], positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, offsets)``, each ``[T]`` int64: where positions ``[T]`` of a request live."""
    table = torch.as_tensor(list(block_ids), dtype=torch.long)
    positions = positions.to(torch.long).cpu()
    return table[positions // block_size], positions % block_size


class PagedKV:
    """One worker's paged KV: every attention layer, in model order.

    Args:
        layers: ``(layer, cache)`` per model layer, in order: vLLM's ``Attention`` module (its
            ``impl.do_kv_cache_update`` writes) and its ``[B, H, N, 2D]`` cache tensor.
        block_size: tokens per block.
        head_dim: channels per head.
    """

    def __init__(self, layers: Sequence[tuple[object, torch.Tensor]], block_size: int, head_dim: int):
        self.layers = list(layers)
        self.block_size, self.head_dim = block_size, head_dim
        self.reader_name: Optional[str] = None
        self._reader: Optional[BlockReader] = None
        self.check_reason: Optional[str] = None

    @property
    def device(self) -> torch.device:
        return self.layers[0][1].device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0][1].dtype

    @property
    def readable(self) -> bool:
        return self._reader is not None

    # ---- start-up check -------------------------------------------------------------------
    def choose_reader(self, seed: int = 0) -> Optional[str]:
        """Pick the reader that reads back exactly what the backend's own op wrote (a round trip
        through a scratch copy of two blocks of layer 0). Returns its name, or None (capture off;
        ``check_reason`` says why)."""
        layer, cache = self.layers[0]
        scratch = torch.zeros_like(cache[:2])
        n_heads = cache.shape[1]
        generator = torch.Generator().manual_seed(seed)
        tokens = min(2 * self.block_size, 40)
        positions = torch.randperm(2 * self.block_size, generator=generator)[:tokens]
        keys = torch.randn(tokens, n_heads, self.head_dim, generator=generator).to(cache.device, cache.dtype)
        values = torch.randn(tokens, n_heads, self.head_dim, generator=generator).to(cache.device, cache.dtype)
        try:
            layer.impl.do_kv_cache_update(layer, keys, values, scratch, positions.to(cache.device))
        except Exception as error:  # noqa: BLE001 - any backend failure means: do not read
            self.check_reason = f"the backend's cache update failed on a scratch block: {error!r}"
            return None
        blocks, offsets = positions // self.block_size, positions % self.block_size
        for name, reader in READERS.items():
            try:
                got_k, got_v = reader(scratch, blocks.to(cache.device), offsets.to(cache.device), self.head_dim)
            except (RuntimeError, IndexError):
                continue
            if torch.equal(got_k, keys) and torch.equal(got_v, values):
                self.reader_name, self._reader = name, reader
                return name
        self.check_reason = (f"no known reader reads back this backend's KV layout (cache {tuple(cache.shape)}, "
                             f"{cache.dtype}); captured KV would be wrong, so nothing is captured")
        return None

    # ---- tokens in and out ----------------------------------------------------------------
    def write(self, block: KVBlock, block_ids: Sequence[int], positions: torch.Tensor) -> None:
        """Write ``block`` (``[L, H, T, D]`` per group, tokens in the order of ``positions``) into
        the request's slots for ``positions`` ``[T]``."""
        if block.num_layers != len(self.layers):
            raise ValueError(f"KV of {block.num_layers} layers for a model of {len(self.layers)}")
        blocks, offsets = slots_of(block_ids, positions, self.block_size)
        slots = (blocks * self.block_size + offsets).to(self.device)
        for index, (layer, cache) in enumerate(self.layers):
            keys, values = block.layer(index)  # [1, H, T, D]
            layer.impl.do_kv_cache_update(layer, keys[0].transpose(0, 1).to(cache.device, cache.dtype).contiguous(),
                                          values[0].transpose(0, 1).to(cache.device, cache.dtype).contiguous(),
                                          cache, slots)

    def read(self, block_ids: Sequence[int], positions: torch.Tensor) -> KVBlock:
        """KV of the request's ``positions`` ``[T]``: ``[L, H, T, D]`` keys and values."""
        if self._reader is None:
            raise RuntimeError(self.check_reason or "choose_reader() was not run")
        blocks, offsets = slots_of(block_ids, positions, self.block_size)
        blocks, offsets = blocks.to(self.device), offsets.to(self.device)
        keys, values = [], []
        for _, cache in self.layers:
            k, v = self._reader(cache, blocks, offsets, self.head_dim)  # [T, H, D]
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        return KVBlock.stacked(torch.stack(keys), torch.stack(values))
