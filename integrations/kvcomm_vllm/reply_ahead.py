"""A reply prefilled in its readers' prompts while it is being generated, as requests of their own.

In a graph, the agent after a sender reads the sender's reply the moment it is complete: on a
server that claims only what it can rebuild without holes (vLLM with the KVCOMM connector), the
claim ends where that reply starts, and the reader computes the reply and everything after it.
The HF engine can compute a reply in its readers' framing inside the sender's own decode steps
(``reply_copies=True``, ``kvcomm_agents.framing.replies``); a batching server has no decode steps to ride on, but it batches whatever
is waiting with the sender's decode. So while the sender streams its reply, the client sends,
every :data:`CHUNK` new ids, one one-token request per later reader: the reader's prompt as it
will be, up to the reply generated so far. Each is computed with exact prefixes only (the
server's ``prefix_only`` requests), over the previous one, so when the reader's own request
comes its claim is an exact prefix that reaches into the reply's last chunk: exact KV, the same
ids, nothing estimated. Compute is not saved, it is moved: the readers' prefill rides on the
sender's decode steps instead of waiting in front of each reader.

**Learned** (ids only, :meth:`ReplyAhead.learn`): when a reader's prompt holds an earlier call's
reply (its first :data:`ALIGN_IDS` ids, as the client tokenizes the reply's text), the ids
before it are aligned with that sender's prompt: ``reader_start + sender_prompt[a : N - drop] +
lead_in``. ``reader_start`` is the reader's own start (its system text, at most :data:`~kvcomm_agents.framing.rules.MAX_PREFIX`
ids), ``sender_prompt[:a]`` the sender's own start, ``drop`` the sender's ids after the text
the reader repeats (its closing line and generation header), ``lead_in`` the reader's ids
before the reply (``Solver 1 answered:``). The latest rule per (sender, reader) is kept.

**Applied** (:meth:`ReplyAhead.bases`): a prompt of that sender that starts with the same own
ids gives, per reader, ``reader_start + prompt[a : N - drop] + lead_in``; :func:`copy_prompt` appends
the reply's ids so far, less the last :data:`HOLD` (they may merge with what follows).

Pure bookkeeping over ids: no tensors, no framework.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from kvcomm_agents.framing import ALIGN_IDS, MAX_PREFIX, MAX_READERS, align_lead_in

__all__ = ["CopyRule", "ReplyAhead", "learn_copy_rule", "copy_prompt", "CHUNK", "HOLD"]

#: New reply ids between two copies for one reader (each copy is one more request, a small
#: prefill batched with the sender's decode steps; the reader computes at most this many reply
#: ids itself). On vLLM's CPU build (workload (b), one run each): 16 gave readers 2.72-5.13x
#: plain vLLM and the whole graph 0.85x; 32 gave 2.80-4.68x and 0.99-1.03x
#: (``benchmarks/LAB.md``, "Replies ahead").
CHUNK = 32
#: Last ids of the partial reply left out of a copy: a token at the end of a stream may merge
#: with the text after it once the reader's prompt is tokenized whole.
HOLD = 2
#: Senders whose last call is remembered to learn from.
MAX_SENDERS = 16


@dataclass(frozen=True)
class CopyRule:
    """``reader`` reads ``sender``'s reply after ``reader_start + prompt[len(sender_start) : N - drop]
    + lead_in``, where the sender's prompt starts with ``sender_start``."""

    sender: str
    reader: str
    sender_start: tuple[int, ...]
    reader_start: tuple[int, ...]
    drop: int
    lead_in: tuple[int, ...]

    def repeats(self, sender_prompt: Sequence[int], reader_prompt: Sequence[int]) -> bool:
        """Whether ``reader_prompt`` starts with this rule's base for ``sender_prompt`` up to its
        lead-in: the reader's own start, then the text the sender read."""
        base = self.base(sender_prompt)
        if base is None:
            return False
        before = base[:len(base) - len(self.lead_in)]
        return list(reader_prompt[:len(before)]) == before

    def base(self, prompt: Sequence[int]) -> Optional[list[int]]:
        """The reader's ids before the reply, for a sender ``prompt``; None when the prompt does
        not start with the sender's own ids or is too short."""
        prompt = list(prompt)
        a, end = len(self.sender_start), len(prompt) - self.drop
        if end - a < ALIGN_IDS or tuple(prompt[:a]) != self.sender_start:
            return None
        return list(self.reader_start) + prompt[a:end] + list(self.lead_in)


