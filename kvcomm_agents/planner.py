"""Plan one call: find shared segments in the prompt and decide, per segment, reuse or prefill.

Order of business:

1. the longest exact prefix the store holds (any earlier prompt plus its reply) is reused as is;
2. each message's shared text is found by its ``SegmentRef`` or verbatim by content, and located
   as runs of the prompt's own ids (a token matches when its id and its character offset inside
   the shared text agree with the segment's); edge tokens that tokenize differently in context
   do not match and are computed;
3. runs of at least ``min_match_tokens`` after the prefix (and before the last prompt token, whose
   logits start the reply) are re-rotated; everything else is computed;
4. with KVCOMM offsets, each segment first passes the anchor gate: a segment judged new is
   computed, and so is everything after it (its context stays exact, so its offsets and those
   after it can be recorded); reused segments get offsets estimated from the anchors;
5. with template reuse, the receiver's own text after a reused segment comes from its template KV
   (plus the estimated prefix offsets) when the agent has computed that piece before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .cache.anchors import AnchorRegistry, OffsetEstimate
from .cache.segments import KVSegment, SegmentRef
from .cache.store import SegmentStore
from .cache.templates import TemplateStore, piece_key
from .config import KVCommConfig
from .plan import CallPlan, GateRecord, Observation, PrefixHit, ReusedRun, SegmentDecision, TemplatePiece
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
    anchors: Optional[AnchorRegistry] = None,
    templates: Optional[TemplateStore] = None,
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
        agent: the receiving agent (anchors and templates are per receiver).
        anchors: the anchor pools; used when ``config.offsets`` is not ``"none"``.
        templates: the agents' template KV; used when ``config.template == "reuse"``.
    """
    plan = CallPlan(layout.ids)
    n = plan.num_prompt
    if refuse_reason is None and config.prefix_cache and n > 1:
        hit = store.longest_prefix(layout.ids, model)
        if hit is not None:
            plan.prefix = PrefixHit(hit[0], min(hit[1], n - 1))
    use_anchors = config.offsets != "none" and config.segment_reuse
    deciding = _RunDecider(plan, layout, config, agent, anchors if use_anchors else None)
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
    if refuse_reason is None:
        _plan_templates(plan, agent, config, templates if config.template == "reuse" else None)
        deciding.estimate_offsets()
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


def _plan_templates(plan: CallPlan, agent: str, config: KVCommConfig, templates: Optional[TemplateStore]) -> None:
    """Find the template piece after each segment that runs to its last token: the text up to the
    next shared segment (reused or observed) or the last prompt token. Reuse it from the agent's
    template KV when there is one (``templates`` given)."""
    n = plan.num_prompt
    ends = [(run.prompt_start, run.prompt_end, run, None) for run in plan.runs]
    ends += [(seen.prompt_start, seen.prompt_start + seen.length, None, seen) for seen in plan.observations]
    ends.sort(key=lambda item: item[0])
    new_runs = []
    for i, (_, end, run, seen) in enumerate(ends):
        segment = run.segment if run is not None else seen.segment
        if run is not None and run.segment_start + run.length != segment.num_tokens:
            continue
        if seen is not None and not seen.reaches_end:
            continue
        stop = ends[i + 1][0] if i + 1 < len(ends) else n - 1
        if stop <= end:
            continue
        ids = tuple(plan.prompt_ids[end:stop].tolist())
        piece = TemplatePiece(end, stop, piece_key(ids), ids, segment, observed=seen is not None)
        plan.pieces.append(piece)
        if run is None or templates is None or stop - end < 1:
            continue
        kv = templates.get(agent, piece.key)
        if kv is not None and kv.num_tokens == stop - end:
            piece.reused = True
            new_runs.append(ReusedRun(kv, end, 0, stop - end, template=True, verdict=run.verdict))
    plan.runs = sorted(plan.runs + new_runs, key=lambda r: r.prompt_start)


class _RunDecider:
    """Turns matched runs into reused runs or observations, occurrence by occurrence, in prompt
    order. Once a new-anchor segment is met, everything after it is computed (dense from there),
    so its context stays exact: it and every segment after it are recorded as anchors (computing
    them costs the same either way, and each observation is data for the next gate)."""

    def __init__(self, plan: CallPlan, layout: PromptLayout, config: KVCommConfig, agent: str,
                 anchors: Optional[AnchorRegistry]):
        self.plan, self.layout, self.config, self.agent, self.anchors = plan, layout, config, agent, anchors
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
        verdict = None
        if beyond_prefix and not self.config.segment_reuse:
            decision.reason = "exact_only"
            decision.reused_tokens = in_prefix  # status stays "prefilled": the rest is computed
            return
        if beyond_prefix and self.anchors is not None:
            if self.dense_from is not None:
                decision.reason = "after_new_anchor"
            else:
                verdict = self.anchors.judge(self.agent, occ.segment)
                decision.gate = GateRecord(
                    decision="reuse" if verdict.reuse else "new_anchor", anchors=verdict.anchors,
                    score=verdict.score, entropy=verdict.entropy, error=verdict.error,
                )
                if not verdict.reuse:
                    decision.reason = "new_anchor"
            if decision.reason in ("after_new_anchor", "new_anchor"):
                self.dense_from = min(self.dense_from if self.dense_from is not None else n, beyond_prefix[0][0])
                for p, s, length in beyond_prefix:
                    self.plan.observations.append(Observation(occ.segment, p, s, min(length, n - 1 - p)))
                decision.reused_tokens = in_prefix  # status stays "prefilled": the rest is computed
                return
        for p, s, length in beyond_prefix:
            length = min(length, n - 1 - p)
            if length > 0:
                self.plan.runs.append(ReusedRun(occ.segment, p, s, length, verdict=verdict))
                decision.reused_tokens += length
        decision.reused_tokens += in_prefix
        if decision.reused_tokens:
            decision.status = "reused"
            if decision.reused_tokens == in_prefix:
                decision.reason = "exact_prefix"
        else:
            decision.reason = "too_short"

    def estimate_offsets(self) -> None:
        """Attach estimated offsets to every reused run (once per segment); template runs get the
        prefix offsets of the segment before them, or are computed if the anchors hold none."""
        if self.anchors is None:
            return
        estimates: dict[str, OffsetEstimate] = {}
        pieces = {piece.start: piece for piece in self.plan.pieces if piece.reused}
        kept = []
        for run in self.plan.runs:
            if run.verdict is None:
                kept.append(run)
                continue
            if not run.template:
                cap = self.config.offset_max_error
                if cap is not None and run.verdict.error is not None and run.verdict.error >= cap:
                    kept.append(run)  # its estimates measured worse than none: re-rotation only
                    continue
                est = estimates.get(run.segment.id)
                if est is None:
                    after = [p for p in self.plan.pieces if p.after is run.segment and p.reused]
                    est = self.anchors.estimate(self.agent, run.segment, run.verdict, after[0].key if after else None)
                    estimates[run.segment.id] = est
                end = run.segment_start + run.length
                run.key_offsets = est.keys[:, :, run.segment_start:end]
                run.value_offsets = est.values[:, :, run.segment_start:end]
                kept.append(run)
                continue
            piece = pieces[run.prompt_start]
            est = estimates.get(piece.after.id)
            if est is None or est.prefix_keys is None:
                piece.reused = False  # no prefix offsets for this piece yet: compute it
                continue
            run.key_offsets = est.prefix_keys[:, :, : run.length]
            run.value_offsets = est.prefix_values[:, :, : run.length]
            kept.append(run)
        self.plan.runs = kept
