"""Drafts for a decode step, looked up in the text the call already holds, else in recent replies.

Agents quote each other: a judge repeats a solver's answer, a reviewer the coder's lines, a
solver the question's numbers, and a reply often repeats its own prompt's wording. Where the
reply's last few ids occurred before in the prompt or the reply so far, the ids that followed
them there are a likely continuation: a draft (prompt lookup decoding; transformers' generate
offers it as ``prompt_lookup_num_tokens``). A decode step then feeds its token and the draft in
one forward and keeps the draft's ids for as long as the model's own pick from each row agrees
(:meth:`kvcomm_agents.decode_loop.DecodeLoop.advance`), so the reply is the one stepping token by
token gives, up to float rounding of a forward over several ids.

A forward of more ids costs more: on the embedded model on 2 CPU cores, 9 ids after 300 cached
cost ~1.9x one id (``benchmarks/results/draft-steps.json``), so a draft that is mostly refused
slows the step it rides on. Hence the length adapts per call: the first draft is 2 ids, a draft
accepted whole doubles the next one (up to the configured most), a refused one is cut to what
was accepted (at least 1); and the reply's last 3 ids are looked up, else its last 2. The cost
is not monotonic in the ids fed on every CPU: where the engine measured a forward of more ids
cheaper, the draft is made longer (:mod:`.step_costs`).

Where the call's own ids hold no match for the tail's n-gram of a given length, the engine's
last few replies are looked up for it before a shorter n-gram is tried (:class:`RecentReplies`,
``KVCommConfig.draft_recent_replies``): siblings answering the same task, or an agent's earlier
reply to a similar one, word their replies alike. Drafts only decide how many ids a step feeds,
never which are kept, so a draft from another request's reply changes no output beyond float
rounding; but that rounding, and the call's drafted and kept counts, then depend on what the
engine answered before (``draft_recent_replies=0``: only on the request itself).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional, Sequence

from .step_costs import StepCosts

__all__ = ["NgramDraft", "RecentReplies"]

NGRAM_SIZES = (3, 2)  # the n-gram lengths matched, longest first


def _index(ids: Sequence[int], ends: list[dict[tuple[int, ...], int]], start: int, sizes: tuple[int, ...]) -> None:
    """Record in ``ends`` (one dict per size), for each n-gram of ``ids`` followed by an id at
    ``start`` or later, the index of that id (a later occurrence replaces an earlier one)."""
    for end in range(start, len(ids)):
        for n, by_ngram in zip(sizes, ends):
            if end >= n:
                by_ngram[tuple(ids[end - n:end])] = end


class RecentReplies:
    """The ids of an engine's last ``keep`` replies, newest first, each with its n-gram index:
    the drafts a call's own ids do not hold. Thread-safe (calls finish on several threads).

    Args:
        keep: how many replies are kept (0: none, :meth:`add` does nothing).
        sizes: the n-gram lengths indexed, longest first.
    """

    def __init__(self, keep: int, sizes: tuple[int, ...] = NGRAM_SIZES) -> None:
        self.sizes = sizes
        self._replies: deque = deque(maxlen=max(0, keep))
        self._lock = threading.Lock()

    def add(self, ids: Sequence[int]) -> None:
        """Keep a finished reply's ids (the oldest kept one goes where ``keep`` are)."""
        if self._replies.maxlen == 0 or len(ids) <= min(self.sizes):
            return
        reply = [int(token) for token in ids]
        ends: list[dict[tuple[int, ...], int]] = [{} for _ in self.sizes]
        _index(reply, ends, 0, self.sizes)
        with self._lock:
            self._replies.appendleft((reply, ends))

    def following(self, tail: tuple[int, ...], size_index: int, k: int) -> list[int]:
        """Up to ``k`` ids that followed ``tail`` (an n-gram of ``sizes[size_index]`` ids) where it
        last occurred in the newest reply holding it; [] where none does."""
        with self._lock:
            replies = tuple(self._replies)
        for reply, ends in replies:
            end = ends[size_index].get(tail)
            if end is not None:
                return reply[end:end + k]
        return []

    def __len__(self) -> int:
        return len(self._replies)


class NgramDraft:
    """A call's ids so far and, for each n-gram of them (n in ``sizes``), where its last
    occurrence ended: :meth:`draft` proposes what followed the last occurrence of the ids' own
    tail, else (same n-gram length) what followed it in a recent reply.

    Args:
        ids: the call's ids so far (prompt, then the reply's ids chosen so far).
        most: the longest draft (``KVCommConfig.draft_tokens``).
        recent: the engine's recent replies, looked up for an n-gram the call's ids do not hold
            before a shorter one is tried (None: only the call's ids).
        sizes: the n-gram lengths matched, longest first.
        first: the first draft's length.
        costs: the engine's measured forward costs: a draft is made longer (up to ``most``, as
            far as the lookup found ids) where a forward of more ids was measured cheaper
            (:meth:`.step_costs.StepCosts.draft_length`); None: the adapted length alone.
    """

    def __init__(self, ids: Sequence[int], most: int, recent: Optional[RecentReplies] = None,
                 sizes: tuple[int, ...] = NGRAM_SIZES, first: int = 2, costs: Optional[StepCosts] = None) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        if recent is not None and recent.sizes != sizes:
            raise ValueError(f"recent replies index n-grams of {recent.sizes}, the draft matches {sizes}")
        self.ids: list[int] = []
        self.most, self.sizes, self.recent, self.costs = most, sizes, recent, costs
        self.length = min(first, most)  # the next draft's length
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in sizes]  # n-gram -> index just after it
        self._indexed = 0  # the n-grams ending before ids[_indexed] are in _ends (indexed when a draft is asked)
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        """Append the ids chosen since (a step's picks)."""
        self.ids.extend(int(token) for token in ids)

    def draft(self, room: int) -> list[int]:
        """What followed the last earlier occurrence of the ids' tail (the longest n-gram that
        occurred before: in the call's ids, else in a recent reply), at most ``min(room,
        length)`` ids, or more where measured forward costs favour a longer draft (``costs``);
        [] where none did."""
        if min(room, self.length) < 1:
            return []
        found = self._lookup(min(room, self.most if self.costs is not None else self.length))
        if self.costs is None or not found:
            return found
        return found[:self.costs.draft_length(min(room, self.length), len(found))]

    def _lookup(self, k: int) -> list[int]:
        """Up to ``k`` ids that followed the tail's last earlier occurrence; [] where none did."""
        _index(self.ids, self._ends, self._indexed, self.sizes)  # every n-gram ending before the newest id
        self._indexed = len(self.ids)
        for i, (n, ends) in enumerate(zip(self.sizes, self._ends)):
            if len(self.ids) > n:
                tail = tuple(self.ids[-n:])
                end = ends.get(tail)
                if end is not None:
                    return self.ids[end:end + k]
                if self.recent is not None:
                    found = self.recent.following(tail, i, k)
                    if found:
                        return found
        return []

    def settle(self, drafted: int, accepted: int) -> None:
        """After a draft of ``drafted`` ids of which the first ``accepted`` were kept: the next
        draft's length (doubled after a whole draft, a longer one than asked for included, else
        what was accepted, at least 1). The
        call counts what it drafted and kept (``CallStats.drafted_tokens``, ``accepted_tokens``)."""
        self.length = min(self.most, 2 * max(self.length, drafted)) if accepted == drafted else max(1, accepted)
