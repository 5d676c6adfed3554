"""``alignment.assemble`` as tensor work, no model: the prefix, then each run with its offsets added
in the canonical frame and its keys re-rotated to its prompt positions; recomputed positions
dropped; values never rotated."""

from __future__ import annotations

import torch

from kvcomm_agents.alignment import assemble
from kvcomm_agents.kv.rope import RopeRotator
from kvcomm_agents.plan import CallPlan, ReusedRun

from .kv.test_shared import _segment

ROTATOR = RopeRotator(torch.tensor([1.0, 0.1]))  # head_dim 4: two frequencies


def _offsets(segment, start: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layers, heads, dim = segment.kv.num_layers - 1, 2, 4
    return torch.randn(layers, heads, length, dim, generator=g), torch.randn(layers, heads, length, dim, generator=g)


def _expected(segment, start: int, length: int, shift: int, offsets=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` ``[1, H, length, D]``: base (+ offsets on layers 1..), keys
    rotated by ``shift``."""
    out = []
    for layer, (keys, values) in enumerate(segment.kv.window(start, start + length).layers()):
        if offsets is not None and layer > 0:
            keys, values = keys + offsets[0][layer - 1][None], values + offsets[1][layer - 1][None]
        out.append((ROTATOR.shift(keys, shift), values))
    return out


def _layers(block) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return block.layers()


def test_a_run_gets_its_offsets_in_the_canonical_frame_then_its_keys_move_to_its_positions():
    segment = _segment(8)
    offsets = _offsets(segment, 1, 4, seed=0)
    run = ReusedRun(segment, 10, 1, 4, key_offsets=offsets[0], value_offsets=offsets[1])
    block = assemble(CallPlan(torch.arange(20), None, (run,)), ROTATOR)
    assert block.num_tokens == 4
    for (k, v), (ek, ev) in zip(_layers(block), _expected(segment, 1, 4, shift=9, offsets=offsets)):
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, ev, atol=1e-6, rtol=0)
    off = assemble(CallPlan(torch.arange(20), None, (ReusedRun(segment, 10, 1, 4, key_offsets=offsets[0],
                                                                 value_offsets=offsets[1], offsets_on=False),)), ROTATOR)
    for (k, v), (ek, ev) in zip(_layers(off), _expected(segment, 1, 4, shift=9)):  # kept for an audit, not applied
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, ev, atol=1e-6, rtol=0)


def test_runs_follow_in_plan_order_a_position_offset_moves_every_key_and_recomputed_positions_leave():
    first, second = _segment(6), _segment(9)
    runs = (ReusedRun(first, 2, 0, 6), ReusedRun(second, 12, 3, 5))
    block = assemble(CallPlan(torch.arange(20), None, runs), ROTATOR, position_offset=7)
    expected = [torch.cat([a[0], b[0]], dim=2) for a, b in zip(_expected(first, 0, 6, shift=2 + 7),
                                                                _expected(second, 3, 5, shift=9 + 7))]
    for (k, _), ek in zip(_layers(block), expected):
        torch.testing.assert_close(k, ek, atol=1e-5, rtol=0)
    dropped = assemble(CallPlan(torch.arange(20), None, runs, recompute=torch.tensor([2, 13])), ROTATOR)
    full = assemble(CallPlan(torch.arange(20), None, runs), ROTATOR)
    keep = [i for i, p in enumerate(list(range(2, 8)) + list(range(12, 17))) if p not in (2, 13)]
    assert dropped.num_tokens == 9
    for (k, v), (fk, fv) in zip(_layers(dropped), _layers(full)):
        torch.testing.assert_close(k, fk[:, :, keep])
        torch.testing.assert_close(v, fv[:, :, keep])
