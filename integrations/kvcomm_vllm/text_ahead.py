"""Shared input prefilled ahead in its later readers' framing, as requests of their own.

The HF engine can compute shared input (a task, retrieved documents) in each later reader's framing
inside the first reader's decode steps (``text_copies=True``, ``kvcomm_agents.framing.texts``). A serving engine that batches
requests (vLLM with the KVCOMM connector) has no such steps to ride on, but it batches: the
client sends, beside the first reader's request, one short request per later reader whose prompt
is that reader's own prefix (its system text and header) followed by the new text, one token
long. The server keeps each finished prompt as an exact prefix, so the later reader's own
request is served from it up to the end of the text: exact KV, no estimate, no audit needed.

**Learned** (ids only, :meth:`PrefillAhead.learn`): a reader's prompt that holds a message an
earlier prompt of another agent held (same content ids, at least :data:`ALIGN_IDS` of them)
after *other* ids teaches "text after these :data:`ALIGN_IDS` ids (the earlier prompt's ids
before it) is read by this reader after its prefix" (the reader's ids from its first up to the
message, at most :data:`MAX_PREFIX`). The latest rule per reader is kept, for at most
:data:`MAX_READERS` readers per context and :data:`MAX_CONTEXTS` contexts.

**Applied** (:meth:`PrefillAhead.copies_for`): a prompt whose message follows remembered ids and
holds text no recent prompt held gives, per other reader, the prompt ``prefix + text``.

What it costs: each copy's text ids once more per reader, computed beside the first reader's
request (continuous batching shares the forward; on a CPU it slows that request's prefill).
Pure bookkeeping over ids: no tensors, no framework.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional, Sequence

from kvcomm_agents.framing import ALIGN_IDS, MAX_PREFIX, MAX_READERS, ReaderRule, ReadersByContext

__all__ = ["PrefillAhead", "RECENT"]

#: Recent messages remembered (by their ids) to learn from and to tell new text from old.
RECENT = 256


class PrefillAhead:
    """Which readers read text that follows given ids, after which prefix (thread-safe).

    ``spans`` everywhere: the ``[start, end)`` token ranges of the prompt's message contents,
    in prompt order (:meth:`kvcomm_agents.prompt.PromptLayout.tokens_within` of each content span).
    """

    def __init__(self) -> None:
        self._readers = ReadersByContext()
        self._seen: OrderedDict[tuple[int, ...], tuple[str, tuple[int, ...]]] = OrderedDict()  # text -> (agent, ids before)
        self._lock = threading.Lock()

    def copies_for(self, agent: str, ids: Sequence[int], spans: Sequence[range]) -> list[tuple[str, list[int]]]:
        """``(reader, prompt ids)`` per other reader of the first message of this prompt that
        follows remembered ids and holds text no recent prompt held; [] when none."""
        ids = list(ids)
        with self._lock:
            for span in spans:
                text = tuple(ids[span.start:span.stop])
                rules = self._readers.after(ids[max(0, span.start - ALIGN_IDS):span.start])
                if len(text) < ALIGN_IDS or span.start < ALIGN_IDS or not rules or text in self._seen:
                    continue
                return [(rule.reader, list(rule.prefix) + list(text)) for rule in rules
                        if rule.reader != agent][:MAX_READERS]
        return []

    def learn(self, agent: str, ids: Sequence[int], spans: Sequence[range]) -> Optional[ReaderRule]:
        """Learn from ``agent``'s prompt (the first message another agent read after other ids),
        then remember its messages. Returns the rule learned, or None."""
        ids = list(ids)
        learned = None
        with self._lock:
            for span in spans:
                text = tuple(ids[span.start:span.stop])
                before = tuple(ids[max(0, span.start - ALIGN_IDS):span.start])
                seen = self._seen.get(text)
                if learned is None and seen is not None and seen[0] != agent and len(text) >= ALIGN_IDS \
                        and len(seen[1]) == ALIGN_IDS and seen[1] != before and 0 < span.start <= MAX_PREFIX:
                    learned = self._readers.remember(ReaderRule(seen[1], agent, tuple(ids[:span.start])))
                if len(text) >= ALIGN_IDS and seen is None:
                    self._seen[text] = (agent, before)
                if text in self._seen:
                    self._seen.move_to_end(text)
            while len(self._seen) > RECENT:
                self._seen.popitem(last=False)
        return learned

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
        self._readers.clear()
