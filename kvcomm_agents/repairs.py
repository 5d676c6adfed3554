"""What of a reused run is computed in context instead of reused: the run's repairs.

The ids right after a change of context deviate most from dense (a run's head, longer where the
run starts deep inside its text, after text of its own it no longer follows); the reader's
own text and first token attend most to the text right before them (the tail of a run that
ends there, and the whole of such a run where it moved past text it was never computed after);
a short re-rotated text deviates nearly whole (short runs). The settings are
``KVCommConfig.recompute_head``, ``recompute_cut_head``, ``recompute_tail``,
``recompute_short_runs`` and ``recompute_last_run``; :mod:`.planner` applies them run by run.
"""

from __future__ import annotations

from .kv.segments import CONTEXT_TOKENS, KVSegment
from .kv.store import SegmentStore

__all__ = ["TAIL_REACH", "computed_head", "cut_inside", "ends_near", "moved_past_its_context"]

#: A reused run ending at most this many ids before the prompt's end gives up its last
#: ``KVCommConfig.recompute_tail`` ids, or all of it where it moved (``recompute_last_run``).
TAIL_REACH = 64


def computed_head(head: int, length: int, whole_up_to: int = 0) -> int:
    """Tokens at the start of a reused run of ``length`` tokens computed in context: the whole
    run where it is at most ``whole_up_to`` tokens (``KVCommConfig.recompute_short_runs``) or
    ``head`` long, else its first ``head`` (``KVCommConfig.recompute_head``)."""
    if length <= 0:
        return 0
    return length if length <= whole_up_to else min(head, length)


def ends_near(prompt_length: int, start: int, length: int) -> bool:
    """Whether a run of ``length`` ids from prompt position ``start`` ends within
    :data:`TAIL_REACH` ids of the prompt's end: right before the reader's own text."""
    return prompt_length - (start + length) <= TAIL_REACH


def moved_past_its_context(segment: KVSegment, start: int, segment_start: int) -> bool:
    """Whether the run of ``segment`` from its id ``segment_start``, now at prompt position
    ``start``, follows over ``CONTEXT_TOKENS`` more ids than its KV was computed after: a task
    pasted after a document it never saw. A segment computed after a whole window of exact
    context counts from the position capture recorded (``KVSegment.computed_at``); one after a
    shorter exact context from that context's end (a stored prompt's view: from 0). Where capture
    recorded no context (a message or reply computed after estimated KV, which belongs to no
    text) the run is counted from the segment's own start, so that such a run pasted last deep
    in a prompt is computed: fidelity where the KV's context is not known. A whole window without
    a recorded position says nothing of what came before it: False."""
    context = len(segment.context_ids)
    if context < CONTEXT_TOKENS or tuple(segment.ref.kind) == SegmentStore.PREFIX_KIND:
        origin = context
    elif segment.computed_at is not None:
        origin = segment.computed_at
    else:
        return False
    return start - (segment_start + origin) > CONTEXT_TOKENS


def cut_inside(segment_start: int) -> bool:
    """Whether the first run of a segment's occurrence, from the segment's id
    ``segment_start``, starts a whole window (``CONTEXT_TOKENS``) inside it: its KV followed the
    segment's own earlier ids (a page's first lines, an earlier prompt's text), which the prompt
    does not hold right before the run (else the run would reach back over them), and deviates
    further into the run than after a change of the text before a segment's start
    (``KVCommConfig.recompute_cut_head``). Not for a later run of the occurrence: it follows the
    earlier runs, the segment's own text."""
    return segment_start >= CONTEXT_TOKENS
