"""Shared prompt text computed in its later readers' framing by the first call that reads it.

Most graphs give every agent its own system text, then the shared input (the task, retrieved
documents, a problem statement): the first agent computes that input after *its* system text,
every later agent reads it after *another*. No version of the input fits them (its KV depends on
the text before it), so each either estimates offsets (over the KL budget on the embedded
model: re-rotation's KL on the paper's shape is 0.25) or computes the input again: in the
paper's shape, RAG and HumanEval pipelines, most of every downstream prompt.

**Learned** (ids only, :meth:`TextFraming.learn`): a reader's call that holds a stored user,
tool or document segment from its first token, at least :data:`~kvcomm_agents.framing.COVERED`
of it, right after a prefix of its own (at most :data:`MAX_PREFIX` ids from its prompt's first
id) that the segment's base context does not share, teaches a rule: "text after these
:data:`~kvcomm_agents.framing.ALIGN_IDS` ids (the segment's base context) is read by this reader
after this prefix". The latest rule per reader is kept, for at most :data:`MAX_READERS` readers
per context and :data:`MAX_CONTEXTS` contexts.

**Applied** (:meth:`TextFraming.copies_for`): a later call whose prompt computes new text right
after those ids feeds that text (to the end of its last message) after each reader's prefix, the
prefix's exact KV taken from the exact-prefix store (no copy where it was evicted), inside its
own forwards (:class:`~kvcomm_agents.framing.decode.FramedDecode`): no forward of its own. After
the reply each message segment the copy holds is recorded as a version under a pseudo-receiver
(:func:`record_text_versions`); the reader's planner finds it by its context, as any version.

What it costs, and where: the sender's forwards carry up to
:func:`~kvcomm_agents.framing.decode.text_rate` text ids per generated token (all copies), the
rest after the reply (``CallStats.framed_s``). The same ids a reader would compute in its
prefill, computed once per reader, earlier.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..kv.segments import CONTEXT_TOKENS, KVSegment, is_reply
from ..plan import CallPlan
from ..prompt import PromptLayout
from ..versions.match import same_window
from .decode import TextCopy
from .rules import ALIGN_IDS, COVERED, MAX_PREFIX, MAX_READERS, ReaderRule, ReadersByContext

__all__ = ["TextFraming"]


def _shared_text(item) -> Optional[KVSegment]:
    """The segment of a plan item that is shared user, tool or document text held from its first
    token (not a reply: those are framed by their sender, :mod:`.replies`)."""
    segment: KVSegment = item.segment
    if getattr(item, "own_text", False) or is_reply(segment.ref.kind):
        return None
    if len(segment.context_ids) < ALIGN_IDS or item.segment_start != getattr(item, "head", 0):
        return None
    if item.segment_start + item.length < COVERED * segment.num_tokens:
        return None
    return segment


class TextFraming:
    """Which readers read text that follows given ids, after which prefix (thread-safe; ids only)."""

    def __init__(self) -> None:
        self._readers = ReadersByContext()

    def learn(self, plan: CallPlan, agent: str) -> Optional[ReaderRule]:
        """Learn from ``agent``'s call: the first shared text its prompt holds right after a
        prefix of its own. Returns the rule, or None."""
        firsts = []
        for item in (*plan.runs, *plan.observations):
            segment = _shared_text(item)
            if segment is not None:
                firsts.append((item.prompt_start - item.segment_start, segment))
        if not firsts:
            return None
        start, segment = min(firsts, key=lambda pair: pair[0])
        prefix = tuple(plan.prompt_ids[:start].tolist())
        if not 0 < start <= MAX_PREFIX or same_window(prefix[-CONTEXT_TOKENS:], segment.context_ids[-CONTEXT_TOKENS:]):
            return None  # a conversation before it, or its base already fits
        return self._readers.remember(ReaderRule(tuple(segment.context_ids[-ALIGN_IDS:]), agent, prefix))

    def copies_for(self, plan: CallPlan, layout: PromptLayout, agent: str, store, fingerprint: str,
                   max_positions: Optional[int], rerotates: Callable[[str], bool] = lambda reader: False) -> list[TextCopy]:
        """The text copies ``agent``'s call feeds: at the first remembered context its prompt
        holds right before text it computes itself (at least half of it; the exact prefix may
        cover the text's first ids), that text to the end of the prompt's last message, after
        each other reader's prefix whose exact KV the store holds, unless ``rerotates(reader)``
        (the reader is served the text re-rotated)."""
        contexts = self._readers.by_context()
        if not contexts or not layout.content_spans or layout.content_spans[-1] is None:
            return []
        ids = plan.prompt_ids.tolist()
        end = layout.tokens_within(*layout.content_spans[-1]).stop
        computed = torch.zeros(len(ids), dtype=torch.bool)
        computed[plan.computed_positions()] = True
        copies: list[TextCopy] = []
        for start in range(ALIGN_IDS, end):
            rules = contexts.get(tuple(ids[start - ALIGN_IDS:start]))
            if not rules or 2 * int(computed[start:end].sum()) < end - start:
                continue  # text this call mostly reused: its readers have it already
            for rule in rules:
                if rule.reader == agent or rerotates(rule.reader) or (max_positions is not None and len(rule.prefix) + end - start > max_positions):
                    continue
                hit = store.longest_prefix(torch.tensor(rule.prefix, dtype=torch.long), fingerprint)
                if hit is None or hit[1] < len(rule.prefix):
                    continue  # the reader's prefix KV was evicted: no copy
                copies.append(TextCopy(tuple(ids[start:end]), rule.prefix,
                                       hit[0].kv.window(0, len(rule.prefix)), start))
            return copies[:MAX_READERS]  # the first shared text only
        return copies

    def clear(self) -> None:
        self._readers.clear()

