"""Reply versions in their readers' framing: the sender computes its reply once as readers see it.

A reply's base KV is computed after the sender's generation header
(``<|im_start|>assistant\\n``). Readers paste the reply after a lead-in of their own
(``<|im_start|>user\\nSolver 2 answered:\\n``, ``\\n\\nSolver 2: ``), so the first reader of each
reply finds no version of it computed after that text (:mod:`.anchors.versions`) and either
estimates offsets (over the KL budget on the embedded model) or computes the reply: in a debate
the newest reply, every time. Yet the text before the lead-in is, in most graphs, what the
sender itself read: the reader's prompt repeats the sender's.

**Learned** (ids only, :func:`learn_rule`): when a reader's prompt holds a sender's reply from
its first token (a reused run, its recomputed head included, or tokens computed as an
observation), at least :data:`COVERED` of it, and the reply's base context is known, the
reader's ids right before the reply are aligned with the sender's prompt tail: the shortest
lead-in after which the reader's last :data:`ALIGN_IDS` ids occur in the sender's prompt. A
rule ``(drop, lead_in)``: drop the sender prompt's last ``drop`` ids (its generation header),
then append ``lead_in``. The last :data:`MAX_RULES` distinct rules per sender are kept.

**Applied** to each later reply of that sender (:class:`FramedDecode`): the sender's own
forwards after its prefill (decode steps, or a replay's teacher-forced pass) also feed the
reply's tokens after ``prompt[:N - drop] + lead_in``, in the same cache, kept apart by a mask;
only for calls whose prompt KV had no estimated offsets. After the reply,
:func:`record_framed_versions` records each framed copy's ``real - base`` offsets under a
pseudo-receiver (:func:`~.anchors.versions.framed_receiver`) with the ids before it as
context. The reader's planner finds that version like any recorded one (its context matches
for ``ALIGN_IDS + len(lead_in)`` ids or more) and reuses it (``GateRecord.offsets ==
"framed"``).

**Lead-outs**: in one-message prompts a reader's closing line follows the newest reply
(``\n\nCheck the solutions above, then give your own answer.``): text earlier prompts hold after
other text, so no version of it fits either. The rule keeps the shared text a reader put right
after the reply (:func:`lead_out`); the copy is fed it after the whole reply (in the forward
that feeds the reply's last ids) and it is recorded as a version of the stored text the
token-run lookup finds it in, under a framed pseudo-receiver (:func:`_record_lead_out`).

What it costs, and where: the sender's forwards carry ``R`` more query tokens per reply token
(``R`` framings, at most :data:`MAX_RULES`), plus the lead-in once; no forward of its own, and
nothing between the sender's last token and the reader's first but reading the copies out
(``CallStats.framed_s``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .engines import hf
from .anchors.versions import MIN_CONTEXT_MATCH, framed_receiver
from .framed_decode import FramedDecode
from .kv.segments import CONTEXT_TOKENS, KVSegment
from .plan import CallPlan
from .reply_ahead import align_lead_in

__all__ = ["FramingRule", "ReaderFraming", "learn_rule", "lead_out", "record_framed_versions", "ALIGN_IDS",
           "MAX_LEAD_IN", "MAX_LEAD_OUT", "MAX_RULES", "COVERED"]

#: Ids of the sender's prompt the reader's text must repeat right before the lead-in (as
#: :data:`~kvcomm_agents.anchors.versions.MIN_CONTEXT_MATCH`: a shared role header alone never
#: qualifies).
ALIGN_IDS = 16
#: Longest lead-in (ids between the repeated text and the reply) taken for a framing; longer
#: means the reader put other text there, not a framing.
MAX_LEAD_IN = 40
#: Share of a reply a reader's prompt must hold from its first token for its framing to be
#: learned (a reply pasted whole, not a sentence of it that another text repeats).
COVERED = 0.9
#: Distinct framings kept per sender (each costs one prefill after each of its replies).
MAX_RULES = 2
#: Longest lead-out: shared text (a stored segment's ids) a reader puts right after a reply, up
#: to the end of that text, fed to the copy after the reply and recorded as a version of that
#: text (the one-message prompt's closing instruction, "Check the solutions above, ..."). Longer
#: text after a reply is other content, not a closing line. A named heuristic, not tuned.
MAX_LEAD_OUT = 40
#: Ids between a reply's stored ids and the shared text after it still taken as its lead-out
#: (the reply's last generated token is never fed, so never stored: one id).
LEAD_OUT_GAP = 2
#: Framed pseudo-receivers a lead-out version may take (the first that holds nothing of its
#: segment): as many as the text copies' (:data:`~kvcomm_agents.text_framing.MAX_READERS`), so
#: that a lead-out adds no offset stack of its own to a pool.
LEAD_OUT_RECEIVERS = 4

@dataclass(frozen=True)
class FramingRule:
    """Readers put ``lead_in`` before the sender's reply, after the sender's prompt without its
    last ``drop`` ids; ``lead_out``: shared text a reader put right after the reply (a closing
    instruction; empty when none), fed to the copy after the reply (:data:`MAX_LEAD_OUT`)."""

    drop: int
    lead_in: tuple[int, ...]
    lead_out: tuple[int, ...] = ()


def learn_rule(before: Sequence[int], sender_context: Sequence[int], *, align: int = ALIGN_IDS,
               max_lead_in: int = MAX_LEAD_IN) -> Optional[FramingRule]:
    """The framing of a reply read after ``before`` (the reader's ids right before the reply's
    first token), given ``sender_context`` (the last ids of the prompt the reply was generated
    after); None when the reader's text does not repeat the sender's, or when the base context
    already fits (no lead-in, nothing dropped: the base is that version)."""
    aligned = align_lead_in(before, sender_context, align=align, max_lead_in=max_lead_in)
    if aligned is None:
        return None
    cut, end = aligned
    rule = FramingRule(len(sender_context) - end, tuple(before)[cut:])
    return None if rule.drop == 0 and not rule.lead_in else rule


def lead_out(plan: CallPlan, reply_end: int) -> tuple[int, ...]:
    """The ids of the shared text a reader put right after a reply: a user, tool or document
    segment's run (reused or computed) starting at most :data:`LEAD_OUT_GAP` ids after
    ``reply_end`` (the prompt position after the reply's stored ids; the ids between are the
    reply's last token, which is never fed and so not stored), when at most :data:`MAX_LEAD_OUT`
    ids; () otherwise."""
    spans = sorted((_found_at(item), item.prompt_start + item.length)
                   for item in (*plan.runs, *plan.observations)
                   if not getattr(item, "own_text", False) and item.segment.ref.kind[1] != "assistant"
                   and reply_end <= _found_at(item) <= reply_end + LEAD_OUT_GAP)
    if not spans or spans[0][1] - spans[0][0] > MAX_LEAD_OUT:
        return ()
    return tuple(plan.prompt_ids[spans[0][0]:spans[0][1]].tolist())


def _found_at(item) -> int:
    """Where a run's occurrence starts in the prompt (its computed head and skipped whitespace
    included); an observation's own start."""
    return getattr(item, "found_start", item.prompt_start)


