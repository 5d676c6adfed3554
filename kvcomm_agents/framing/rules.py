"""What copies learn from readers' prompts: the shared constants, the lead-in alignment, and the
rule "text after these ids is read by this reader after its own prefix".

Used by the HF engine's copies (:mod:`.replies`, :mod:`.texts`) and by the vLLM client's copies
(``kvcomm_vllm.text_ahead``, ``kvcomm_vllm.reply_ahead``), so that both learn the same rules
from the same ids. Pure bookkeeping over ids: no tensors, no framework.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from ..recent import RecentDict
from ..versions.match import MIN_CONTEXT_MATCH

__all__ = ["ALIGN_IDS", "MAX_LEAD_IN", "MAX_PREFIX", "MAX_READERS", "MAX_CONTEXTS", "COVERED", "ReaderRule",
           "ReadersByContext", "align_lead_in"]

#: Ids of a sender's prompt a reader's text must repeat right before a lead-in, and the ids
#: before a shared text that key a rule: as many as a version's context must match
#: (:data:`~kvcomm_agents.versions.match.MIN_CONTEXT_MATCH`), so that a shared role header alone
#: never qualifies.
ALIGN_IDS = MIN_CONTEXT_MATCH
#: Longest lead-in (ids between the repeated text and the reply) taken for a framing; longer
#: means the reader put other text there, not a framing.
MAX_LEAD_IN = 40
#: Longest reader prefix (ids before the shared text, from its prompt's first id) a copy is
#: computed after: a system text and a header, not a conversation.
MAX_PREFIX = 512
#: Readers per shared text or per sender (each costs the text's ids once more).
MAX_READERS = 4
#: Sender contexts (the ids before a shared text) whose readers are remembered.
MAX_CONTEXTS = 8
#: Share of a reply or shared text a reader's prompt must hold from its first token for its
#: framing to be learned (the text pasted whole, not a sentence of it that another text repeats).
COVERED = 0.9


@dataclass(frozen=True)
class ReaderRule:
    """Text after ``after`` (the last :data:`ALIGN_IDS` ids before it where it was first read)
    is read by ``reader`` right after ``prefix`` (the reader's ids from its prompt's first)."""

    after: tuple[int, ...]
    reader: str
    prefix: tuple[int, ...]


class ReadersByContext:
    """The latest :class:`ReaderRule` per reader, for at most ``max_readers`` readers per
    context and ``max_contexts`` contexts, the most recent last (thread-safe)."""

    def __init__(self, *, max_readers: int = MAX_READERS, max_contexts: int = MAX_CONTEXTS) -> None:
        self.max_readers, self.max_contexts = max_readers, max_contexts
        self._rules = RecentDict(max_contexts)  # context ids -> RecentDict(reader -> ReaderRule)
        self._lock = threading.Lock()

    def remember(self, rule: ReaderRule) -> ReaderRule:
        """Keep ``rule`` as its reader's latest for its context; the oldest reader and the
        oldest context go beyond the bounds."""
        with self._lock:
            self._rules.touch(rule.after, lambda: RecentDict(self.max_readers))[rule.reader] = rule
        return rule

    def by_context(self) -> dict[tuple[int, ...], list[ReaderRule]]:
        """A snapshot: each remembered context's rules, oldest reader first."""
        with self._lock:
            return {after: list(readers.values()) for after, readers in self._rules.items()}

    def after(self, ids: Sequence[int]) -> list[ReaderRule]:
        """The rules of the context ``ids`` (its last :data:`ALIGN_IDS` ids), oldest reader first."""
        with self._lock:
            return list(self._rules.get(tuple(ids), {}).values())

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()


def align_lead_in(before: Sequence[int], sender: Sequence[int], *, align: int = ALIGN_IDS,
                  max_lead_in: int = MAX_LEAD_IN) -> Optional[tuple[int, int]]:
    """Where a reader's ids ``before`` a reply repeat the sender's prompt ``sender``: the shortest
    lead-in ``before[cut:]`` after which ``before``'s last ``align`` ids occur in ``sender``,
    ending at ``sender[:end]`` (its latest occurrence). ``(cut, end)``, or None when no lead-in
    of at most ``max_lead_in`` ids has one. Shared by the HF engine's reply copies
    (:func:`kvcomm_agents.framing.replies.learn_rule`) and the vLLM client's
    (``kvcomm_vllm.reply_ahead.learn_copy_rule``)."""
    before, sender = list(before), list(sender)
    if len(sender) < align:
        return None
    ends: dict[tuple[int, ...], int] = {}
    for end in range(align, len(sender) + 1):
        ends[tuple(sender[end - align:end])] = end  # the latest occurrence wins
    for lead in range(0, min(max_lead_in, len(before) - align) + 1):
        cut = len(before) - lead
        end = ends.get(tuple(before[cut - align:cut]))
        if end is not None:
            return cut, end
    return None
