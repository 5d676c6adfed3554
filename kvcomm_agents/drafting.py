"""Drafts for a decode step, looked up in the text the call already holds.

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
was accepted (at least 1); and the reply's last 3 ids are looked up, else its last 2.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["NgramDraft"]


class NgramDraft:
    """A call's ids so far and, for each n-gram of them (n in ``sizes``), where its last
    occurrence ended: :meth:`draft` proposes what followed the last occurrence of the ids' own
    tail.

    Args:
        ids: the call's ids so far (prompt, then the reply's ids chosen so far).
        most: the longest draft (``KVCommConfig.draft_tokens``).
        sizes: the n-gram lengths matched, longest first.
        first: the first draft's length.
    """

    def __init__(self, ids: Sequence[int], most: int, sizes: tuple[int, ...] = (3, 2), first: int = 2) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.ids: list[int] = []
        self.most, self.sizes = most, sizes
        self.length = min(first, most)  # the next draft's length
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in sizes]  # n-gram -> index just after it
        self._indexed = 0  # the n-grams ending before ids[_indexed] are in _ends (indexed when a draft is asked)
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        """Append the ids chosen since (a step's picks)."""
        self.ids.extend(int(token) for token in ids)

    def draft(self, room: int) -> list[int]:
        """What followed the last earlier occurrence of the ids' tail (the longest n-gram that
        occurred before), at most ``min(room, length)`` ids; [] where none did."""
        k = min(room, self.length)
        if k < 1:
            return []
        for end in range(self._indexed, len(self.ids)):  # every n-gram ending before the newest id
            for n, ends in zip(self.sizes, self._ends):
                if end >= n:
                    ends[tuple(self.ids[end - n:end])] = end
        self._indexed = len(self.ids)
        for n, ends in zip(self.sizes, self._ends):
            if len(self.ids) > n:
                end = ends.get(tuple(self.ids[-n:]))
                if end is not None:
                    return self.ids[end:end + k]
        return []

    def settle(self, drafted: int, accepted: int) -> None:
        """After a draft of ``drafted`` ids of which the first ``accepted`` were kept: the next
        draft's length (doubled after a whole draft, else what was accepted, at least 1). The
        call counts what it drafted and kept (``CallStats.drafted_tokens``, ``accepted_tokens``)."""
        self.length = min(self.most, 2 * self.length) if accepted == drafted else max(1, accepted)
