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
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .engines import hf
from .anchors.versions import MIN_CONTEXT_MATCH, framed_receiver
from .kv.segments import CONTEXT_TOKENS, KVSegment
from .plan import CallPlan

__all__ = ["FramingRule", "ReaderFraming", "FramedDecode", "ReplyFramer", "learn_rule", "record_framed_versions", "ALIGN_IDS",
           "MAX_LEAD_IN", "MAX_RULES", "COVERED", "copy_chunk", "CPU_CHUNK"]

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


def copy_chunk(device: torch.device) -> int:
    """Reply tokens fed to the copies at once. On CUDA every decode step carries its token's
    copies (a step costs the read of the weights; one more query is nearly free: assumed, not
    measured yet). On a CPU a 2-token forward of the embedded model costs 1.5x a 1-token one
    (63 against 43 ms; 17 tokens: 73 ms), so the copies wait for 16 tokens and ride on one
    step: about 2 ms more per generated token, and at most 15 tokens fed after the reply
    (:meth:`FramedDecode.flush`). A named heuristic from that one measurement."""
    return 1 if torch.device(device).type == "cuda" else CPU_CHUNK


#: Reply tokens per copy chunk on a CPU (:func:`copy_chunk`).
CPU_CHUNK = 16


class FramedDecode:
    """A reply's framed copies, computed inside the sender's own forwards (none of their own).

    The forwards the sender runs after its prefill (decode steps; a replay's teacher-forced
    pass) also feed the same reply tokens in each framing, ``chunk`` tokens at a time: the
    framing's lead-in (with the first chunk), then the tokens, at the framing's positions; what
    is left after the reply is fed by :meth:`flush`. One cache holds all contexts; a mask keeps
    them apart: a query of context ``c`` at position ``p`` sees a key of context ``s`` at position
    ``q`` iff ``q <= p`` and either ``s == c``, or ``s`` is the sender's (0) and ``q < keep_c``
    (the sender's prompt without the ``drop`` ids). The sender's queries come last, so its logits
    are the forward's last rows.

    Args:
        rules: the framings (context ``i + 1`` is ``rules[i]``).
        prompt_slot_positions: ``[S]`` prompt position of each cache slot after the prefill.
        num_prompt: ``N``, the sender's prompt length.
        chunk: reply tokens fed to the copies at once (:func:`copy_chunk`).
    """

    def __init__(self, rules: Sequence[FramingRule], prompt_slot_positions: torch.Tensor, num_prompt: int,
                 chunk: int = 1) -> None:
        self.rules = list(rules)
        self.keep = [num_prompt - rule.drop for rule in self.rules]
        self.slot_ctx = torch.zeros(prompt_slot_positions.numel(), dtype=torch.long)
        self.slot_pos = prompt_slot_positions.detach().cpu().clone()
        self.num_prompt, self.chunk = num_prompt, max(1, chunk)
        self.sent = 0  # reply tokens fed to the sender
        self.fed = 0  # reply tokens fed to the copies (the same in every framing)
        self.pending: list[int] = []  # reply tokens the copies have not been fed yet

    def _queries(self, copies: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Ids, positions and contexts of one forward feeding ``copies`` to every framing and
        ``tokens`` to the sender (last)."""
        ids, pos, ctx = [], [], []
        for c, (rule, keep) in enumerate(zip(self.rules, self.keep), start=1):
            if not copies:
                break
            lead = list(rule.lead_in) if self.fed == 0 else []
            first = keep + (0 if self.fed == 0 else len(rule.lead_in) + self.fed)
            ids += lead + list(copies)
            pos += list(range(first, first + len(lead) + len(copies)))
            ctx += [c] * (len(lead) + len(copies))
        first = self.num_prompt + self.sent
        ids += list(tokens)
        pos += list(range(first, first + len(tokens)))
        ctx += [0] * len(tokens)
        return ids, pos, ctx

    def mask(self, q_pos: torch.Tensor, q_ctx: torch.Tensor, *, dtype: torch.dtype, device) -> torch.Tensor:
        """``[1, 1, Q, S + Q]`` additive mask of queries at ``q_pos`` in contexts ``q_ctx`` over
        the cached slots then the queries themselves."""
        key_pos = torch.cat([self.slot_pos, q_pos])
        key_ctx = torch.cat([self.slot_ctx, q_ctx])
        limit = torch.tensor([torch.iinfo(torch.long).max] + self.keep, dtype=torch.long)[q_ctx]
        visible = (key_pos[None, :] <= q_pos[:, None]) & (
            (key_ctx[None, :] == q_ctx[:, None]) | ((key_ctx[None, :] == 0) & (key_pos[None, :] < limit[:, None])))
        mask = torch.zeros(visible.shape, dtype=dtype)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[None, None].to(device)

    def forward(self, model, cache, tokens: Sequence[int], *, last_logits_only: bool = True) -> torch.Tensor:
        """Feed ``tokens`` to the sender, and the copies their due chunk (``cache`` grows);
        returns the sender's logits ``[1, len(tokens) or 1, vocab]``. Many tokens at once (a
        replay) go in windows whose mask stays within :data:`~kvcomm_agents.engines.hf.MASK_BUDGET`
        elements, as a long prefill does."""
        tokens = list(tokens)
        rows = []
        for window in self._windows(len(tokens)):
            part = tokens[window]
            self.pending += part
            copies = self.pending if len(self.pending) >= self.chunk else []
            rows.append(self._run(model, cache, copies, part, 1 if last_logits_only else len(part)))
        return rows[-1] if last_logits_only else torch.cat(rows, dim=1)

    def _windows(self, n: int) -> list[slice]:
        """Slices of ``n`` tokens fed at once: each forward's ``(R+1) w`` queries times its keys
        within the mask budget (at least :data:`CPU_CHUNK` tokens a window)."""
        contexts = len(self.rules) + 1
        keys = self.slot_pos.numel() + contexts * n + sum(len(rule.lead_in) for rule in self.rules)
        width = max(CPU_CHUNK, hf.MASK_BUDGET // max(1, contexts * keys))
        return [slice(i, min(n, i + width)) for i in range(0, n, width)]

    def flush(self, model, cache) -> None:
        """Feed the copies what they have not been fed yet (after the reply)."""
        if self.pending:
            self._run(model, cache, self.pending, [], 1)

    def _run(self, model, cache, copies: list[int], tokens: Sequence[int], rows: int) -> torch.Tensor:
        """One forward; the logits of its last ``rows`` queries (the sender's)."""
        ids, pos, ctx = self._queries(copies, tokens)
        q_pos, q_ctx = torch.tensor(pos, dtype=torch.long), torch.tensor(ctx, dtype=torch.long)
        device = hf.input_device(model)
        logits = hf.run_forward(model, torch.tensor([ids], device=device), cache, position_ids=q_pos[None].to(device),
                                attention_mask=self.mask(q_pos, q_ctx, dtype=model.dtype, device=device),
                                logits_rows=rows)
        self.slot_pos = torch.cat([self.slot_pos, q_pos])
        self.slot_ctx = torch.cat([self.slot_ctx, q_ctx])
        self.sent += len(tokens)
        if copies:
            self.fed += len(copies)
            self.pending = []
        return logits

    def slot_positions(self, context: int = 0) -> torch.Tensor:
        """``[slots]`` position of each cache slot in ``context`` (-1 for the other contexts')."""
        return torch.where(self.slot_ctx == context, self.slot_pos, torch.full_like(self.slot_pos, -1))

    def reply_start(self, index: int) -> int:
        """Position of the reply's first token in framing ``index``."""
        return self.keep[index] + len(self.rules[index].lead_in)

    def context_ids(self, prompt_ids: torch.Tensor, index: int) -> tuple[int, ...]:
        """The last ids before the reply in framing ``index``."""
        keep, rule = self.keep[index], self.rules[index]
        ids = tuple(prompt_ids[max(0, keep - CONTEXT_TOKENS):keep].tolist()) + tuple(rule.lead_in)
        return ids[-CONTEXT_TOKENS:]


def record_framed_versions(model, framed: FramedDecode, cache, plan: CallPlan, segment: KVSegment, anchors,
                           rotator) -> tuple[int, float]:
    """Record the framed copies of ``segment`` (the reply of the call ``plan`` prefilled; its
    ``T`` ids are the first reply tokens the sender was fed; the copies get what they still
    lack first, :meth:`FramedDecode.flush`) as versions: framing ``i`` as pseudo-receiver
    ``framed_receiver(i)``'s offsets. Returns (versions recorded, seconds, the flush included)."""
    started = time.perf_counter()
    done = 0
    n = segment.num_tokens
    if n > framed.fed + len(framed.pending):
        return 0, time.perf_counter() - started
    if n > framed.fed:
        framed.flush(model, cache)
    if n > framed.fed:
        return 0, time.perf_counter() - started
    for index in range(len(framed.rules)):
        start = framed.reply_start(index)
        real = hf.kv_at_positions(cache, framed.slot_positions(index + 1), torch.arange(start, start + n))
        lead = len(framed.rules[index].lead_in)
        done += anchors.record_version(framed_receiver(index), segment, real, start,
                                       framed.context_ids(plan.prompt_ids, index), rotator,
                                       min_match=MIN_CONTEXT_MATCH + lead)
    return done, time.perf_counter() - started


class ReplyFramer:
    """An engine's framed replies: the framings learned, which calls feed copies, and the copies
    recorded after each reply.

    Args:
        config: the engine's :class:`~kvcomm_agents.config.KVCommConfig`.
        anchors: its :class:`~kvcomm_agents.anchors.KVCommAnchors`.
        info: its model facts (``sliding_window``, ``max_positions``, ``rotator``).
    """

    def __init__(self, config, anchors, info) -> None:
        self.config, self.anchors, self.info = config, anchors, info
        self.framings = ReaderFraming()

    @property
    def on(self) -> bool:
        c = self.config
        return c.method == "kvcomm" and c.experimental.recorded_versions and c.experimental.framed_replies

    def clear(self) -> None:
        self.framings.clear()

    def for_call(self, plan: CallPlan, agent: str, slot_positions: torch.Tensor, new_tokens: int, device, *,
                 calibrating: bool = False) -> Optional[FramedDecode]:
        """The copies this call's reply will be fed in, or None: framing off, no framing learned
        for ``agent``, anchors frozen, a sliding window, a call opted out of reuse or calibrating
        (its forwards stay exactly dense's), or prompt KV that was estimated (the copies would
        carry the estimate). ``slot_positions``: the prefill's ``[S]`` slot positions."""
        if (not self.on or self.anchors.frozen or self.info.sliding_window is not None
                or plan.dense_reason == "reuse_off" or calibrating):
            return None
        n, limit = plan.num_prompt, self.info.max_positions
        rules = [r for r in self.framings.rules(agent)
                 if 0 < n - r.drop and (limit is None or n - r.drop + len(r.lead_in) + new_tokens <= limit)]
        if not rules or plan.observable_until() < n:
            return None
        return FramedDecode(rules, slot_positions, n, chunk=copy_chunk(device))

    def after_call(self, model, plan: CallPlan, framing: Optional[FramedDecode], cache,
                   reply: Optional[KVSegment]) -> tuple[int, float]:
        """Learn the framings this call gave others' replies; record its own ``reply``'s copies
        (fed in ``framing``) as versions. Returns (versions recorded, seconds)."""
        if not self.on or self.anchors.frozen:
            return 0, 0.0
        self.framings.learn(plan)
        if framing is None or reply is None or not reply.context_ids:
            return 0, 0.0
        return record_framed_versions(model, framing, cache, plan, reply, self.anchors, self.info.rotator)
