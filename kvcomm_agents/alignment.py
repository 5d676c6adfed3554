"""Align reused KV for a receiver: one :class:`~.kv.block.KVBlock` of every reused slot.

Storage order is the plan's: the exact prefix, then each run, each run's keys moved from the
canonical frame to its prompt positions (exact RoPE re-rotation) after its KVCOMM offsets, if
any, were added in the canonical frame. Pure tensor work on token positions and KV blocks: the
runtime (``engines.hf``) puts the result into its cache.
"""

from __future__ import annotations

import torch

from .kv.block import KVBlock
from .kv.rope import RopeRotator
from .plan import CallPlan

__all__ = ["assemble"]


def assemble(plan: CallPlan, rotator: RopeRotator, position_offset: int = 0) -> KVBlock:
    """The reused slots of ``plan`` in the order of ``plan.reused_positions()`` (recomputed
    positions dropped), keys at their prompt positions plus ``position_offset``.

    One rotation (straight into the assembled block) and one offset addition per run and device
    group, not per layer. An exact prefix alone is returned as views (the cache's update makes the
    one copy).
    """
    pieces = []
    if plan.prefix is not None:
        pieces.append((plan.prefix.entry.kv.window(0, plan.prefix_length), position_offset))
    for run in plan.runs:
        kv = run.segment.kv.window(run.segment_start, run.segment_start + run.length)
        if run.offsets_on:
            kv = kv.with_offsets(run.key_offsets, run.value_offsets)
        pieces.append((kv, run.shift + position_offset))
    block = KVBlock.assembled(pieces, rotator)
    if plan.recompute is not None:
        block = block.select((~torch.isin(plan.storage_positions(), plan.recompute)).nonzero().flatten())
    return block
