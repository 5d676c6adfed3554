"""KVCOMM's shareability gate (the paper's entropy rule) for one segment and one receiver.

The receiver's anchors of the segment's kind that are at least as long as the segment and hold
its offsets are *consulted*. With ``p = softmax(-||V_new - V_i||)`` over their base values, the
segment is reused with estimated offsets when ``H(p) <= gamma * log2 N`` (the paper), otherwise it
is prefilled and becomes a new anchor. Fewer than ``min_anchors`` (and always fewer than two)
consulted anchors also means "new anchor". A receiver that recorded this very segment reuses it
with its own offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..kv.segments import KVSegment
from .pool import AnchorPool

__all__ = ["GateVerdict", "entropy_score", "judge"]


@dataclass
class GateVerdict:
    """The shareability decision for one segment and receiver.

    Attributes:
        reuse: True to reuse the segment with estimated offsets.
        anchors: length-compatible anchors holding this receiver's offsets (consulted).
        entropy: the paper's score ``H / log2 N`` (None with fewer than two anchors).
        score: the score compared with ``gamma`` (None when the gate could not score).
        weights: ``[N]`` softmax over the consulted anchors' value distances.
        candidates: ``[N]`` their slots.
        own_offsets: the receiver recorded this very segment and reuses its own offsets.
        source: the receiver whose recorded offsets of this very segment are reused (its own,
            or another's whose context matches the new prompt better than the base's,
            :mod:`.versions`); None where offsets are estimated from other anchors.
        base_fits: the segment's own KV was computed after the same text as here
            (:mod:`.versions`): reused as it is, no offsets.
        context_matched: chosen by :mod:`.versions` (its context matches the new prompt's).
        over_budget: the gate let it through, but audits measured this receiver's calls with
            this kind's estimated offsets above ``kl_budget`` (:mod:`.tracker`): prefilled.
        offsets_on: the estimated offsets are applied (False: the audits measured that this
            kind's offsets hurt this receiver, :mod:`.tracker`; the segment is re-rotated only).
        rerotated: the gate would have computed it (new anchor, over the budget), but re-rotation
            alone was measured within the KL budget for this receiver (:mod:`.tracker`): reused
            re-rotated, no offsets.
    """

    reuse: bool
    anchors: int
    entropy: Optional[float] = None
    score: Optional[float] = None
    weights: Optional[torch.Tensor] = None
    candidates: Optional[torch.Tensor] = None
    own_offsets: bool = False
    offsets_on: bool = True
    source: Optional[str] = None
    base_fits: bool = False
    over_budget: bool = False
    context_matched: bool = False
    rerotated: bool = False

    @property
    def from_version(self) -> bool:
        """Reused as a version computed after the same text (:mod:`.versions`): no estimate, and
        its context checked (unlike the receiver's own offsets found by the gate alone)."""
        return self.context_matched


def entropy_score(distances: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The paper's gate score: ``p = softmax(-d)``, ``H = -sum p log2 p``, score ``H / log2 N``.

    Args:
        distances: ``[N]`` float32, ``N >= 2``.

    Returns:
        ``(score in [0, 1], p)``.
    """
    p = torch.softmax(-distances.double(), dim=0)
    entropy = float(-(p * torch.log2(p.clamp_min(1e-300))).sum())
    return entropy / math.log2(distances.numel()), p.float()


def judge(pool: Optional[AnchorPool], receiver: str, segment: KVSegment, *, gamma: float,
          min_anchors: int) -> GateVerdict:
    """Reuse ``segment`` for ``receiver`` with estimated offsets, or make it a new anchor."""
    if pool is None:
        return GateVerdict(False, 0)
    own = pool.slot_of(segment.id)
    if own is not None:
        stack = pool.placeholder.get(receiver)
        if stack is not None and own < stack.has.numel() and bool(stack.has[own]):
            # the receiver recorded this very segment: its own offsets, weight 1
            return GateVerdict(True, 1, score=0.0, weights=torch.ones(1), candidates=torch.tensor([own]), own_offsets=True,
                               source=receiver)
    slots = pool.candidates(receiver, segment.num_tokens, exclude=own)
    verdict = GateVerdict(False, int(slots.numel()), candidates=slots)
    if slots.numel() == 0:
        return verdict
    _, values = segment.kv.upper_layers()
    distances = pool.value_distances(values, slots)
    if slots.numel() >= 2:
        verdict.entropy, verdict.weights = entropy_score(distances)
    else:
        verdict.weights = torch.ones(1)
    if slots.numel() < min_anchors or slots.numel() < 2:
        return verdict
    verdict.score = verdict.entropy
    verdict.reuse = verdict.entropy <= gamma
    return verdict
