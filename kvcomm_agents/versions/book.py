"""The owner of recorded versions: which version of a segment's KV fits a new context
(:func:`~.match.best_recorded_version`), and recording, inspecting and forgetting them.

A version's offsets live in the anchor pools (a recorded version is a receiver's offsets of an
anchor, :class:`~kvcomm_agents.anchors.pool.AnchorPool`), under the anchors' byte budget and
lock; this class owns the rules of versions on top: the context match, the framed
pseudo-receivers' homes, the tokenizer's texts a context is compared as.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..anchors import GateVerdict, KVCommAnchors
from ..anchors.kvcomm import offsets
from ..kv.block import KVBlock
from ..kv.rope import RopeRotator
from ..kv.segments import KVSegment
from .match import VersionHomes, best_recorded_version
from .token_texts import TokenTexts

__all__ = ["Versions"]


class Versions:
    """Recorded versions of segments, kept in ``anchors``' pools.

    Args:
        anchors: the engine's :class:`~kvcomm_agents.anchors.KVCommAnchors` (their pools hold
            the versions' offsets, under their budget).
        enabled: reuse versions before the gate (off: KVCOMM as in the paper).
        token_texts: the tokenizer's id texts: contexts compared as text, the same text split
            into other ids still matching (None compares ids).
    """

    def __init__(self, anchors: KVCommAnchors, *, enabled: bool = True,
                 token_texts: Optional[TokenTexts] = None) -> None:
        self.anchors, self.enabled, self.token_texts = anchors, enabled, token_texts
        self.homes = VersionHomes()  # where partial versions of short texts were recorded

    @classmethod
    def from_config(cls, config, anchors: KVCommAnchors, tokenizer=None) -> "Versions":
        """The versions a :class:`~kvcomm_agents.config.KVCommConfig` asks for; with
        ``tokenizer`` (and ``method="kvcomm"``), contexts are compared as its text."""
        texts = TokenTexts.of(tokenizer) if tokenizer is not None and config.method == "kvcomm" else None
        return cls(anchors, enabled=config.recorded_versions, token_texts=texts)

    def clear(self) -> None:
        self.homes.clear()

    @torch.inference_mode()  # pool tensors are inference tensors, whoever calls
    def recorded(self, receiver: str, segment: KVSegment, tokens: Optional[tuple[int, int]],
                 context: Sequence[int], held: int = 0) -> Optional[GateVerdict]:
        """A reuse verdict with the version of ``segment`` (its base, or a receiver's recorded
        offsets) whose context fits ``context`` (the prompt's ids before segment token
        ``tokens[0]``, of which the last ``held`` are the segment's own: a recomputed head)
        longest, or None when none fits (:mod:`.match`; also None when disabled)."""
        if not self.enabled or tokens is None:
            return None
        with self.anchors.lock:
            version = best_recorded_version(self.anchors.pool(segment.ref.kind), receiver, segment, tokens[0],
                                            tokens[1], context, self.token_texts.matched if self.token_texts else None,
                                            held)
        if version is None:
            return None
        if version.receiver is None:
            return GateVerdict(True, 0, score=0.0, base_fits=True, context_matched=True)
        return GateVerdict(True, 1, score=0.0, weights=torch.ones(1), candidates=torch.tensor([version.slot]),
                           own_offsets=version.receiver == receiver, source=version.receiver, context_matched=True)

    @torch.inference_mode()
    def record(self, receiver: str, segment: KVSegment, real: KVBlock, prompt_start: int,
               context: tuple[int, ...], rotator: RopeRotator, min_match: int = 0, segment_start: int = 0) -> bool:
        """Record ``real`` (``n`` tokens of ``segment`` from token ``segment_start``, all of them
        by default; keys at prompt positions ``prompt_start..+n``, computed after the ids
        ``context``) as ``receiver``'s version of those tokens, reused only where a prompt shares
        at least ``min_match`` ids of that context (:mod:`kvcomm_agents.framing`). Returns whether
        it was recorded (not inside ``freeze_anchors``)."""
        if self.anchors.frozen:
            return False
        keys, values = offsets(real, segment.kv, prompt_start - segment_start, segment_start, rotator)
        self.anchors.record_offsets(receiver, segment, segment_start, keys, values, context, min_match)
        return True

    def span(self, receiver: str, segment: KVSegment) -> Optional[tuple[int, int]]:
        """The segment tokens ``(start, end)`` of ``receiver``'s recorded version of ``segment``
        ((0, 0) for offsets whose context is unknown), or None when it holds none."""
        with self.anchors.lock:
            stack, slot = self._stack(receiver, segment)
            if stack is None or slot >= stack.has.numel() or not bool(stack.has[slot]):
                return None
            context = stack.contexts.get(slot)
            return (0, 0) if context is None else (context.start, context.end)

    def forget(self, receiver: str, segment: KVSegment) -> None:
        """Drop ``receiver``'s recorded offsets of ``segment`` (the slot stays an anchor)."""
        with self.anchors.lock:
            stack, slot = self._stack(receiver, segment)
            if stack is not None:
                stack.clear_slot(slot)

    def _stack(self, receiver: str, segment: KVSegment):
        """``(receiver's offset stack in the segment's pool, the segment's slot)``; the stack is
        None when the pool, the slot or the receiver's stack is missing."""
        pool = self.anchors.pool(segment.ref.kind)
        slot = pool.slot_of(segment.id) if pool is not None else None
        stack = pool.placeholder.get(receiver) if slot is not None else None
        return stack, slot
