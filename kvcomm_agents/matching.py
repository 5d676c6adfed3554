"""Find shared text in a prompt: stored segments located as runs of the prompt's own token ids.

Three passes. First, a message's shared text is found by its ``segment`` reference or verbatim by
content, then matched token by token: a prompt token matches a segment token when its id and its
character offset inside the shared text agree with the segment's. Edge tokens that tokenize
differently in context do not match (they are computed). Then (``shared_runs="spans"``) a run of
an earlier prompt holding short found texts with 64 ids of the same text before each
takes their place (:func:`find_spans`). Last, the prompt positions no occurrence covers are
scanned for runs of token ids that any stored entry holds (an earlier call's message, reply or
whole prompt), wherever they sit (:meth:`~.kv.store.SegmentStore.find_runs`): the task
text embedded in a new message, a reply quoted in part. No model needed: token ids, character
offsets, the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from pydantic import ValidationError

from .kv.segments import CONTEXT_TOKENS, KVSegment, SegmentRef
from .kv.store import SegmentStore
from .prompt import PromptLayout

__all__ = ["Occurrence", "TokenMatch", "find_occurrences", "find_shared", "find_spans", "find_token_matches",
           "match_runs"]


@dataclass(frozen=True)
class Occurrence:
    """Shared text located in one message: characters ``[start, start + limit)`` of the prompt
    text hold the segment's characters ``[0, limit)``.

    ``failure`` says why it cannot be reused (``not_found``, ``evicted``, ``foreign_model``,
    ``bad_reference``, ``not_in_prompt``); ``edited``: the message no longer holds the whole segment text.
    """

    message_index: int
    segment: Optional[KVSegment]
    segment_id: str
    ref: Optional[SegmentRef]
    start: int = 0
    limit: int = 0
    found_by: str = "content"
    failure: Optional[str] = None
    edited: bool = False

    def token_span(self, layout: PromptLayout) -> tuple[int, int]:
        """Prompt tokens ``[start, end)`` of the occurrence; a failed one's: its message's (what
        the decision reports); an edited one holding no whole token: empty, at its message's start
        (its message's tokens stay free for token runs)."""
        tokens = layout.tokens_within(self.start, self.start + self.limit)
        if len(tokens):
            return (tokens.start, tokens.stop)
        span = layout.content_spans[self.message_index]
        if span is None:
            return (0, 0)
        tokens = layout.tokens_within(*span)
        return (tokens.start, tokens.stop if self.failure is not None else tokens.start)


@dataclass(frozen=True)
class TokenMatch:
    """A run of prompt tokens ``[prompt_start, prompt_start + length)`` equal to the stored
    ``segment``'s tokens ``[segment_start, segment_start + length)``, found by token ids."""

    segment: KVSegment
    prompt_start: int
    segment_start: int
    length: int
    message_index: int
    found_by: str = "tokens"  # "span": a run of an earlier prompt in place of the short texts it holds (find_spans)

    edited = False
    failure = None

    @property
    def segment_id(self) -> str:
        return self.segment.id

    @property
    def ref(self) -> SegmentRef:
        return self.segment.ref

    def token_span(self, layout: PromptLayout) -> tuple[int, int]:
        return (self.prompt_start, self.prompt_start + self.length)


def find_shared(layout: PromptLayout, store: SegmentStore, fingerprint: str, prefix_length: int,
                searched: str, longer_than: int) -> list[Occurrence | TokenMatch]:
    """Every shared text of the prompt, in prompt order (message order where spans tie): the
    segments its messages refer to or contain; with ``searched="spans"``, runs of earlier prompts
    holding some of them (texts of at most ``longer_than`` ids) with the text around them in their
    place (:func:`find_spans`); with ``"spans"`` or ``"anywhere"``, every other shared token run
    (:func:`find_token_matches`). ``searched``: ``KVCommConfig.shared_runs``."""
    found: list = find_occurrences(layout, store, fingerprint)
    if searched == "spans":
        found, spans = find_spans(layout, store, fingerprint, found, prefix_length, longer_than)
        found += spans
    if searched in ("spans", "anywhere"):
        found += find_token_matches(layout, store, fingerprint, found, prefix_length)
    found.sort(key=lambda item: item.token_span(layout)[0])
    return found


def find_token_matches(layout: PromptLayout, store: SegmentStore, fingerprint: str,
                       occurrences: list[Occurrence | TokenMatch], prefix_length: int) -> list[TokenMatch]:
    """Shared token runs inside messages' text, outside the exact prefix, the occurrences' spans
    and the last prompt token (whose logits start the reply), in prompt order. A run does not
    cross from one message's text into the template around it."""
    n = int(layout.ids.numel())
    free = _content(layout, prefix_length)
    for occ in occurrences:
        start, end = occ.token_span(layout)
        free[start:end] = False
    return [TokenMatch(segment, start, segment_start, length, _message_at(layout, start))
            for segment, start, segment_start, length in store.find_runs(layout.ids, fingerprint, free, n - 1)]


def find_spans(layout: PromptLayout, store: SegmentStore, fingerprint: str, occurrences: list[Occurrence],
               prefix_length: int, longer_than: int) -> tuple[list[Occurrence], list[TokenMatch]]:
    """Runs of earlier prompts holding short found texts (an earlier reader's prompt holding the
    question and the replies since, pasted alike), each after at least
    :data:`~.kv.segments.CONTEXT_TOKENS` ids of the run: there, a text's KV was computed after the
    same text it follows here, nearer to this prompt than its own segment's KV (computed after its
    producer's prompt), which a text of at most ``longer_than`` ids (``recompute_short_runs``)
    would have computed whole. The stretches of such a run around the texts it holds replace them.
    For each short text no run taken covers, the longest run through the 64 ids before it and
    past its end is looked up (:meth:`~.kv.store.SegmentStore.prefix_run_through`).

    Only exact prompts serve (KV as dense prefill computed it; a stored message may hold KV
    computed after re-rotated text). A text the run cannot hold (one held in part, a longer
    one, which its own segment and versions serve, or a short one within 64 ids of the run's
    start) is left to its own segment and splits the run: the stretches before and after it are
    spans of their own, and the ids of the run before it still count as the context of texts
    after it. A stretch counts where it is longer than ``longer_than`` ids (re-rotated, not
    computed whole). A message whose reference failed (``failure``) holds nothing else to reuse
    (runs stay inside one message's text), so no run replaces it. Returns the occurrences left,
    in their order, and the stretches, in prompt order."""
    n = int(layout.ids.numel())
    texts = sorted((span, i) for i, occ in enumerate(occurrences)
                   if occ.failure is None and (span := occ.token_span(layout))[0] < span[1])
    holdable = [(first, last) for (first, last), _ in texts
                if last - first <= longer_than and first - prefix_length >= CONTEXT_TOKENS]
    free = _content(layout, prefix_length) if holdable else None
    taken: set[int] = set()
    spans: list[TokenMatch] = []
    covered = prefix_length  # runs do not overlap: a later one is used from the end of the one before
    for first, last in holdable:
        if first < covered:
            continue  # inside a run already taken (held there, or left to its own segment)
        found = store.prefix_run_through(layout.ids, fingerprint, free, n - 1, first - CONTEXT_TOKENS,
                                         lambda start, length: start + length >= last)
        if found is None:
            continue
        segment, start, segment_start, length = found
        for a, b, held in _stretches(start, start + length, texts, longer_than, max(start, covered)):
            if b - a > longer_than:
                taken.update(held)
                spans.append(TokenMatch(segment, a, segment_start + a - start, b - a, _message_at(layout, a), "span"))
                covered = start + length
    return [occ for i, occ in enumerate(occurrences) if i not in taken], spans


def _stretches(start: int, end: int, texts: list[tuple[tuple[int, int], int]], longer_than: int,
               usable: int) -> Iterator[tuple[int, int, list[int]]]:
    """The stretches ``[first, last)`` of the run ``[start, end)`` from ``usable`` on that hold
    short texts, with the indices of the texts each holds. ``texts``: ``((first, last), index)``
    token spans, sorted. A text's context is the run from ``start``, whatever part is usable."""
    stretch, held = usable, []
    for (first, last), i in texts:
        if last <= usable or first >= end:
            continue
        if last - first <= longer_than and stretch <= first and last <= end and first - start >= CONTEXT_TOKENS:
            held.append(i)
            continue
        if held:  # a text the run cannot hold ends the stretch, and a new one starts after it
            yield stretch, first, held
            held = []
        stretch = max(stretch, last)
    if held:
        yield stretch, end, held


def _content(layout: PromptLayout, prefix_length: int) -> torch.Tensor:
    """``[n]`` bool: the prompt positions inside messages' text past the exact prefix."""
    free = torch.zeros(int(layout.ids.numel()), dtype=torch.bool)
    for span in layout.content_spans:  # message text only: template glue is cheap and context-bound
        if span is not None:
            tokens = layout.tokens_within(*span)
            free[tokens.start : tokens.stop] = True
    free[:prefix_length] = False
    return free


def _message_at(layout: PromptLayout, position: int) -> int:
    char = layout.offsets[position][0]
    for index, span in enumerate(layout.content_spans):
        if span is not None and span[0] <= char < span[1]:
            return index
    return -1


def match_runs(layout: PromptLayout, segment: KVSegment, start: int, limit: int) -> list[tuple[int, int, int]]:
    """Runs of prompt tokens that are the segment's own tokens.

    Args:
        layout: the prompt.
        segment: the stored segment.
        start: character offset in ``layout.text`` where the segment's text begins.
        limit: only the segment's characters ``[0, limit)`` may match (less than its length when
            the message was edited after the segment was made).

    Returns:
        ``(prompt_start, segment_start, length)`` for each maximal run of consecutive matches.
    """
    runs: list[list[int]] = []
    ids = layout.id_list()
    for j in layout.tokens_within(start, start + limit):
        s, e = layout.offsets[j]
        i = segment.index_of(s - start, ids[j])
        if i is None or segment.char_spans[i][1] != e - start:
            continue
        if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == i:
            runs[-1][2] += 1
        else:
            runs.append([j, i, 1])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _common_prefix_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _locate_reference(index: int, layout: PromptLayout, store: SegmentStore, fingerprint: str) -> Occurrence:
    try:
        ref = SegmentRef.coerce(layout.refs[index])
    except ValidationError:
        return Occurrence(index, None, "?", None, found_by="reference", failure="bad_reference")
    failure, segment = None, None
    if ref.fingerprint != fingerprint:
        failure = "foreign_model"
    else:
        segment = store.get(ref.id)
        if segment is None:
            failure = "evicted" if store.was_evicted(ref.id) else "not_found"
    content = layout.content(index)
    if failure is None and content is None:
        failure = "not_in_prompt"
    if failure is not None:
        return Occurrence(index, segment, ref.id, ref, found_by="reference", failure=failure)
    span_start = layout.content_spans[index][0]
    offset = content.find(segment.text)
    if offset >= 0:
        return Occurrence(index, segment, ref.id, ref, span_start + offset, len(segment.text), "reference")
    return Occurrence(index, segment, ref.id, ref, span_start, _common_prefix_chars(segment.text, content),
                      "reference", edited=True)


def find_occurrences(layout: PromptLayout, store: SegmentStore, fingerprint: str) -> list[Occurrence]:
    """Every stored segment a message refers to or contains, in message order."""
    found = []
    for index in range(len(layout.content_spans)):
        if index < len(layout.refs) and layout.refs[index] is not None:
            found.append(_locate_reference(index, layout, store, fingerprint))
            continue
        content = layout.content(index)
        if content is None:
            continue
        span_start = layout.content_spans[index][0]
        for segment, offset in store.find_in_text(content, fingerprint, min_chars=2):
            found.append(Occurrence(index, segment, segment.id, segment.ref, span_start + offset, len(segment.text)))
    return found
