"""Plan one call: find shared segments in the prompt and decide, per segment, reuse or prefill.

Order of business:

1. the longest exact prefix the store holds (any earlier prompt plus its reply) is reused as is;
2. each message's shared text is found by its ``SegmentRef`` or verbatim by content, and located
   as runs of the prompt's own ids (a token matches when its id and its character offset inside
   the shared text agree with the segment's); edge tokens that tokenize differently in context
   do not match and are computed;
3. runs of at least ``min_match_tokens`` after the prefix (and before the last prompt token, whose
   logits start the reply) are re-rotated; everything else is computed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .cache.offsets import OffsetPool
from .cache.segments import KVSegment, SegmentRef
from .cache.store import SegmentStore
from .config import KVCommConfig
from .plan import CallPlan, Observation, PrefixHit, ReusedRun, SegmentDecision
from .prompt import PromptLayout

__all__ = ["plan_call", "match_runs"]

logger = logging.getLogger("kvcomm_agents")


@dataclass
class _Occurrence:
    """Shared text located in one message: characters ``[start, start + limit)`` of the prompt
    text hold the segment's characters ``[0, limit)``."""

    message_index: int
    segment: Optional[KVSegment]
    segment_id: str
    ref: Optional[SegmentRef]
    start: int = 0
    limit: int = 0
    found_by: str = "content"
    failure: Optional[str] = None
    edited: bool = False


