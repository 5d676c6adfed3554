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

__all__ = ["FramingRule", "ReaderFraming", "learn_rule", "record_framed_versions", "ALIGN_IDS", "MAX_LEAD_IN",
           "MAX_RULES", "COVERED"]

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

@dataclass(frozen=True)
class FramingRule:
    """Readers put ``lead_in`` before the sender's reply, after the sender's prompt without its
    last ``drop`` ids."""

    drop: int
    lead_in: tuple[int, ...]


def learn_rule(before: Sequence[int], sender_context: Sequence[int], *, align: int = ALIGN_IDS,
               max_lead_in: int = MAX_LEAD_IN) -> Optional[FramingRule]:
    """The framing of a reply read after ``before`` (the reader's ids right before the reply's
    first token), given ``sender_context`` (the last ids of the prompt the reply was generated
    after); None when the reader's text does not repeat the sender's, or when the base context
    already fits (no lead-in, nothing dropped: the base is that version)."""
    before, sender = tuple(before), tuple(sender_context)
    if len(sender) < align:
        return None
    ends: dict[tuple[int, ...], int] = {}
    for end in range(align, len(sender) + 1):
        ends[sender[end - align:end]] = end  # the latest occurrence wins
    for lead in range(0, min(max_lead_in, len(before) - align) + 1):
        cut = len(before) - lead
        end = ends.get(before[cut - align:cut])
        if end is not None:
            rule = FramingRule(len(sender) - end, before[cut:])
            return None if rule.drop == 0 and not rule.lead_in else rule
    return None


class ReaderFraming:
    """The framings readers gave each sender's replies (thread-safe; ids only)."""

    def __init__(self, max_rules: int = MAX_RULES) -> None:
        self.max_rules = max_rules
        self._rules: dict[str, OrderedDict[FramingRule, None]] = {}
        self._lock = threading.Lock()

    def learn(self, plan: CallPlan) -> int:
        """Learn from a reader's call: every reply the prompt holds from its first token (reused,
        recomputed head included, or computed as an observation) whose base context is known,
        at its last such occurrence. Returns the rules seen."""
        latest: dict[str, tuple[int, KVSegment]] = {}  # per reply: where its last whole occurrence starts
        for item in (*plan.runs, *plan.observations):
            segment: KVSegment = item.segment
            skipped = getattr(item, "head", 0)  # a run's head: its first tokens computed in context
            if getattr(item, "own_text", False) or segment.ref.kind[1] != "assistant" or not segment.context_ids:
                continue
            if item.segment_start != skipped or item.segment_start + item.length < COVERED * segment.num_tokens:
                continue  # not the reply pasted whole (a run of it found inside other text)
            start = item.prompt_start - item.segment_start
            if start > latest.get(segment.id, (-1, None))[0]:
                latest[segment.id] = (start, segment)
        seen = 0
        for start, segment in latest.values():
            # the last occurrence only: a reply equal to an earlier one (solvers that copy each
            # other) is found at the earlier one's place too, after that one's lead-in
            rule = learn_rule(plan.prompt_ids[max(0, start - CONTEXT_TOKENS):start].tolist(), segment.context_ids)
            if rule is not None:
                self._remember(str(segment.ref.kind[0]), rule)
                seen += 1
        return seen

    def _remember(self, sender: str, rule: FramingRule) -> None:
        with self._lock:
            rules = self._rules.setdefault(sender, OrderedDict())
            rules[rule] = None
            rules.move_to_end(rule, last=False)
            while len(rules) > self.max_rules:
                rules.popitem(last=True)

    def rules(self, sender: str) -> list[FramingRule]:
        """The sender's framings, most recently seen first."""
        with self._lock:
            return list(self._rules.get(sender, ()))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()


def record_framed_versions(framed: FramedDecode, cache, plan: CallPlan, segment: KVSegment, anchors,
                           rotator) -> int:
    """Record the framed copies of ``segment`` (the reply of the call ``plan`` prefilled; its
    ``T`` ids are the first reply tokens the sender was fed) as versions: framing ``i`` as
    pseudo-receiver ``framed_receiver(i)``'s offsets. Call after :meth:`FramedDecode.flush`.
    Returns the versions recorded."""
    done = 0
    n = segment.num_tokens
    if n > framed.fed:
        return 0
    for index in range(len(framed.rules)):
        start = framed.reply_start(index)
        real = hf.kv_at_positions(cache, framed.slot_positions(index + 1), torch.arange(start, start + n))
        lead = len(framed.rules[index].lead_in)
        done += anchors.record_version(framed_receiver(index), segment, real, start,
                                       framed.context_ids(plan.prompt_ids, index), rotator,
                                       min_match=MIN_CONTEXT_MATCH + lead)
    return done
