"""Which computed version of a segment's KV fits a new context best.

A token's KV depends on the text before it, the nearest text most. A segment has one *base*
version (its KV where it was first computed: the sender's generation context for a reply, the
first prompt holding a user message) and, once receivers computed it with exact context (a new
anchor's prefill, an audit's dense pass), one *recorded* version per such receiver: base plus
that receiver's recorded offsets. A version whose context matches the new prompt's text right
before the segment over its whole window is reused as it is (the base with no offsets, a
recorded version with its receiver's offsets): observed, not estimated from other segments.
Where none matches, KVCOMM's gate decides (:mod:`.gate`).

Measured on the embedded model (anchors recorded for every receiver of 16 GSM8K debates and 4
RAG hand-offs; relative squared error of the offsets, 0 exact, 1 as far off as re-rotation
only): a reply's offsets recorded for another receiver, whose prompt has the same text before
the reply, are off by 0.001-0.08; the mean of other anchors' offsets (KVCOMM's estimate) by
0.45-1.16 (docs/anchors.md, "Recorded versions").

Contexts are compared as the longest common suffix of their last ids (at most
:data:`~kvcomm_agents.kv.segments.CONTEXT_TOKENS`), extended through the segment's own ids
when a run starts inside the segment; ids a run holds itself before its first reused token (its
recomputed head) are left out of the count: they match every version, whatever text came before
the run. With a tokenizer's texts, as the common suffix of their
text (:mod:`kvcomm_agents.versions.token_texts`). Pure bookkeeping over ids, no tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..kv.segments import CONTEXT_TOKENS, KVSegment
from ..anchors.pool import AnchorPool
from ..recent import RecentDict

__all__ = ["RecordedVersion", "VersionHomes", "common_suffix", "same_window", "best_recorded_version", "MIN_CONTEXT_MATCH",
           "READERS", "HOMES", "framed_receiver", "is_framed"]

#: Ids of context that say two texts follow the same text (framing rules align on them; a framed
#: copy's version needs this many beyond its lead-in): twice the default ``min_match_tokens``, so
#: that a shared role header alone never qualifies (a named heuristic, not tuned). A version is
#: reused only where its whole context window matches (:func:`best_recorded_version`).
MIN_CONTEXT_MATCH = 16

#: Prefix of the pseudo-receivers whose recorded offsets are a reply's versions in its readers'
#: framing, computed by the sender (:mod:`kvcomm_agents.framing`). Never an agent's name in
#: practice: it opens with a parenthesis and holds spaces.
READERS = "(readers' framing"


#: Texts whose version's home segment is remembered (:class:`VersionHomes`).
HOMES = 64


class VersionHomes:
    """Where a version of a short text was recorded (a lead-out, :mod:`kvcomm_agents.framing`):
    the same ids are held by many stored texts, and the planner's lookup may match them to
    another one than the version went to (thread-safe; the latest :data:`HOMES` texts)."""

    def __init__(self) -> None:
        self._homes = RecentDict(HOMES)  # ids -> (segment id, start)
        self._lock = threading.Lock()

    def note(self, ids: Sequence[int], segment_id: str, start: int) -> None:
        """A version of ``ids`` was recorded on segment ``segment_id`` from its token ``start``."""
        with self._lock:
            self._homes[tuple(ids)] = (segment_id, start)

    def of(self, ids: Sequence[int]) -> Optional[tuple[str, int]]:
        """``(segment id, start)`` where a version of exactly ``ids`` was last recorded, or None."""
        with self._lock:
            return self._homes.get(tuple(ids))

    def clear(self) -> None:
        with self._lock:
            self._homes.clear()


def framed_receiver(index: int) -> str:
    """The pseudo-receiver recording framing rule ``index``'s versions."""
    return f"{READERS} {index})"


def is_framed(receiver: Optional[str]) -> bool:
    """Whether recorded offsets of ``receiver`` are a framed version."""
    return receiver is not None and receiver.startswith(READERS)