def match_runs(
    layout: PromptLayout, segment: KVSegment, start: int, limit: int
) -> list[tuple[int, int, int]]:
    """Runs of prompt tokens that are the segment's own tokens.

    Args:
        layout: the prompt.
        segment: the stored segment.
        start: character offset in ``layout.text`` where the segment's text begins.
        limit: only the segment's characters ``[0, limit)`` may match (less than its length when
            the message was edited after the segment was made).

    Returns:
        ``(prompt_start, segment_start, length)`` for each maximal run of consecutive matches.
    """
    runs: list[list[int]] = []
    for j in layout.tokens_within(start, start + limit):
        s, e = layout.offsets[j]
        i = segment.index_of(s - start, int(layout.ids[j]))
        if i is None or segment.char_spans[i][1] != e - start:
            continue
        if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == i:
            runs[-1][2] += 1
        else:
            runs.append([j, i, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _common_prefix_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _locate_reference(
    index: int, message: Mapping[str, Any], layout: PromptLayout, store: SegmentStore, model: str
) -> _Occurrence:
    ref = SegmentRef.coerce(message["segment"])
    occ = _Occurrence(index, None, ref.id, ref, found_by="reference")
    if ref.model != model:
        occ.failure = "foreign_model"
        return occ
    segment = store.get(ref.id)
    if segment is None:
        occ.failure = "evicted" if store.was_evicted(ref.id) else "not_found"
        return occ
    occ.segment = segment
    span = layout.content_spans[index]
    if span is None:
        occ.failure = "not_in_prompt"
        return occ
    content = message["content"]
    offset = content.find(segment.text)
    if offset >= 0:
        occ.start, occ.limit = span[0] + offset, len(segment.text)
    else:
        occ.start, occ.limit = span[0], _common_prefix_chars(segment.text, content)
        occ.edited = True
    return occ


def _find_occurrences(
    messages: Sequence[Mapping[str, Any]], layout: PromptLayout, store: SegmentStore, model: str
) -> list[_Occurrence]:
    found = []
    for index, message in enumerate(messages):
        if message.get("segment") is not None:
            found.append(_locate_reference(index, message, layout, store, model))
            continue
        span = layout.content_spans[index]
        if span is None:
            continue
        for segment, offset in store.find_in_text(message["content"], model, min_chars=2):
            found.append(
                _Occurrence(index, segment, segment.id, segment.ref, span[0] + offset, len(segment.text))
            )
    return found


def plan_call(
    layout: PromptLayout,
    messages: Sequence[Mapping[str, Any]],
    *,
    store: SegmentStore,
    model: str,
    config: KVCommConfig,
    refuse_reason: Optional[str] = None,
    agent: str = "default",
    offsets: Optional[OffsetPool] = None,
) -> CallPlan:
    """Plan the prefill of one prompt.

    Args:
        layout: the receiver's tokenized prompt.
        messages: the messages it was rendered from (with their optional ``segment`` refs).
        store: where segments and exact prefixes live.
        model: the engine's model fingerprint.
        config: the engine's settings.
        refuse_reason: if set (``"reuse_off"``, ``"sliding_window"``), nothing is reused and every
            segment found is reported as prefilled for this reason.
        agent: the receiving agent (offsets are learned per receiver).
        offsets: learned offsets; with ``config.offsets == "mean"`` reused runs carry estimates,
            and kinds with fewer than ``min_anchors`` observations are prefilled (new anchors).
    """
    plan = CallPlan(layout.ids)
    n = plan.num_prompt
    if refuse_reason is None and config.prefix_cache and n > 1:
        hit = store.longest_prefix(layout.ids, model)
        if hit is not None:
            plan.prefix = PrefixHit(hit[0], min(hit[1], n - 1))
    deciding = _RunDecider(plan, layout, config, agent, offsets if config.offsets == "mean" else None)
    for occ in _find_occurrences(messages, layout, store, model):
        tokens = layout.tokens_within(occ.start, occ.start + occ.limit)
        decision = SegmentDecision(
            segment=occ.ref,
            segment_id=occ.segment_id,
            message_index=occ.message_index,
            span=(tokens.start, tokens.stop) if len(tokens) else _message_tokens(layout, occ),
            status="prefilled",
            reason=refuse_reason or occ.failure or occ.found_by,
        )
        if refuse_reason is None and occ.failure is None:
            deciding.decide(occ, decision)
        plan.decisions.append(decision)
        logger.debug("segment %s: %s (%s)", occ.segment_id, decision.status, decision.reason)
    plan.runs.sort(key=lambda run: run.prompt_start)
    if refuse_reason is not None:
        plan.dense_reason = refuse_reason
    elif plan.reused_tokens == 0:
        plan.dense_reason = "nothing_to_reuse"
    return plan


def _message_tokens(layout: PromptLayout, occ: _Occurrence) -> tuple[int, int]:
    span = layout.content_spans[occ.message_index]
    if span is None:
        return (0, 0)
    tokens = layout.tokens_within(*span)
    return (tokens.start, tokens.stop)


class _RunDecider:
    """Turns matched runs into reused runs or observations, occurrence by occurrence, in prompt
    order. Once a new-anchor segment is met, everything after it is computed (dense from there),
    so its context stays exact and the observations after it can be recorded too."""

    def __init__(self, plan: CallPlan, layout: PromptLayout, config: KVCommConfig, agent: str, offsets: Optional[OffsetPool]):
        self.plan, self.layout, self.config, self.agent, self.offsets = plan, layout, config, agent, offsets
        self.dense_from: Optional[int] = None

    def decide(self, occ: _Occurrence, decision: SegmentDecision) -> None:
        assert occ.segment is not None
        runs = [r for r in match_runs(self.layout, occ.segment, occ.start, occ.limit) if r[2] >= self.config.min_match_tokens]
        if not runs:
            decision.reason = "stale" if occ.edited else "too_short"
            return
        prefix_len, n = self.plan.prefix_length, self.plan.num_prompt
        beyond_prefix = [(max(p, prefix_len), s + max(p, prefix_len) - p, p + length - max(p, prefix_len))
                         for p, s, length in runs if p + length > prefix_len]
        in_prefix = sum(min(p + length, prefix_len) - p for p, s, length in runs if p < prefix_len)
        reason = self._refusal(occ, beyond_prefix)
        if reason is not None:
            decision.reason = reason
            self.dense_from = min(self.dense_from if self.dense_from is not None else n, beyond_prefix[0][0])
            for p, s, length in beyond_prefix:
                self.plan.observations.append(Observation(occ.segment, p, s, min(length, n - 1 - p)))
            decision.reused_tokens = in_prefix  # status stays "prefilled": the rest is computed
            return
        for p, s, length in beyond_prefix:
            length = min(length, n - 1 - p)
            if length > 0:
                run = ReusedRun(occ.segment, p, s, length)
                if self.offsets is not None:
                    estimate = self.offsets.estimate(self.agent, occ.segment.ref.kind, s, s + length)
                    if estimate is not None:
                        run.key_offsets, run.value_offsets = estimate
                self.plan.runs.append(run)
                decision.reused_tokens += length
        decision.reused_tokens += in_prefix
        if decision.reused_tokens:
            decision.status = "reused"
            if decision.reused_tokens == in_prefix:
                decision.reason = "exact_prefix"
        else:
            decision.reason = "too_short"

    def _refusal(self, occ: _Occurrence, beyond_prefix: list) -> Optional[str]:
        """Why this occurrence's runs after the prefix must be computed, or None."""
        if not beyond_prefix or self.offsets is None:
            return None
        if self.dense_from is not None:
            return "after_new_anchor"
        if self.offsets.anchors(self.agent, occ.segment.ref.kind) < self.config.min_anchors:
            return "new_anchor"
        return None
