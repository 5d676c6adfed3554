"""Reply versions in their readers' framing: the sender computes its reply once as readers see it.

A reply's base KV is computed after the sender's generation header
(``<|im_start|>assistant\\n``). Readers paste the reply after a lead-in of their own
(``<|im_start|>user\\nSolver 2 answered:\\n``, ``\\n\\nSolver 2: ``), so the first reader of each
reply finds no version of it computed after that text (:mod:`.versions.match`) and either
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
pseudo-receiver (:func:`~.versions.match.framed_receiver`) with the ids before it as
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

from ..kv.segments import CONTEXT_TOKENS, KVSegment, is_reply
from ..plan import CallPlan
from ..recent import MAX_AGENTS, RecentDict
from .rules import ALIGN_IDS, COVERED, MAX_LEAD_IN, MAX_READERS, align_lead_in

__all__ = ["FramingRule", "ReaderFraming", "learn_rule", "lead_out", "MAX_RULES", "MAX_LEAD_OUT", "LEAD_OUT_GAP"]

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
                   if not getattr(item, "own_text", False) and not is_reply(item.segment.ref.kind)
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
        # per sender (the most recently taught last, bounded), its rules (the most recent first):
        # each rule's readers
        self._rules: RecentDict = RecentDict(MAX_AGENTS)
        self._lock = threading.Lock()

    def learn(self, plan: CallPlan, reader: str = "") -> int:
        """Learn from ``reader``'s call: every reply the prompt holds from its first token (reused,
        recomputed head included, or computed as an observation) whose base context is known,
        at its last such occurrence. Returns the rules seen."""
        latest: dict[str, tuple[int, KVSegment, bool]] = {}  # per reply: its last whole occurrence's start,
        # whether the prompt holds it to its last token
        for item in (*plan.runs, *plan.observations):
            segment: KVSegment = item.segment
            skipped = getattr(item, "head", 0)  # a run's head: its first tokens computed in context
            if getattr(item, "own_text", False) or not is_reply(segment.ref.kind) or not segment.context_ids:
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
                self._remember(str(segment.ref.kind[0]), FramingRule(rule.drop, rule.lead_in, after), reader)
                seen += 1
        return seen

    def _remember(self, sender: str, rule: FramingRule, reader: str) -> None:
        """Keep ``rule`` first among the sender's, ``reader`` among its readers. A rule without a
        lead-out is served by a kept rule of the same framing (drop and lead-in) with one (the
        copy computes the reply as it does), which then moves first. Two lead-outs of one
        framing are kept apart: where the reply's last token and the closing line's first merge
        (``.\n\n``), readers read one id fewer of it, depending on how each reply ends."""
        with self._lock:
            rules = self._rules.touch(sender, OrderedDict)
            if not rule.lead_out:
                rule = next((kept for kept in rules
                             if (kept.drop, kept.lead_in) == (rule.drop, rule.lead_in)), rule)
            readers = rules.pop(rule, ())
            readers = tuple(name for name in readers if name != reader)[-(MAX_READERS - 1):] + (reader,)
            rules[rule] = readers
            rules.move_to_end(rule, last=False)
            while len(rules) > self.max_rules:
                rules.popitem(last=True)

    def rules(self, sender: str) -> list[FramingRule]:
        """The sender's framings, most recently seen first."""
        with self._lock:
            return list(self._rules.get(sender, {}))

    def readers(self, sender: str, rule: FramingRule) -> tuple[str, ...]:
        """The readers that taught ``rule`` for ``sender``'s replies (at most
        :data:`~.rules.MAX_READERS`, the latest last); () when it is not kept."""
        with self._lock:
            return self._rules.get(sender, {}).get(rule, ())

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

