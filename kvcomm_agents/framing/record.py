"""Copies recorded as versions: after a call fed its copies, each copy's KV becomes a version of
the segment it holds, under a framed pseudo-receiver, so that the reader's planner finds it by
its context (:class:`~kvcomm_agents.versions.Versions`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..engines import hf
from ..kv.segments import CONTEXT_TOKENS, KVSegment, is_reply
from ..plan import CallPlan
from ..prompt import PromptLayout
from ..versions.match import MIN_CONTEXT_MATCH, framed_receiver
from .decode import FramedDecode
from .rules import MAX_READERS

__all__ = ["record_framed_versions", "record_text_versions", "LEAD_OUT_RECEIVERS"]

#: Framed pseudo-receivers a lead-out version may take (the first that holds nothing of its
#: segment): as many as the text copies' (:data:`~.rules.MAX_READERS`), so that a lead-out adds
#: no offset stack of its own to a pool.
LEAD_OUT_RECEIVERS = MAX_READERS


def record_framed_versions(framed: FramedDecode, cache, plan: CallPlan, segment: Optional[KVSegment], versions,
                           rotator, store=None, fingerprint: str = "", turn: int = 0) -> int:
    """Record the framed copies of ``segment`` (the reply of the call ``plan`` prefilled; its
    ``T`` ids are the first reply tokens the sender was fed; None when the reply was not kept,
    too short) as versions: framing ``i`` as pseudo-receiver ``framed_receiver(i)``'s offsets;
    with ``store``, each framing's lead-out too (:func:`_record_lead_out`; also for a reply
    not kept: its readers compute the reply, then reuse the closing line). Call after
    :meth:`FramedDecode.flush`. Returns the versions recorded."""
    done = 0
    n = segment.num_tokens if segment is not None else 0
    if n > framed.fed:
        return 0
    for index in range(len(framed.rules)):
        if segment is not None:
            start = framed.reply_start(index)
            real = hf.kv_at_positions(cache, framed.slot_positions(index + 1), torch.arange(start, start + n))
            lead = len(framed.rules[index].lead_in)
            done += versions.record(framed_receiver(index), segment, real, start,
                                           framed.context_ids(plan.prompt_ids, index), rotator,
                                           min_match=MIN_CONTEXT_MATCH + lead)
        if store is not None:
            done += _record_lead_out(framed, cache, index, plan, versions, rotator, store, fingerprint, turn + index)
    return done


def _lead_out_receiver(versions, text: KVSegment, turn: int) -> Optional[str]:
    """The framed pseudo-receiver a lead-out version of ``text`` goes to: the first holding no
    version of it, else one holding a lead-out (a part of the segment), in turn (``turn``
    counts lead-outs recorded); never one holding a text copy's version (the whole segment).
    None when all hold text copies' versions."""
    names = [framed_receiver(i) for i in range(LEAD_OUT_RECEIVERS)]
    spans = [versions.span(name, text) for name in names]
    free = [name for name, span in zip(names, spans) if span is None]
    if free:
        return free[0]
    parts = [name for name, span in zip(names, spans) if span != (0, text.num_tokens) and span != (0, 0)]
    if not parts:
        return None
    name = parts[turn % len(parts)]
    versions.forget(name, text)
    return name


def _record_lead_out(framed: FramedDecode, cache, index: int, plan: CallPlan, versions, rotator,
                     store, fingerprint: str, turn: int) -> int:
    """Record framing ``index``'s lead-out (fed right after the reply ``segment``) as a version
    of the stored text its readers will find it in: the runs the store's token-run lookup gives
    for those ids (what a reader's planner finds, as long as no newer entry holds them), each
    under a framed pseudo-receiver (:func:`_lead_out_receiver`); the planner finds it there
    even where it matched the same ids to another stored text (``KVCommAnchors.homes``).
    Returns the versions recorded."""
    rule = framed.rules[index]
    if not rule.lead_out or not framed.led_out:
        return 0
    ids = torch.tensor(rule.lead_out, dtype=torch.long)
    first = framed.lead_out_start(index)
    real = hf.kv_at_positions(cache, framed.slot_positions(index + 1), torch.arange(first, first + len(ids)))
    # the copy's ids before it: every reply id it was fed (the stored reply may hold fewer: its
    # trailing ids whose text tokenizes otherwise on its own are left out), then the unfed ids
    before = framed.context_ids(plan.prompt_ids, index) + tuple(framed.reply_ids) + framed.unfed
    # the line's leading whitespace is left out: readers split it into other ids where the reply
    # ends in whitespace too (their runs start after it, :meth:`kvcomm_agents.planner._RunDecider._at_home`)
    skip = versions.token_texts.leading(rule.lead_out) if versions.token_texts is not None else 0
    done = 0
    for text, at, text_start, length in store.find_runs(ids[skip:], fingerprint,
                                                        torch.ones(len(ids) - skip, dtype=torch.bool), len(ids) - skip):
        at += skip
        if is_reply(text.ref.kind):
            continue  # a reply that repeats the closing line: not what readers read it as
        receiver = _lead_out_receiver(versions, text, turn)
        if receiver is None:
            continue
        context = (before + rule.lead_out[:at])[-CONTEXT_TOKENS:]
        if versions.record(receiver, text, real.window(at, at + length), first + at, context, rotator,
                                  min_match=MIN_CONTEXT_MATCH, segment_start=text_start):
            versions.homes.note(rule.lead_out[at:at + length], text.id, text_start)
            done += 1
    return done



def record_text_versions(framed: FramedDecode, layout: PromptLayout, store, fingerprint: str, versions,
                         rotator) -> int:
    """Record every message segment each text copy holds (stored by the sender's call, same
    ids) as a version under pseudo-receiver ``framed_receiver(i)`` for copy ``i``, its context the
    copy's ids before it. Call after :meth:`FramedDecode.flush` (which takes the copies out of
    the cache). Returns the versions recorded."""
    done = 0
    ids = layout.ids
    for index, text in enumerate(framed.texts):
        if text.kv is None:
            continue
        first, last = text.source_start, text.source_start + len(text.ids)
        for span in layout.content_spans:
            if span is None:
                continue
            tokens = layout.tokens_within(*span)
            if tokens.start < first or tokens.stop > last or tokens.stop <= tokens.start:
                continue
            segment = store.find_text(layout.text[span[0]:span[1]], fingerprint)
            if segment is None or segment.token_ids != tuple(ids[tokens.start:tokens.stop].tolist()):
                continue
            offset = tokens.start - first
            at = text.start + offset
            real = text.kv.window(offset, offset + len(tokens))
            done += versions.record(framed_receiver(index), segment, real, at, text.context_ids(offset),
                                           rotator, min_match=MIN_CONTEXT_MATCH)
    return done