@dataclass(frozen=True)
class RecordedVersion:
    """The version to reuse: ``receiver``'s recorded offsets of the segment in pool slot
    ``slot``, or the base itself (``receiver`` and ``slot`` None); its context matches the new
    prompt's for ``matched`` ids (the base's: ``base_matched``)."""

    receiver: Optional[str]
    slot: Optional[int]
    matched: int
    base_matched: int


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common suffix of two id sequences."""
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return n


def same_window(context: Sequence[int], other: Sequence[int],
                compare: Callable[[Sequence[int], Sequence[int]], int] = common_suffix) -> bool:
    """Whether two context windows (each the last at most
    :data:`~kvcomm_agents.kv.segments.CONTEXT_TOKENS` ids before a text) hold the same text as far
    as both reach: where one is shorter, it is a full window (the other's prompt then holds the
    same text before, which neither window sees) or both start their prompts. ``compare`` as in
    :func:`best_recorded_version` (text matching may cover the same text in fewer ids on one side)."""
    ours, theirs = compare(context, other) >= len(context), compare(other, context) >= len(other)
    return ((ours and theirs) or (ours and len(context) >= CONTEXT_TOKENS)
            or (theirs and len(other) >= CONTEXT_TOKENS))


def _context_at(context: Sequence[int], segment: KVSegment, from_token: int, at_token: int) -> tuple[int, ...]:
    """The last ids before segment token ``at_token`` in a pass whose ids before token
    ``from_token`` were ``context``."""
    return (tuple(context) + segment.token_ids[from_token:at_token])[-CONTEXT_TOKENS:]


def best_recorded_version(pool: Optional[AnchorPool], receiver: str, segment: KVSegment, first: int, last: int,
                          prompt_context: Sequence[int],
                          matched: Optional[Callable[[Sequence[int], Sequence[int]], int]] = None,
                          held: int = 0) -> Optional[RecordedVersion]:
    """The version of ``segment`` to reuse for segment tokens ``first..last`` (exclusive)
    preceded by ``prompt_context`` (the new prompt's ids before token ``first``), or None when
    no version's context window matches the new one whole: the last
    :data:`~kvcomm_agents.kv.segments.CONTEXT_TOKENS` ids, or, nearer a prompt's start, both
    prompts' every id before the run. A partial match is not enough: framed copies whose last
    16-47 ids matched (a lead-in, the end of a system text) served readers 5-50 times further from
    dense than re-rotation alone on the development range of the debate, one-message and fan-out
    workloads. The ``held`` ids right before ``first`` that the prompt holds as the segment's own
    tokens (a run's recomputed head) match every version by construction: they count toward no
    version's ``min_match``, and a match of nothing else is none.

    Candidates: the base, and the recorded versions (any receiver's) whose offsets cover
    ``first..last`` and whose context is known. The base goes first, then ``receiver``'s own
    version, then the first receiver recorded. ``matched(context,
    other)``: how many of ``context``'s last ids ``other`` matches (by default the common id
    suffix; :meth:`~kvcomm_agents.versions.token_texts.TokenTexts.matched` compares text, so the same
    text split into other ids still matches); a match is counted in the new prompt's ids.
    """
    wanted = tuple(prompt_context)[-CONTEXT_TOKENS:]
    compare = matched or common_suffix

    def matched_ids(context: tuple[int, ...]) -> int:  # the prompt's ids the match covers, beyond the held ones
        return max(0, compare(wanted, context) - held)

    def whole(context: tuple[int, ...]) -> bool:
        return same_window(wanted, context, compare)

    base_context = _context_at(segment.context_ids, segment, 0, first)
    base = matched_ids(base_context)
    best = RecordedVersion(None, None, base, base) if whole(base_context) else None
    slot = pool.slot_of(segment.id) if pool is not None else None
    for name, stack in (pool.placeholder.items() if slot is not None else ()):
        recorded = stack.contexts.get(slot)
        if recorded is None or slot >= stack.has.numel() or not bool(stack.has[slot]):
            continue
        if recorded.start > first or recorded.end < last:
            continue
        context = _context_at(recorded.ids, segment, recorded.start, first)
        matched = matched_ids(context)
        if matched < recorded.min_match or not whole(context):
            continue  # a framed copy: its lead-in alone does not make the text before it the same
        if best is None or (best.receiver is not None and name == receiver):
            best = RecordedVersion(name, slot, matched, base)
    return best if best is not None and best.matched >= 1 else None