class ReaderFraming:
    """The framings readers gave each sender's replies (thread-safe; ids only)."""

    def __init__(self, max_rules: int = MAX_RULES) -> None:
        self.max_rules = max_rules
        self._rules: dict[str, OrderedDict[FramingRule, FramingRule]] = {}  # per sender, most recent first
        self._lock = threading.Lock()

    def learn(self, plan: CallPlan) -> int:
        """Learn from a reader's call: every reply the prompt holds from its first token (reused,
        recomputed head included, or computed as an observation) whose base context is known,
        at its last such occurrence. Returns the rules seen."""
        latest: dict[str, tuple[int, KVSegment, bool]] = {}  # per reply: its last whole occurrence's start,
        # whether the prompt holds it to its last token
        for item in (*plan.runs, *plan.observations):
            segment: KVSegment = item.segment
            skipped = getattr(item, "head", 0)  # a run's head: its first tokens computed in context
            if getattr(item, "own_text", False) or segment.ref.kind[1] != "assistant" or not segment.context_ids:
                continue
            if item.segment_start != skipped or item.segment_start + item.length < COVERED * segment.num_tokens:
                continue  # not the reply pasted whole (a run of it found inside other text)
            start = item.prompt_start - item.segment_start
            reaches = item.segment_start + item.length == segment.num_tokens
            held = latest.get(segment.id, (-1, None, False))
            if start > held[0] or (start == held[0] and reaches):
                latest[segment.id] = (start, segment, reaches)
        seen = 0
        for start, segment, whole in latest.values():
            # the last occurrence only: a reply equal to an earlier one (solvers that copy each
            # other) is found at the earlier one's place too, after that one's lead-in
            rule = learn_rule(plan.prompt_ids[max(0, start - CONTEXT_TOKENS):start].tolist(), segment.context_ids)
            if rule is not None:
                after = lead_out(plan, start + segment.num_tokens) if whole else ()
                self._remember(str(segment.ref.kind[0]), FramingRule(rule.drop, rule.lead_in, after))
                seen += 1
        return seen

    def _remember(self, sender: str, rule: FramingRule) -> None:
        """Keep ``rule`` first among the sender's. A rule without a lead-out is served by a kept
        rule of the same framing (drop and lead-in) with one (the copy computes the reply as it
        does), which then moves first. Two lead-outs of one framing are kept apart: where the
        reply's last token and the closing line's first merge (``.\n\n``), readers read one
        id fewer of it, depending on how each reply ends."""
        with self._lock:
            rules = self._rules.setdefault(sender, OrderedDict())
            if not rule.lead_out:
                rule = next((kept for kept in rules.values()
                             if (kept.drop, kept.lead_in) == (rule.drop, rule.lead_in)), rule)
            rules.pop(rule, None)
            rules[rule] = rule
            rules.move_to_end(rule, last=False)
            while len(rules) > self.max_rules:
                rules.popitem(last=True)

    def rules(self, sender: str) -> list[FramingRule]:
        """The sender's framings, most recently seen first."""
        with self._lock:
            return list(self._rules.get(sender, {}).values())

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()


