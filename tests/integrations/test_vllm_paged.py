"""kvcomm_vllm.paged without vLLM: the reader check against fake attention layers that write
like vLLM's CPU backend (keys channel-major) and like FlashAttention (K|V in the last dimension),
and one whose layout no reader knows (capture must switch off, not read wrong KV)."""

from __future__ import annotations

import torch

from kvcomm_agents.kv.block import KVBlock
from kvcomm_vllm.paged import PagedKV

BLOCK, HEADS, DIM = 32, 2, 8


class _Impl:
    def __init__(self, layout: str):
        self.layout = layout

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """key/value ``[T, H, D]`` into ``kv_cache`` ``[B, H, N, 2D]`` at ``slot_mapping``."""
        blocks, offsets = slot_mapping // BLOCK, slot_mapping % BLOCK
        b, h, n, _ = kv_cache.shape
        if self.layout == "cpu":
            halves = kv_cache.view(b, h, 2, n * DIM)
            halves[:, :, 0].view(b, h, DIM, n)[blocks, :, :, offsets] = key
            halves[:, :, 1].view(b, h, n, DIM)[blocks, :, offsets, :] = value
        elif self.layout == "flash":
            kv_cache[blocks, :, offsets, :DIM] = key
            kv_cache[blocks, :, offsets, DIM:] = value
        else:  # values first: a layout no reader knows
            kv_cache[blocks, :, offsets, :DIM] = value
            kv_cache[blocks, :, offsets, DIM:] = key


class _Layer:
    def __init__(self, layout: str):
        self.impl = _Impl(layout)


def _paged(layout: str, layers: int = 3, blocks: int = 6) -> PagedKV:
    return PagedKV([(_Layer(layout), torch.zeros(blocks, HEADS, BLOCK, 2 * DIM)) for _ in range(layers)], BLOCK, DIM)


def test_the_reader_that_reads_back_what_the_backend_wrote_is_chosen():
    assert _paged("cpu").choose_reader() == "channel_major_keys"
    assert _paged("flash").choose_reader() == "split_last"


def test_an_unknown_layout_switches_capture_off_with_a_reason():
    paged = _paged("values_first")
    assert paged.choose_reader() is None and not paged.readable
    assert "no known reader" in paged.check_reason


def test_written_tokens_read_back_exactly_through_a_block_table():
    for layout in ("cpu", "flash"):
        paged = _paged(layout)
        paged.choose_reader()
        block_ids = [4, 1, 5]  # the request's blocks, not in order
        positions = torch.arange(10, 70)  # crosses block boundaries
        keys, values = torch.randn(3, HEADS, 60, DIM), torch.randn(3, HEADS, 60, DIM)
        paged.write(KVBlock.stacked(keys, values), block_ids, positions)
        back = paged.read(block_ids, positions)
        assert torch.equal(back.keys[0], keys) and torch.equal(back.values[0], values)
        untouched = paged.layers[0][1][[0, 2, 3]]
        assert not untouched.any()  # other requests' blocks are never written
