"""Typed results of planning one call: what is reused exactly, what is re-rotated, what is computed.

A :class:`CallPlan` is built once by the planner and never changed afterwards (frozen
dataclasses, tuples); a baseline that wants another plan (the benchmark's CacheBlend-style
recompute) derives a new one with ``dataclasses.replace``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from .kv.segments import KVSegment, SegmentRef
from .kv.store import PrefixEntry

if TYPE_CHECKING:  # anchors build on plans: a runtime import would be a circle
    from .anchors.gate import GateVerdict

__all__ = [
    "SegmentDecision", "GateRecord", "ReusedRun", "Observation", "OwnTextPiece", "PrefixHit", "CallPlan",
    "DecisionReason", "UNSERVED_REFERENCES",
]

DecisionReason = Literal[
    "reference",  # reused: found by the message's SegmentRef
    "content",  # reused: found by its text inside a message
    "tokens",  # reused: a run of token ids an earlier call computed, found wherever it sits
    "span",  # reused: a run of an earlier prompt, in place of the short texts it holds (shared_runs="spans")
    "exact_prefix",  # reused: it lies inside the exact prefix
    "not_found",  # prefilled: the referenced segment is not in the store
    "evicted",  # prefilled: the referenced segment was evicted for the byte budget
    "not_in_prompt",  # prefilled: the message's content could not be located in the prompt
    "stale",  # prefilled: the message was edited; too little of the segment still matches
    "foreign_model",  # prefilled: the segment was computed by another model or tokenizer
    "too_short",  # prefilled: fewer than min_match_tokens ids matched
    "short_run",  # prefilled: every run of it is computed whole (recompute_short_runs, recompute_last_run, recompute_head)
    "reuse_off",  # prefilled: reuse disabled for this call or engine
    "sliding_window",  # prefilled: prompt plus reply exceed the model's sliding window
    "new_anchor",  # prefilled: the anchor gate judged it new (too few or too dissimilar anchors); recorded now
    "after_new_anchor",  # prefilled: it follows a new-anchor segment, computed densely from there
    "over_kl_budget",  # prefilled: audits measured this receiver's calls with estimated offsets of this kind above kl_budget; recorded now
    "exact_only",  # prefilled: method="exact_prefix"; only exact prefixes are reused
    "calibration",  # prefilled: engine.calibrate / calibrating(): computed densely and recorded as an anchor
    "bad_reference",  # prefilled: the message's segment reference is malformed (another version, hand-written)
    "after_hole",  # prefilled: an engine without holes (vLLM) computes everything after the first computed token
    "dense_tail",  # prefilled: an engine without holes computes the prompt's last tokens (claims.DENSE_TAIL)
    "little_reuse",  # prefilled: the plan reused too little of the prompt to pay for its masked forward (prefill_cost)
]


class GateRecord(BaseModel):
    """The anchor gate's verdict on one segment for one receiver (``method="kvcomm"`` only)."""

    model_config = ConfigDict(frozen=True)

    decision: Literal["reuse", "new_anchor"]
    anchors: int = Field(description="Length-compatible anchors holding this receiver's offsets (consulted).")
    score: Optional[float] = Field(default=None, description="The score the gate compared with its threshold.")
    entropy: Optional[float] = Field(default=None, description="The paper's H / log2 N over the consulted anchors.")
    offsets: Optional[Literal["estimated", "own", "recorded", "framed", "base", "off", "rerotated"]] = Field(
        default=None,
        description="With decision 'reuse': 'estimated' from the anchors, 'own' (the receiver recorded this very "
        "segment), 'recorded' (another receiver recorded this very segment after the same text as this "
        "prompt has before it), 'framed' (the sender recorded this reply after the text its readers put "
        "before it, or the first reader of shared text recorded it after this reader's own prefix: "
        "kvcomm_agents.framing, kvcomm_agents.framing.texts), 'base' (the segment's own KV was computed after the same text: no "
        "offsets), 'off' (re-rotated only: audits measured that this kind's offsets hurt this receiver, or a "
        "KL-budget probe of a kind not measured yet), or 'rerotated' (the gate would have computed it, but "
        "re-rotation alone was measured within kl_budget for this receiver: kvcomm_agents.anchors.tracker; "
        "never a reply unless experimental.rerotate_replies).")


#: Reasons a message's segment could not be served from this store: the message is new text here.
UNSERVED_REFERENCES = frozenset({"not_found", "evicted", "foreign_model", "bad_reference"})

class SegmentDecision(BaseModel):
    """What the engine did with one shared segment found in a prompt."""

    model_config = ConfigDict(frozen=True)

    segment: Optional[SegmentRef] = Field(description="The segment (None if only its id was known).")
    segment_id: str
    message_index: int = Field(description="Index of the message it was found in (-1: outside any message's content).")
    found_by: Literal["reference", "content", "tokens", "span"] = Field(
        default="content", description="By the message's segment reference, by the segment's whole text, "
        "as a run of token ids shared with any earlier call (prompt or reply) wherever it sits, or as a "
        "run of an earlier prompt holding short texts found here (shared_runs='spans').")
    span: tuple[int, int] = Field(description="Token span [start, end) in the prompt.")
    status: Literal["reused", "prefilled"]
    reason: DecisionReason
    reused_tokens: int = Field(default=0, description="Prompt tokens served from this segment.")
    gate: Optional[GateRecord] = Field(default=None, description="The anchor gate's verdict, if it ran.")


