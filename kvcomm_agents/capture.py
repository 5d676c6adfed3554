"""Package KV out of a finished call as segments: the reply, and user/tool messages seen first here.

Each segment's keys are cut from the call's cache and de-rotated to the canonical frame (first
token at position 0).
"""

from __future__ import annotations

import difflib
from typing import Optional

import torch

from .cache.assembly import kv_at_positions
from .cache.rope import RopeRotator
from .cache.segments import Kind, KVSegment

__all__ = ["align_ids_to_text", "cut_segment", "message_kind"]


def align_ids_to_text(tokenizer, ids: list[int], text: str) -> list[Optional[tuple[int, int]]]:
    """Character span in ``text`` of each id, or None where the ids leave the canonical
    tokenization of ``text`` (a non-canonical merge the model produced, eos, text past a stop).
    """
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    canonical, offsets = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    spans: list[Optional[tuple[int, int]]] = [None] * len(ids)
    if list(ids[: len(canonical)]) == list(canonical):
        spans[: len(canonical)] = offsets
        return spans
    matcher = difflib.SequenceMatcher(None, list(ids), list(canonical), autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        spans[a : a + size] = offsets[b : b + size]
    return spans


def cut_segment(
    *,
    cache,
    slot_positions: torch.Tensor,
    rotator: RopeRotator,
    start: int,
    token_ids: list[int],
    char_spans: list[Optional[tuple[int, int]]],
    text: str,
    kind: Kind,
    model_fingerprint: str,
) -> KVSegment:
    """Copy prompt positions ``start .. start + len(token_ids)`` out of ``cache`` as a segment.

    Keys are de-rotated by ``-start`` so the segment's first token sits at position 0.
    """
    positions = torch.arange(start, start + len(token_ids))
    keys, values = kv_at_positions(cache, slot_positions, positions)
    keys = [rotator.shift(k, -start) for k in keys]
    return KVSegment.create(
        kind=kind,
        text=text,
        token_ids=token_ids,
        char_spans=char_spans,
        keys=keys,
        values=values,
        model_fingerprint=model_fingerprint,
    )


def message_kind(message: dict) -> Optional[Kind]:
    """Kind of a user or tool message's segment; None for other roles (not captured)."""
    role = message.get("role")
    if role == "user":
        return ("user", None)
    if role == "tool":
        return (str(message.get("name") or message.get("tool_call_id") or "tool"), "tool")
    return None
