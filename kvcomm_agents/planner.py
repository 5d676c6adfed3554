"""Plan one call: per shared segment found in the prompt, reuse it or compute it, and why.

Order of business:

1. the longest exact prefix the store holds (any earlier prompt plus its reply) is reused as is;
2. shared segments are found in the prompt (:mod:`.matching`): by reference or whole text per
   message, a run of an earlier prompt holding some of them with the text around them instead
   of each alone, then any other run of token ids an earlier call computed, wherever it sits;
3. runs of at least ``min_match_tokens`` after the prefix (and before the last prompt token, whose
   logits start the reply) are re-rotated, their first ``recompute_head`` ids computed in
   context (a run of at most ``recompute_short_runs`` ids is computed whole);
   everything else is computed;
4. with ``method="kvcomm"`` each segment first passes the anchor gate: a segment judged new is
   computed, and after it only recorded versions are reused, everything else computed (its
   context stays near exact, so its offsets and those after it can be recorded) unless it is
   computed whole anyway (3.); reused runs get offsets estimated from the anchors;
5. with own-text reuse (experimental), the receiver's own text after a reused segment comes from
   its own-text KV (plus the anchors' own-text offsets) when the agent computed that piece before.

The plan is built here once and frozen; nothing changes it afterwards.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

from .anchors import KVCommAnchors
from .versions import Versions, is_framed
from .config import KVCommConfig
from .kv.own_text import OwnTextStore, own_text_pieces
from .kv.segments import CONTEXT_TOKENS, KVSegment
from .kv.store import SegmentStore
from .matching import Occurrence, TokenMatch, find_shared, match_runs
from .prefill_cost import PrefillCost
from .plan import CallPlan, GateRecord, Observation, OwnTextPiece, PrefixHit, ReusedRun, SegmentDecision
from .prompt import PromptLayout
from .repairs import computed_head, cut_inside, ends_near, moved_past_its_context


__all__ = ["plan_call"]

logger = logging.getLogger("kvcomm_agents")


def plan_call(
    layout: PromptLayout,
    *,
    store: SegmentStore,
    fingerprint: str,
    config: KVCommConfig,
    agent: str = "default",
    refuse_reason: Optional[str] = None,
    anchors: Optional[KVCommAnchors] = None,
    versions: Optional[Versions] = None,
    own_texts: Optional[OwnTextStore] = None,
    calibrating: bool = False,
    prefill_cost: Optional[PrefillCost] = None,
) -> CallPlan:
    """Plan the prefill of one prompt.

    Args:
        layout: the receiver's tokenized prompt (with its messages' segment references).
        store: where segments and exact prefixes live.
        fingerprint: the engine's model fingerprint (KV of any other is never used).
        config: the engine's settings.
        agent: the receiving agent (anchors and own text are per receiver).
        refuse_reason: if set (``"reuse_off"``, ``"sliding_window"``), nothing is reused and every
            segment found is reported as prefilled for this reason.
        anchors: the anchor pools; consulted with ``method="kvcomm"``.
        versions: the recorded versions (over ``anchors``' pools); consulted with ``method="kvcomm"``.
        own_texts: the agents' own-text KV; used with ``experimental.own_text="reuse"``.
        calibrating: with ``method="kvcomm"``, compute every shared segment after the exact
            prefix (reason ``calibration``) so that all of them are recorded as anchors.
        prefill_cost: with ``config.dense_when_cheaper``, a plan whose reuse does not pay for its
            masked forward computes the prompt whole (reason ``little_reuse``), decided before
            any offsets are estimated.
    """
    n = int(layout.ids.numel())
    prefix = None
    if refuse_reason is None and config.prefix_cache and config.reuse and n > 1:
        hit = store.longest_prefix(layout.ids, fingerprint)
        if hit is not None:
            prefix = PrefixHit(hit[0], min(hit[1], n - 1))
    decider = _RunDecider(layout, prefix.length if prefix else 0, config, agent,
                          anchors if config.method == "kvcomm" else None,
                          versions if config.method == "kvcomm" else None, calibrating,
                          twins=lambda segment: store.twins(segment, fingerprint),
                          home=lambda segment_id: _held(store.get(segment_id), fingerprint))
    decisions = []
    searched = config.shared_runs if refuse_reason is None and config.reuse and config.method != "exact_prefix" \
        else "messages"
    found = find_shared(layout, store, fingerprint, prefix.length if prefix else 0, searched,
                        config.recompute_short_runs)
    for occ in found:
        if refuse_reason is None and occ.failure is None:
            occ, (status, reason, reused, gate) = decider.decide(occ)
        else:
            status, reason, reused, gate = "prefilled", refuse_reason or occ.failure, 0, None
        decisions.append(SegmentDecision(
            segment=occ.ref, segment_id=occ.segment_id, message_index=occ.message_index,
            span=occ.token_span(layout), status=status, reason=reason, reused_tokens=reused, gate=gate,
            found_by=occ.found_by,
        ))
        logger.debug("segment %s: %s (%s)", occ.segment_id, status, reason)
    runs = sorted(decider.runs, key=lambda run: run.prompt_start)
    pieces: list[OwnTextPiece] = []
    if refuse_reason is None:
        reuse_own = own_texts if config.experimental.own_text == "reuse" else None
        runs, pieces = own_text_pieces(layout.ids, runs, decider.observations, agent, reuse_own)
        plan = CallPlan(layout.ids, prefix, tuple(runs), tuple(decisions), None, tuple(decider.observations),
                        tuple(pieces))
        if (prefill_cost is not None and config.dense_when_cheaper and plan.reused_tokens
                and not prefill_cost.worth_reusing(plan)):
            return plan.computed_whole("little_reuse")
        if decider.anchors is not None:
            runs, pieces = decider.anchors.attach_offsets(agent, runs, pieces)
    plan = CallPlan(layout.ids, prefix, tuple(runs), tuple(decisions), refuse_reason,
                    tuple(decider.observations), tuple(pieces))
    if refuse_reason is None and plan.reused_tokens == 0:
        plan = replace(plan, dense_reason="nothing_to_reuse")
    return plan


class _RunDecider:
    """Turns matched runs into reused runs or observations, occurrence by occurrence, in prompt
    order. Once a new-anchor segment is met, only recorded versions (a receiver's KV after the same
    text) are reused after it, so its context stays near exact: it and the segments computed after
    it are recorded as anchors (computing them costs the same either way; each is data for the
    next gate). A token run (part of an entry, found by ids) judged new is computed alone: it is
    recorded when the context before it is exact, and what follows it is still reused."""

    def __init__(self, layout: PromptLayout, prefix_length: int, config: KVCommConfig, agent: str,
                 anchors: Optional[KVCommAnchors], versions: Optional[Versions] = None, calibrating: bool = False,
                 twins: Callable[[KVSegment], list[KVSegment]] = lambda segment: [],
                 home: Callable[[str], Optional[KVSegment]] = lambda segment_id: None):
        self.layout, self.prefix_length, self.config, self.agent, self.anchors = layout, prefix_length, config, agent, anchors
        self.versions = versions if anchors is not None else None
        self.calibrating, self.twins, self.home = calibrating, twins, home
        self._decided: Optional[Occurrence | TokenMatch] = None  # the occurrence as last decided
        self.n = int(layout.ids.numel())
        self.runs: list[ReusedRun] = []
        self.observations: list[Observation] = []
        self.after_new_anchor = False  # a segment judged new was met: only recorded versions after it
        # whether a run before holds approximate KV (re-rotated or estimated): a version computed
        # after exact text is then no closer than re-rotation (only the base is taken)
        self._approximate = False

    def decide(self, occ: Occurrence | TokenMatch) -> tuple[Occurrence | TokenMatch, tuple[str, str, int, Optional[GateRecord]]]:
        """The occurrence as decided (on a twin of its segment where only the twin's version
        fits, :meth:`_with_version`) and its ``(status, reason, reused_tokens, gate)``; collects
        its runs."""
        outcome = self._decide(occ)
        return self._decided, outcome

    def _decide(self, occ: Occurrence | TokenMatch) -> tuple[str, str, int, Optional[GateRecord]]:
        found = occ
        occ = self._at_home(occ)
        # leading whitespace ids _at_home left out: computed, kept on the run (ReusedRun.skipped)
        skipped = occ.prompt_start - found.prompt_start if isinstance(occ, TokenMatch) else 0
        self._decided = occ
        if isinstance(occ, TokenMatch):
            runs = [(occ.prompt_start, occ.segment_start, occ.length)]
        else:
            runs = [r for r in match_runs(self.layout, occ.segment, occ.start, occ.limit)
                    if r[2] >= self.config.min_match_tokens]
        if not runs:
            return "prefilled", "stale" if occ.edited else "too_short", 0, None
        prefix_len, n = self.prefix_length, self.n
        # (prompt start, segment start, length, ids of the run the exact prefix already holds)
        beyond_prefix = [(max(p, prefix_len), s + max(p, prefix_len) - p, p + length - max(p, prefix_len),
                          max(0, prefix_len - p)) for p, s, length in runs if p + length > prefix_len]
        in_prefix = sum(min(p + length, prefix_len) - p for p, s, length in runs if p < prefix_len)
        verdict, gate = None, None
        head, short, tail = self.config.recompute_head, self.config.recompute_short_runs, self.config.recompute_tail
        if beyond_prefix and self.config.method == "exact_prefix":
            return "prefilled", "exact_only", in_prefix, None  # the rest is computed
        if beyond_prefix and self.anchors is not None:
            reason = None
            # versions are matched from the first reused token (after the computed head) and only
            # for runs that follow the segment's text without gaps (one context holds for all)
            contiguous = self._contiguous(occ.segment, beyond_prefix)
            p0, s0, length0, covered0 = beyond_prefix[0]
            end_s = beyond_prefix[-1][1] + beyond_prefix[-1][2]
            if self._version_fits_from_start(occ, contiguous and not self.calibrating, p0, s0, end_s):
                head = short = tail = 0  # a version computed after the same text: no change of context to repair
            taken = self._taken(0, occ.segment, beyond_prefix[0], length0, head, short)
            first_p, first_s = p0 + taken, s0 + taken
            tokens = (first_s, end_s) if contiguous else None
            context = self.layout.ids[max(0, first_p - CONTEXT_TOKENS):first_p].tolist()
            if self.calibrating:
                reason = "calibration"
            else:
                occ = self._decided = self._with_version(occ, tokens, context, taken)
                # after a new anchor only a recorded version of the segment is reused (its KV is
                # what a receiver computed after the same text): the context stays near exact
                verdict = self._recorded(occ.segment, tokens, context, taken)
                if verdict is None and not self.after_new_anchor:
                    verdict = self.anchors.decide(self.agent, occ.segment)
                if verdict is None:
                    reason = "after_new_anchor"
                else:
                    gate = _gate_record(verdict)
                    if not verdict.reuse:
                        reason = "over_kl_budget" if verdict.over_budget else "new_anchor"
            if reason is not None:
                # a partial token run judged new costs only itself; so does a segment computed whole
                if not isinstance(occ, TokenMatch) and not self._computed_whole(occ.segment, beyond_prefix, head, short, tail):
                    self.after_new_anchor = True
                for p, s, length, _ in beyond_prefix:
                    self.observations.append(Observation(occ.segment, p, s, min(length, n - 1 - p)))
                return "prefilled", reason, in_prefix, gate  # the rest is computed
        reused = 0
        for index, (p, s, length, covered) in enumerate(beyond_prefix):
            length = min(length, n - 1 - p)
            taken = self._taken(index, occ.segment, (p, s, length, covered), length, head, short)
            p, s, length = p + taken, s + taken, length - taken
            length -= (tailed := self._tail(index, p, length, tail))
            if length > 0:
                self.runs.append(ReusedRun(occ.segment, p, s, length, verdict=verdict, head=taken, tail=tailed,
                                           skipped=skipped))
                reused += length
                self._approximate |= verdict is None or not verdict.from_version
            skipped = 0
        reused += in_prefix
        if not reused:
            whole = bool(beyond_prefix) and self._computed_whole(occ.segment, beyond_prefix, head, short, tail)
            return "prefilled", "short_run" if whole else "too_short", 0, gate
        return "reused", "exact_prefix" if reused == in_prefix else occ.found_by, reused, gate

    def _taken(self, index: int, segment: KVSegment, run: tuple[int, ...], length: int, head: int, short: int) -> int:
        """Ids at the start of run ``index`` of ``segment`` (``run``: prompt start, segment start,
        length, ids the exact prefix holds; ``length`` after the prefix) computed in context: its
        head, or all of it where short or last and moved (:mod:`.repairs`), less what the prefix holds (a
        repeated prompt computes nothing more; a prefix holding a run's first ids leaves the rest,
        served re-rotated, such a short reply measured KL 0.016-0.018 on (i)'s aggregator, dev
        range). The first run's ``head`` and ``short`` (zero where a version fits it), a later run's the config's."""
        if index:
            head, short = self.config.recompute_head, self.config.recompute_short_runs
        if head and not index and not run[3] and cut_inside(run[1]):
            # the first run cut a whole window inside its text (a later run follows the earlier ones)
            head = max(head, self.config.recompute_cut_head)
        if (head or short) and ends_near(self.n, run[0], length) and moved_past_its_context(segment, run[0], run[1]):
            short = max(short, self.config.recompute_last_run)  # a run right before the reader's text that moved
        return max(0, computed_head(head, run[3] + length, short) - run[3])

    def _tail(self, index: int, start: int, length: int, tail: int) -> int:
        """Tokens at the end of run ``index`` (``length`` left after its head, from ``start``)
        computed in context where it ends at most :data:`.repairs.TAIL_REACH` ids before the prompt's end:
        the first run's ``tail`` (zero where a version fits it), a later run's the config's. None
        with own-text reuse: its pieces, with offsets of their own, continue a run to its end."""
        if not ends_near(self.n, start, length) or self.config.experimental.own_text == "reuse":
            return 0
        return max(0, min(self.config.recompute_tail if index else tail, length))

    def _computed_whole(self, segment: KVSegment, runs: list[tuple[int, ...]], head: int, short: int, tail: int) -> bool:
        """Whether every one of ``runs`` (prompt start, segment start, length, ids of it the
        exact prefix holds) is computed whole (:meth:`_taken`, :meth:`_tail`). The gate's
        refusal of such a segment computes it and records it as an anchor, but not everything
        after it (``after_new_anchor``): the later segments' reuse would go for text computed anyway."""
        lengths = [min(length, self.n - 1 - p) for p, _, length, _ in runs]
        taken = [self._taken(i, segment, run, lengths[i], head, short) for i, run in enumerate(runs)]
        return all(t + self._tail(i, run[0] + t, lengths[i] - t, tail) >= lengths[i]
                   for i, (t, run) in enumerate(zip(taken, runs)))

    def _recorded(self, segment: KVSegment, tokens: Optional[tuple[int, int]], context, held: int = 0):
        """The verdict of a recorded version of ``segment`` fitting ``context`` (whose last
        ``held`` ids are the run's computed head), or None."""
        verdict = (self.versions.recorded(self.agent, segment, tokens, context, held) if self.versions is not None
                   else None)
        if verdict is not None and self._approximate and not verdict.base_fits:
            return None  # its KV attended to exact text where this prompt holds approximate KV
        return verdict

    def _contiguous(self, segment: KVSegment, runs: list[tuple[int, int, int, int]]) -> bool:
        """Whether ``runs`` (prompt start, segment start, length, ...) follow each other through
        the segment: without gaps, or (given the tokenizer's texts) with gaps where the prompt
        holds the segment's text in other ids, a split the model generated and the tokenizer
        reads otherwise (``'group', 'by'`` pasted and read as ``'groupby'``: the ids in the gap
        are computed; the text before every run is the segment's)."""
        texts = self.versions.token_texts if self.versions is not None else None
        for (p, s, length, _), (p2, s2, _, _) in zip(runs, runs[1:]):
            if p2 - p == s2 - s == length:
                continue
            if texts is None or p2 < p + length or s2 < s + length or not texts.same_text(
                    self.layout.ids[p + length:p2].tolist(), segment.token_ids[s + length:s2]):
                return False
        return True

    def _at_home(self, occ):
        """A token run on the stored text where a version of exactly its ids was recorded (a
        lead-out, :mod:`.framing.replies`), when that version fits the text before the run and the
        matched segment has none: the same short text is held by many stored texts, and the
        lookup picks one of them. A run that starts with whitespace ids is also tried without
        them (a lead-out's version leaves its leading whitespace out: a reader whose previous
        text ends in whitespace too reads it split into other ids); those ids are computed."""
        if not isinstance(occ, TokenMatch) or self.anchors is None or self.calibrating:
            return occ
        moved = self._version_home(occ)
        if moved is not None:
            return moved
        # only where lead-outs are recorded (framed replies): a runtime without holes (the vLLM
        # broker) would end its claim at the skipped ids
        whitespace = (self.versions.token_texts if self.versions is not None and self.config.reply_copies
                      else None)
        ids = occ.segment.token_ids[occ.segment_start:occ.segment_start + occ.length]
        skip = whitespace.leading(ids, keep=self.config.min_match_tokens) if whitespace is not None else 0
        if skip and not self._fits(occ.segment, occ.prompt_start, occ.segment_start, occ.length):
            trimmed = replace(occ, prompt_start=occ.prompt_start + skip, segment_start=occ.segment_start + skip,
                              length=occ.length - skip)
            moved = self._version_home(trimmed, own=True)
            if moved is not None:
                return moved
        return occ

    def _fits(self, segment: KVSegment, prompt_start: int, segment_start: int, length: int) -> bool:
        """Whether a recorded version of ``segment``'s tokens ``segment_start..+length`` fits the
        prompt's text before ``prompt_start``."""
        context = self.layout.ids[max(0, prompt_start - CONTEXT_TOKENS):prompt_start].tolist()
        return self._recorded(segment, (segment_start, segment_start + length), context) is not None

    def _version_home(self, occ: TokenMatch, own: bool = False) -> Optional[TokenMatch]:
        """``occ`` moved to the stored text where a version of exactly its ids was noted
        (``Versions.homes``) when that version fits and ``occ``'s segment has none; with
        ``own``, also ``occ`` itself where its segment's version fits. None otherwise."""
        ids = occ.segment.token_ids[occ.segment_start:occ.segment_start + occ.length]
        noted = self.versions.homes.of(ids) if self.versions is not None else None
        segment = None if noted is None or noted[0] == occ.segment.id else self.home(noted[0])
        if segment is not None and tuple(segment.token_ids[noted[1]:noted[1] + occ.length]) != tuple(ids):
            segment = None
        if (own or segment is not None) and self._fits(occ.segment, occ.prompt_start, occ.segment_start, occ.length):
            return occ
        if segment is None or not self._fits(segment, occ.prompt_start, noted[1], occ.length):
            return None
        return replace(occ, segment=segment, segment_start=noted[1])

    def _version_fits_from_start(self, occ, check: bool, p0: int, s0: int, end_s: int) -> bool:
        """Whether a framed version of ``occ``'s segment (or a twin's: computed by the sender in
        this reader's framing, :mod:`.framing.replies`, :mod:`.framing.texts`) fits the prompt's text
        before the run's first token (prompt position ``p0``, segment token ``s0``): then the
        run's head is reused too, not computed (``recompute_head`` repairs the tokens right
        after a change of context), and a short run is not computed whole
        (``recompute_short_runs``). Not for the base or other receivers' recorded versions:
        their text further back differs (another agent's system text), and their heads, measured,
        still cut KL (on the shared-history workload (f): 0.0017 without them, 0.0004 with)."""
        repairs = self.config.recompute_head or self.config.recompute_short_runs
        if not check or not repairs or self.config.method != "kvcomm":
            return False
        context = self.layout.ids[max(0, p0 - CONTEXT_TOKENS):p0].tolist()

        def framed_fits(segment: KVSegment) -> bool:
            verdict = self._recorded(segment, (s0, end_s), context)
            return verdict is not None and is_framed(verdict.source)

        # the twins (a scan of the store) only when the matched segment's own version does not fit
        return framed_fits(occ.segment) or any(framed_fits(twin) for twin in self.twins(occ.segment))

    def _with_version(self, occ, tokens: Optional[tuple[int, int]], context: list[int], held: int = 0):
        """``occ``, or ``occ`` on a twin of its segment (same text and ids, another producer:
        two agents that replied alike) that has a recorded version fitting ``context`` where
        ``occ``'s segment has none: text is matched to one segment per text, the most recent,
        and the version that fits may be the other producer's."""
        if tokens is None or self._recorded(occ.segment, tokens, context, held) is not None:
            return occ
        for twin in self.twins(occ.segment):
            if self._recorded(twin, tokens, context, held) is not None:
                if isinstance(occ, TokenMatch):
                    return replace(occ, segment=twin)
                return replace(occ, segment=twin, segment_id=twin.id, ref=twin.ref)
        return occ


def _held(segment, fingerprint: str) -> Optional[KVSegment]:
    """``segment`` when it is a stored segment of ``fingerprint``."""
    return segment if isinstance(segment, KVSegment) and segment.ref.fingerprint == fingerprint else None


def _gate_record(verdict) -> GateRecord:
    """What the stats say about one gate verdict."""
    offsets = None
    if verdict.reuse:
        # re-rotated alone first: a refused (or probed) verdict of the receiver's own offsets may be served so
        offsets = ("rerotated" if verdict.rerotated else "own" if verdict.own_offsets and verdict.offsets_on
                   else "framed" if is_framed(verdict.source) else "recorded" if verdict.source is not None
                   else "base" if verdict.base_fits else "estimated" if verdict.offsets_on else "off")
    return GateRecord(decision="reuse" if verdict.reuse else "new_anchor", anchors=verdict.anchors,
                      score=verdict.score, entropy=verdict.entropy, offsets=offsets)