@dataclass(frozen=True)
class ReusedRun:
    """A run of prompt tokens served from a stored segment, re-rotated to its new position.

    Prompt positions ``prompt_start .. prompt_start + length`` take the segment's tokens
    ``segment_start .. segment_start + length`` (same ids).
    """

    segment: KVSegment
    prompt_start: int
    segment_start: int
    length: int
    key_offsets: Optional[torch.Tensor] = None  # [L-1, kv_heads, length, head_dim]: layers 1..L-1, canonical frame
    value_offsets: Optional[torch.Tensor] = None
    own_text: bool = False  # a piece of the receiver's own text, not a shared segment
    verdict: Optional["GateVerdict"] = None  # the anchor gate's verdict (offsets are estimated from it)
    offsets_on: bool = True  # apply key_offsets/value_offsets (False: kept only for an audit's flipped pass)
    head: int = 0  # segment tokens right before the run computed in context (KVCommConfig.recompute_head)
    tail: int = 0  # segment tokens right after the run computed in context (KVCommConfig.recompute_tail)
    skipped: int = 0  # prompt ids before those, computed as part of the run: leading whitespace a version leaves out (planner._at_home)

    @property
    def found_start(self) -> int:
        """Prompt position where the occurrence this run serves was found (its computed head
        and skipped whitespace included)."""
        return self.prompt_start - self.head - self.skipped

    @property
    def prompt_end(self) -> int:
        return self.prompt_start + self.length

    @property
    def shift(self) -> int:
        """Rotation that moves the canonical-frame keys to their prompt positions."""
        return self.prompt_start - self.segment_start


@dataclass(frozen=True)
class Observation:
    """Segment tokens the receiver computes itself in this call (same ids as the segment's):
    where the context before them is exact, their real KV minus the segment's base KV is an
    offset observation (recorded after the call)."""

    segment: KVSegment
    prompt_start: int
    segment_start: int
    length: int

    @property
    def reaches_end(self) -> bool:
        """Whether the observed tokens run to the segment's last token."""
        return self.segment_start + self.length == self.segment.num_tokens


@dataclass(frozen=True)
class OwnTextPiece:
    """The receiver's own text right after a shared segment, up to the next segment or the last
    prompt token: prompt positions ``start .. end``, ids keyed by ``key``.

    ``reused``: served from the agent's own-text KV. ``observed``: the segment before it was
    computed in this call (its own-text offsets can be recorded if the context is exact)."""

    start: int
    end: int
    key: str
    token_ids: tuple[int, ...]
    after: KVSegment
    reused: bool = False
    observed: bool = False


@dataclass(frozen=True)
class PrefixHit:
    """The first ``length`` prompt tokens are served, exactly, from a stored prefix."""

    entry: PrefixEntry
    length: int