def _find_last(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """The last start of ``needle`` in ``haystack``, or -1."""
    n = len(needle)
    first = needle[0]
    for start in range(len(haystack) - n, -1, -1):
        if haystack[start] == first and list(haystack[start:start + n]) == list(needle):
            return start
    return -1


def learn_copy_rule(sender: str, sender_prompt: Sequence[int], reply_ids: Sequence[int], reader: str,
                    reader_prompt: Sequence[int]) -> Optional[CopyRule]:
    """The rule by which ``reader_prompt`` holds the reply ``reply_ids`` (the client's tokens of the
    reply's text) of a call on ``sender_prompt``; None when it does not hold it, or the text
    before it does not repeat the sender's prompt for at least :data:`ALIGN_IDS` ids."""
    p, q, r = list(sender_prompt), list(reader_prompt), list(reply_ids)
    if len(r) < ALIGN_IDS:
        return None
    s = _find_last(q, r[:ALIGN_IDS])
    aligned = align_lead_in(q[:s], p) if s >= ALIGN_IDS else None
    if aligned is None:
        return None
    cut, end = aligned
    common = ALIGN_IDS  # extended back to where the reader's own start and the sender's differ
    while common < min(cut, end) and q[cut - common - 1] == p[end - common - 1]:
        common += 1
    own = cut - common  # the reader's own start
    if own > MAX_PREFIX:
        return None
    return CopyRule(sender, reader, tuple(p[:end - common]), tuple(q[:own]), len(p) - end, tuple(q[cut:s]))


def copy_prompt(base: Sequence[int], reply_ids: Sequence[int]) -> list[int]:
    """A copy's prompt: the reader's ids before the reply, then the reply so far less :data:`HOLD`."""
    return list(base) + list(reply_ids[:max(len(reply_ids) - HOLD, 0)])


class ReplyAhead:
    """Which readers read each sender's reply, after which ids (thread-safe; ids only)."""

    def __init__(self) -> None:
        self._calls: OrderedDict[str, tuple[tuple[int, ...], tuple[int, ...]]] = OrderedDict()
        self._rules: dict[str, OrderedDict[str, CopyRule]] = {}
        self._lock = threading.Lock()

    def learn(self, reader: str, prompt: Sequence[int]) -> list[CopyRule]:
        """Learn from ``reader``'s prompt which remembered replies it holds, and how. A rule is
        dropped when the reader's prompt repeats the text the sender's latest call read (so it
        is that call's reader, not another graph's) but no longer holds its reply: the graph
        changed, and its copies would be computed for nothing."""
        learned = []
        with self._lock:
            calls = [(sender, call) for sender, call in self._calls.items() if sender != reader]
        for sender, (sender_prompt, reply) in calls:
            rule = learn_copy_rule(sender, sender_prompt, reply, reader, prompt)
            with self._lock:
                if sender not in self._calls:
                    continue  # forgotten meanwhile, its rules with it
                if rule is None:
                    kept = self._rules.get(sender, {}).get(reader)
                    if kept is not None and kept.repeats(sender_prompt, prompt):
                        del self._rules[sender][reader]  # the same text as the sender read, and no reply after it
                    continue
                learned.append(rule)
                readers = self._rules.setdefault(sender, OrderedDict())
                readers[reader] = rule
                readers.move_to_end(reader)
                while len(readers) > MAX_READERS:
                    readers.popitem(last=False)
        return learned

    def finished(self, sender: str, prompt: Sequence[int], reply_ids: Sequence[int]) -> None:
        """Remember ``sender``'s call (its prompt and its reply's ids as the client tokenizes the
        reply's text) to learn its readers from; a reply shorter than :data:`ALIGN_IDS` ids
        (nothing a reader could be recognised by) leaves the sender's last call remembered."""
        if len(reply_ids) < ALIGN_IDS:
            return
        with self._lock:
            self._calls[sender] = (tuple(prompt), tuple(reply_ids))
            self._calls.move_to_end(sender)
            while len(self._calls) > MAX_SENDERS:
                forgotten, _ = self._calls.popitem(last=False)
                self._rules.pop(forgotten, None)  # senders come and go (agents named per request): bounded

    def bases(self, sender: str, prompt: Sequence[int]) -> list[tuple[str, list[int]]]:
        """``(reader, ids before the reply)`` for each learned reader of ``sender``'s reply to
        ``prompt``; [] when none."""
        with self._lock:
            rules = list(self._rules.get(sender, {}).values())
        found = []
        for rule in rules:
            base = rule.base(prompt)
            if base is not None:
                found.append((rule.reader, base))
        return found

    def clear(self) -> None:
        with self._lock:
            self._calls.clear()
            self._rules.clear()
