"""Reply versions in their readers' framing: the sender computes its reply once as readers see it.

A reply's base KV is computed after the sender's generation header
(``<|im_start|>assistant\\n``). Readers paste the reply after a lead-in of their own
(``<|im_start|>user\\nSolver 2 answered:\\n``, ``\\n\\nSolver 2: ``), so the first reader of each
reply finds no version of it computed after that text (:mod:`.anchors.versions`) and either
estimates offsets (over the KL budget on the embedded model) or computes the reply: in a debate
the newest reply, every time. Yet the text before the lead-in is, in most graphs, what the
sender itself read: the reader's prompt repeats the sender's.

**Learned** (ids only, :func:`learn_rule`): when a reader's prompt holds a sender's reply from
its first token (a reused run or tokens computed as an observation) and the reply's base context
is known (and the prompt holds at least :data:`COVERED` of the reply from there), the reader's ids right before the reply are aligned with the sender's prompt tail: the
shortest lead-in after which the reader's last :data:`ALIGN_IDS` ids occur in the sender's
prompt. A rule ``(drop, lead_in)``: drop the sender prompt's last ``drop`` ids (its generation
header), then append ``lead_in``. The last :data:`MAX_RULES` distinct rules per sender are kept.

**Applied** (:func:`compute_framed_versions`, after each later reply of that sender): one
prefill of ``lead_in + reply`` over the sender's own KV of ``prompt[:N - drop]`` (exact: only
for calls whose prompt KV had no estimated offsets); the reply's ``real - base`` offsets are
recorded under a :data:`~.anchors.versions.READERS` pseudo-receiver (one per rule) with the ids before it as their context. The reader's planner
finds that version like any recorded one (its context matches for ``ALIGN_IDS + len(lead_in)``
ids or more) and reuses it (``GateRecord.offsets == "framed"``).

What it costs, and where: one prefill of ``len(lead_in) + len(reply)`` tokens per rule at the end
of the sender's call (``CallStats.framed_s``), about what the first reader would otherwise
compute in its own time to first token. It moves that work off the reader's critical path
(and does it once for every reader that frames the reply the same way); it does not remove it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .engines import hf
from .kv.block import KVBlock
from .anchors.versions import READERS, framed_receiver
from .kv.segments import CONTEXT_TOKENS, KVSegment
from .plan import CallPlan

__all__ = ["FramingRule", "ReaderFraming", "learn_rule", "compute_framed_versions", "READERS", "ALIGN_IDS",
           "MAX_LEAD_IN", "MAX_RULES"]

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

KVAt = Callable[[torch.Tensor], KVBlock]


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
        recomputed head included, or computed as an observation) whose base context is known.
        Returns the rules seen."""
        seen = 0
        for item in (*plan.runs, *plan.observations):
            segment: KVSegment = item.segment
            skipped = getattr(item, "head", 0)  # a run's head: its first tokens computed in context
            if getattr(item, "own_text", False) or segment.ref.kind[1] != "assistant" or not segment.context_ids:
                continue
            if item.segment_start != skipped or item.segment_start + item.length < COVERED * segment.num_tokens:
                continue  # not the reply pasted whole (a run of it found inside other text)
            start = item.prompt_start - item.segment_start
            before = plan.prompt_ids[max(0, start - CONTEXT_TOKENS):start].tolist()
            rule = learn_rule(before, segment.context_ids)
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


def compute_framed_versions(model, plan: CallPlan, segment: KVSegment, kv_at: KVAt, rules: Sequence[FramingRule],
                            anchors, rotator, max_positions: Optional[int] = None) -> tuple[int, float]:
    """Compute ``segment`` (the reply of the call ``plan`` prefilled) once per framing in
    ``rules`` and record each as a version (:data:`READERS`'s offsets). Returns how many were
    recorded and the seconds spent.

    Args:
        model: the causal LM.
        plan: the sender's call (``prompt_ids [N]``); its KV up to ``N - drop`` is reused as is.
        segment: the reply's stored segment (``T`` tokens; base KV ``[L, H, T, D]``).
        kv_at: the sender's KV at given prompt positions (exact where the plan was exact).
        rules: the framings to compute.
        anchors: the engine's :class:`~kvcomm_agents.anchors.KVCommAnchors`.
        rotator: the model's RoPE rotator.
        max_positions: the model's position limit (a framing that would exceed it is skipped).
    """
    started = time.perf_counter()
    n, done = plan.num_prompt, 0
    reply = torch.tensor(segment.token_ids, dtype=torch.long)
    for index, rule in enumerate(rules):
        name = framed_receiver(index)
        keep = n - rule.drop
        if keep <= 0:
            continue
        ids = torch.cat([plan.prompt_ids[:keep], torch.tensor(rule.lead_in, dtype=torch.long), reply])
        start = keep + len(rule.lead_in)
        if max_positions is not None and ids.numel() > max_positions:
            continue
        context = tuple(ids[max(0, start - CONTEXT_TOKENS):start].tolist())
        if anchors.has_version(name, segment, context):
            continue
        prefix = torch.arange(keep)
        pre = hf.prefill(model, ids, torch.arange(keep, ids.numel()), kv_at(prefix), prefix)
        real = hf.kv_at_positions(pre.cache, pre.slot_positions, torch.arange(start, ids.numel()))
        anchors.record_version(name, segment, real, start, context, rotator)
        done += 1
    return done, time.perf_counter() - started