@dataclass(frozen=True)
class CallPlan:
    """How one prompt is prefilled.

    Attributes:
        prompt_ids: ``[N]`` int64 on the CPU, exactly the chat template's ids.
        prefix: exact-prefix hit, or None.
        runs: re-rotated runs, sorted, disjoint, all after the prefix and before the last token.
        decisions: one per shared segment found.
        dense_reason: why the call runs fully dense, or None.
        observations: matched segment tokens computed in this call (offset observations).
        pieces: own-text pieces after shared segments (reused or to be recorded).
        recompute: ``[r]`` int64 sorted prompt positions inside runs that are computed in the
            prefill instead of reused (set by a plan hook, e.g. the benchmark's CacheBlend-style
            baseline), or None.
    """

    prompt_ids: torch.Tensor
    prefix: Optional[PrefixHit] = None
    runs: tuple[ReusedRun, ...] = ()
    decisions: tuple[SegmentDecision, ...] = ()
    dense_reason: Optional[str] = None
    observations: tuple[Observation, ...] = ()
    pieces: tuple[OwnTextPiece, ...] = ()
    recompute: Optional[torch.Tensor] = None

    @property
    def num_prompt(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def prefix_length(self) -> int:
        return self.prefix.length if self.prefix else 0

    @property
    def reused_tokens(self) -> int:
        recomputed = 0 if self.recompute is None else int(self.recompute.numel())
        return self.prefix_length + sum(run.length for run in self.runs) - recomputed

    @property
    def own_text_tokens(self) -> int:
        """Reused tokens that are the receiver's own text."""
        return sum(run.length for run in self.runs if run.own_text)

    def computed_positions(self) -> torch.Tensor:
        """``[Q]`` int64 positions the model computes (everything not reused), ascending."""
        keep = torch.ones(self.num_prompt, dtype=torch.bool)
        keep[: self.prefix_length] = False
        for run in self.runs:
            keep[run.prompt_start : run.prompt_end] = False
        if self.recompute is not None:
            keep[self.recompute] = True
        return keep.nonzero().flatten()

    def storage_positions(self) -> torch.Tensor:
        """``[P + sum of run lengths]`` int64 prompt positions of the assembled reused KV, in
        storage order (the exact prefix, then each run), recomputed positions included."""
        return torch.cat([torch.arange(self.prefix_length)]
                         + [torch.arange(run.prompt_start, run.prompt_end) for run in self.runs])

    def reused_positions(self) -> torch.Tensor:
        """``[R]`` int64 prompt positions of the reused slots, in storage order (the exact prefix,
        then each run), recomputed positions left out."""
        positions = self.storage_positions()
        if self.recompute is not None:
            positions = positions[~torch.isin(positions, self.recompute)]
        return positions

    def reused_spans(self) -> list[tuple[int, int]]:
        """The reused prompt positions (:meth:`reused_positions`) as ascending, disjoint
        ``[start, end)`` spans."""
        positions = torch.sort(self.reused_positions()).values
        if positions.numel() == 0:
            return []
        breaks = (torch.diff(positions) != 1).nonzero().flatten()  # a span ends after each break
        starts = torch.cat([positions[:1], positions[breaks + 1]]).tolist()
        ends = torch.cat([positions[breaks] + 1, positions[-1:] + 1]).tolist()
        return list(zip(starts, ends))

    def first_rerotated(self) -> int:
        """Prompt position of the first re-rotated token (``N`` if none): KV before it is exact."""
        return self.runs[0].prompt_start if self.runs else self.num_prompt

    def first_estimated(self) -> int:
        """Prompt position of the first reused token that is not from a recorded version of its
        segment (``N`` if none): offsets a pass shows before it are recorded as anchors. A
        recorded version's KV is what its receiver computed after the same text, as near to
        exact as offsets get (relative error 0.001-0.08 measured, :mod:`~kvcomm_agents.versions.match`),
        so the segments after it are recorded too."""
        for run in self.runs:
            if run.own_text or not getattr(run.verdict, "from_version", False):
                return run.prompt_start
        return self.num_prompt

    def estimated_kinds(self) -> list:
        """Kinds of the shared runs that carry estimated offsets (applied or not), in prompt
        order: the kinds an audit can flip (:meth:`with_offsets_flipped`)."""
        kinds = [tuple(run.segment.ref.kind) for run in self.runs if _estimated(run)]
        return list(dict.fromkeys(kinds))

    def with_offsets_flipped(self, kind) -> "CallPlan":
        """The same plan with the estimated offsets of ``kind``'s runs switched (applied where
        they were not, dropped where they were): an audit's second, paired pass."""
        kind = tuple(kind)
        runs = tuple(replace(run, offsets_on=not run.offsets_on)
                     if _estimated(run) and tuple(run.segment.ref.kind) == kind else run for run in self.runs)
        return replace(self, runs=runs)

    def offsets_applied(self, kind) -> bool:
        """Whether the estimated offsets of ``kind``'s runs are applied in this plan."""
        kind = tuple(kind)
        return any(run.offsets_on for run in self.runs if _estimated(run) and tuple(run.segment.ref.kind) == kind)

    def computed_whole(self, reason: str) -> "CallPlan":
        """The same prompt computed whole in one causal forward (``dense_reason=reason``): the
        exact prefix and the reused runs are computed again, the runs as observations (their
        context is exact there), and the decisions that reused say ``reason``."""
        observed = self.as_observed()
        decisions = tuple(d.model_copy(update={"status": "prefilled", "reason": reason, "reused_tokens": 0})
                          if d.status == "reused" else d for d in self.decisions)
        observations = tuple(sorted(self.observations + observed.observations, key=lambda o: o.prompt_start))
        return CallPlan(self.prompt_ids, decisions=decisions, dense_reason=reason, observations=observations,
                        pieces=observed.pieces)

    def as_observed(self) -> "CallPlan":
        """The same prompt as if computed densely: every reused shared run becomes an observation
        (its computed tail too, so a slot recorded from it spans the segment to its end) and
        every own-text piece an observed, computed one (what an audit's dense pass saw)."""
        return CallPlan(
            self.prompt_ids,
            observations=tuple(Observation(r.segment, r.prompt_start, r.segment_start, r.length + r.tail)
                               for r in self.runs if not r.own_text),
            pieces=tuple(replace(p, reused=False, observed=True) for p in self.pieces),
        )


def _estimated(run: ReusedRun) -> bool:
    """A shared run whose offsets are an estimate: from other anchors, or the receiver's own
    offsets of the segment recorded after other text than here (anything but a recorded version
    whose context matched, :mod:`~kvcomm_agents.versions.match`)."""
    return (not run.own_text and run.key_offsets is not None and run.verdict is not None
            and not getattr(run.verdict, "context_matched", False))