def record_framed_versions(framed: FramedDecode, cache, plan: CallPlan, segment: Optional[KVSegment], anchors,
                           rotator, store=None, fingerprint: str = "", turn: int = 0) -> int:
    """Record the framed copies of ``segment`` (the reply of the call ``plan`` prefilled; its
    ``T`` ids are the first reply tokens the sender was fed; None when the reply was not kept,
    too short) as versions: framing ``i`` as pseudo-receiver ``framed_receiver(i)``'s offsets;
    with ``store``, each framing's lead-out too (:func:`_record_lead_out`; also for a reply
    not kept: its readers compute the reply, then reuse the closing line). Call after
    :meth:`FramedDecode.flush`. Returns the versions recorded."""
    done = 0
    n = segment.num_tokens if segment is not None else 0
    if n > framed.fed:
        return 0
    for index in range(len(framed.rules)):
        if segment is not None:
            start = framed.reply_start(index)
            real = hf.kv_at_positions(cache, framed.slot_positions(index + 1), torch.arange(start, start + n))
            lead = len(framed.rules[index].lead_in)
            done += anchors.record_version(framed_receiver(index), segment, real, start,
                                           framed.context_ids(plan.prompt_ids, index), rotator,
                                           min_match=MIN_CONTEXT_MATCH + lead)
        if store is not None:
            done += _record_lead_out(framed, cache, index, plan, anchors, rotator, store, fingerprint, turn + index)
    return done


def _lead_out_receiver(anchors, text: KVSegment, turn: int) -> Optional[str]:
    """The framed pseudo-receiver a lead-out version of ``text`` goes to: the first holding no
    version of it, else one holding a lead-out (a part of the segment), in turn (``turn``
    counts lead-outs recorded); never one holding a text copy's version (the whole segment).
    None when all hold text copies' versions."""
    names = [framed_receiver(i) for i in range(LEAD_OUT_RECEIVERS)]
    spans = [anchors.version_span(name, text) for name in names]
    free = [name for name, span in zip(names, spans) if span is None]
    if free:
        return free[0]
    parts = [name for name, span in zip(names, spans) if span != (0, text.num_tokens) and span != (0, 0)]
    if not parts:
        return None
    name = parts[turn % len(parts)]
    anchors.forget_version(name, text)
    return name


def _record_lead_out(framed: FramedDecode, cache, index: int, plan: CallPlan, anchors, rotator,
                     store, fingerprint: str, turn: int) -> int:
    """Record framing ``index``'s lead-out (fed right after the reply ``segment``) as a version
    of the stored text its readers will find it in: the runs the store's token-run lookup gives
    for those ids (what a reader's planner finds, as long as no newer entry holds them), each
    under a framed pseudo-receiver (:func:`_lead_out_receiver`); the planner finds it there
    even where it matched the same ids to another stored text (``KVCommAnchors.homes``).
    Returns the versions recorded."""
    rule = framed.rules[index]
    if not rule.lead_out or not framed.led_out:
        return 0
    ids = torch.tensor(rule.lead_out, dtype=torch.long)
    first = framed.lead_out_start(index)
    real = hf.kv_at_positions(cache, framed.slot_positions(index + 1), torch.arange(first, first + len(ids)))
    # the copy's ids before it: every reply id it was fed (the stored reply may hold fewer: its
    # trailing ids whose text tokenizes otherwise on its own are left out), then the tail
    before = framed.context_ids(plan.prompt_ids, index) + tuple(framed.reply_ids) + framed.tail
    # the line's leading whitespace is left out: readers split it into other ids where the reply
    # ends in whitespace too (their runs start after it, :meth:`~.planner.Planner._at_home`)
    skip = anchors.texts.leading(rule.lead_out) if anchors.texts is not None else 0
    done = 0
    for text, at, text_start, length in store.find_runs(ids[skip:], fingerprint,
                                                        torch.ones(len(ids) - skip, dtype=torch.bool), len(ids) - skip):
        at += skip
        if text.ref.kind[1] == "assistant":
            continue  # a reply that repeats the closing line: not what readers read it as
        receiver = _lead_out_receiver(anchors, text, turn)
        if receiver is None:
            continue
        context = (before + rule.lead_out[:at])[-CONTEXT_TOKENS:]
        if anchors.record_version(receiver, text, real.window(at, at + length), first + at, context, rotator,
                                  min_match=MIN_CONTEXT_MATCH, segment_start=text_start):
            anchors.homes.note(rule.lead_out[at:at + length], text.id, text_start)
            done += 1
    return done

