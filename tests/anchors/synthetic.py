"""Synthetic segments and offsets for the anchor tests (no model)."""

from __future__ import annotations

from typing import Optional

import torch

from kvcomm_agents.anchors import KVCommAnchors
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.rope import RopeRotator
from kvcomm_agents.kv.segments import KVSegment
from kvcomm_agents.plan import CallPlan, Observation, OwnTextPiece

LAYERS, HEADS, DIM = 4, 2, 8
KIND = ("solver-1", "assistant")
ROTATOR = RopeRotator(1.0 / (10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)))


def segment(seed: int, tokens: int = 6, scale: float = 1.0, values: Optional[torch.Tensor] = None,
            kind=KIND) -> KVSegment:
    """A segment with random ``[LAYERS, HEADS, tokens, DIM]`` KV (or the given values)."""
    g = torch.Generator().manual_seed(seed)
    keys = scale * torch.randn(LAYERS, HEADS, tokens, DIM, generator=g)
    random_values = scale * torch.randn(LAYERS, HEADS, tokens, DIM, generator=g)
    kv = KVBlock.stacked(keys, random_values if values is None else values)
    return KVSegment.create(kind=kind, text="x" * tokens, token_ids=list(range(tokens)),
                            char_spans=[(i, i + 1) for i in range(tokens)], kv=kv, fingerprint="m")


def offsets(seed: int, tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[LAYERS-1, HEADS, tokens, DIM]`` key and value offsets."""
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(LAYERS - 1, HEADS, tokens, DIM, generator=g),
            torch.randn(LAYERS - 1, HEADS, tokens, DIM, generator=g))


def upper(seg: KVSegment) -> tuple[torch.Tensor, torch.Tensor]:
    return seg.kv.upper_layers()


def observe(anchors: KVCommAnchors, receiver: str, seg: KVSegment, key_off: torch.Tensor, val_off: torch.Tensor,
            *, at: int = 3, piece: Optional[tuple[str, KVSegment, torch.Tensor, torch.Tensor]] = None) -> None:
    """Let ``anchors`` observe an exact pass in which ``receiver`` computed ``seg`` at prompt
    position ``at`` with real KV ``base + offsets`` (keys at their true positions), optionally
    followed by an own-text piece ``(key, base, key_off, val_off)``."""
    t = seg.num_tokens
    parts = [seg.kv.with_offsets(key_off, val_off).shifted(ROTATOR, at)]
    pieces, own = (), {}
    end = at + t
    if piece is not None:
        key, base, pk, pv = piece
        parts.append(base.kv.with_offsets(pk, pv).shifted(ROTATOR, end))
        pieces = (OwnTextPiece(end, end + base.num_tokens, key, base.token_ids, seg, observed=True),)
        own = {end: base}
        end += base.num_tokens
    real = KVBlock.cat(parts)
    plan = CallPlan(torch.arange(end + 1), observations=(Observation(seg, at, 0, t),), pieces=pieces)
    anchors.observe(receiver, plan, lambda start, length: real.window(start - at, start - at + length), ROTATOR, own)
