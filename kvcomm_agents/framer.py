"""An engine's framed copies: which calls feed copies of their reply (:mod:`.framing`) and of
their shared prompt text (:mod:`.text_framing`), and the versions recorded after each reply.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence

import torch

from .framed_decode import FramedDecode, copy_chunk, text_rate
from .framing import ReaderFraming, record_framed_versions
from .kv.segments import KVSegment
from .plan import CallPlan
from .prompt import PromptLayout
from .text_framing import TextFraming, record_text_versions

__all__ = ["Framer"]


class Framer:
    """The framings learned from readers, the copies each call feeds, the versions recorded.

    Args:
        config: the engine's :class:`~kvcomm_agents.config.KVCommConfig`.
        anchors: its :class:`~kvcomm_agents.anchors.KVCommAnchors`.
        info: its model facts (``sliding_window``, ``max_positions``, ``rotator``).
        store: its :class:`~kvcomm_agents.kv.store.SegmentStore` (readers' prefixes, message segments).
    """

    def __init__(self, config, anchors, info, store) -> None:
        self.config, self.anchors, self.info, self.store = config, anchors, info, store
        self.framings = ReaderFraming()
        self.texts = TextFraming()
        self._turns = itertools.count()  # calls that recorded reply versions (lead-outs take turns)

    @property
    def on(self) -> bool:
        c = self.config
        return c.method == "kvcomm" and c.experimental.recorded_versions and (
            c.experimental.framed_replies or c.experimental.framed_texts)

    def clear(self) -> None:
        self.framings.clear()
        self.texts.clear()

    def for_call(self, plan: CallPlan, layout: PromptLayout, agent: str, fingerprint: str,
                 slot_positions: torch.Tensor, new_tokens: int, device, *,
                 calibrating: bool = False) -> Optional[FramedDecode]:
        """The copies this call feeds, or None: framing off, nothing learned for this call,
        anchors frozen, a sliding window, a call opted out of reuse or calibrating (its forwards
        stay exactly dense's). Reply copies also need prompt KV without estimated offsets (the
        copies would carry the estimate). ``slot_positions``: the prefill's ``[S]`` slot positions."""
        if (not self.on or self.anchors.frozen or self.info.sliding_window is not None
                or plan.dense_reason == "reuse_off" or calibrating):
            return None
        n, limit = plan.num_prompt, self.info.max_positions
        rules = []
        if self.config.experimental.framed_replies and plan.observable_until() >= n:
            rules = [r for r in self.framings.rules(agent)
                     if 0 < n - r.drop and (limit is None or n - r.drop + len(r.lead_in) + new_tokens + 1  # + the tail
                                            + len(r.lead_out) <= limit)]
        texts = (self.texts.copies_for(plan, layout, agent, self.store, fingerprint, limit)
                 if self.config.experimental.framed_texts else [])
        if not rules and not texts:
            return None
        return FramedDecode(rules, slot_positions, n, chunk=copy_chunk(device), texts=texts,
                            rate=text_rate(device, len(texts)))

    def after_call(self, model, plan: CallPlan, layout: PromptLayout, agent: str, fingerprint: str,
                   framing: Optional[FramedDecode], cache, reply: Optional[KVSegment],
                   tail: Sequence[int] = ()) -> tuple[int, float]:
        """Learn the framings this call gave others' replies and shared text; feed the copies
        what they still lack and record them as versions. ``tail``: the reply's text ids never
        fed (its last generated id, unless an end of sequence). Returns (versions recorded,
        seconds)."""
        if not self.on or self.anchors.frozen:
            return 0, 0.0
        if self.config.experimental.framed_replies:
            self.framings.learn(plan)
        if self.config.experimental.framed_texts and plan.dense_reason != "reuse_off":
            self.texts.learn(plan, agent)
        replied = bool(framing and framing.rules)  # a reply not kept (too short) still leads out
        if reply is not None and not reply.context_ids:
            reply = None
        if framing is None or not (replied or framing.texts):
            return 0, 0.0
        started = time.perf_counter()
        framing.flush(model, cache, tail)
        done = 0
        with self.anchors.recording():  # this call's copies do not evict each other
            if replied:
                done += record_framed_versions(framing, cache, plan, reply, self.anchors, self.info.rotator,
                                               self.store, fingerprint, next(self._turns))
            if framing.texts:
                done += record_text_versions(framing, layout, self.store, fingerprint, self.anchors,
                                             self.info.rotator)
        return done, time.perf_counter() - started
