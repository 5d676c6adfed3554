"""The one object an engine's calls talk to about copies: which calls feed copies of their reply
(:mod:`.replies`) and of their shared prompt text (:mod:`.texts`, where it pays: :mod:`.cost`),
and the versions recorded after each reply (:mod:`.record`).
"""

from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence

import torch

from ..engines import hf
from ..kv.segments import KVSegment
from ..plan import CallPlan
from ..prompt import PromptLayout
from .cost import CopyCost
from .decode import FramedDecode, copy_chunk, text_rate, texts_alone
from .record import record_framed_versions, record_text_versions
from .replies import ReaderFraming
from .texts import TextFraming

__all__ = ["Framer"]


class Framer:
    """The framings learned from readers, the copies each call feeds, the versions recorded.

    Args:
        config: the engine's :class:`~kvcomm_agents.config.KVCommConfig`.
        anchors: its :class:`~kvcomm_agents.anchors.KVCommAnchors` (frozen or not; one call's
            records protect each other from the budget's evictions).
        versions: its :class:`~kvcomm_agents.versions.Versions` (where the copies are recorded).
        info: its model facts (``sliding_window``, ``max_positions``, ``rotator``).
        store: its :class:`~kvcomm_agents.kv.store.SegmentStore` (readers' prefixes, message segments).
    """

    def __init__(self, config, anchors, versions, info, store) -> None:
        self.config, self.anchors, self.versions, self.info, self.store = config, anchors, versions, info, store
        self.reply_framing = ReaderFraming()
        self.text_framing = TextFraming()
        self.copy_cost = CopyCost()  # copies against the engine's prefill
        self._turns = itertools.count()  # calls that recorded reply versions (lead-outs take turns)

    @property
    def on(self) -> bool:
        c = self.config
        return c.method == "kvcomm" and c.recorded_versions and (c.reply_copies or c.text_copies)

    def clear(self) -> None:
        self.reply_framing.clear()
        self.text_framing.clear()
        self.copy_cost.clear()

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
        rules = self._rules(agent, n, new_tokens) if plan.first_estimated() >= n else []
        texts = (self.text_framing.copies_for(plan, layout, agent, self.store, fingerprint, limit,
                                              rerotates=self._rerotates)
                 if self.texts_pay() else [])
        if not rules and not texts:
            return None
        return FramedDecode(rules, slot_positions, n, chunk=copy_chunk(device), texts=texts,
                            rate=text_rate(device, len(texts)), texts_alone=texts_alone(device))

    def texts_pay(self) -> bool:
        """Whether this call may feed text copies: ``text_copies`` on and, with
        ``copies_when_cheaper``, not measured to cost more per text id than the engine's own
        prefill (:mod:`.cost`: computed alone on a CPU, timed whole; riding on CUDA decode
        steps, what the steps took beyond plain ones)."""
        c = self.config
        if not c.text_copies:
            return False
        return not c.copies_when_cheaper or self.copy_cost.pays("text")

    def replies_pay(self) -> bool:
        """Whether calls may feed reply copies: ``reply_copies`` on and, with
        ``copies_when_cheaper``, not measured to cost more per copy id than the engine's own
        prefill (:mod:`.cost`, on every device: what the sender's steps took beyond plain ones)."""
        c = self.config
        return c.reply_copies and (not c.copies_when_cheaper or self.copy_cost.pays("reply"))

    def _rerotates(self, reader: str) -> bool:
        """Whether ``reader`` is served shared text re-rotated, measured within the KL budget
        (:meth:`~kvcomm_agents.anchors.tracker.OffsetTracker.rerotation_within_budget`): it gets
        no copy, of shared text or of replies (on one device a text copy costs about the prefill
        it saves; a reply copy rides on the sender's decode, which its extra queries and mask
        slow by more than the reader's prefill of the reply saved on the development range)."""
        # the anchors' budget, as the gate's: none without audits, so no reader is served re-rotated
        return (self.config.method == "kvcomm" and self.config.measured_rerotation
                and self.anchors.tracker.rerotation_within_budget(reader, self.anchors.kl_budget))

    def _rules(self, agent: str, n: int, new_tokens: int) -> list:
        """The reply framings learned for ``agent``'s replies that fit the model's positions after
        an ``n``-id prompt and ``new_tokens`` reply ids, and that some reader not served re-rotated
        (:meth:`_rerotates`) gave: a copy for readers who reuse the reply re-rotated is paid for
        in the sender's forwards and never read. Only where replies are served re-rotated at all
        (``experimental.rerotate_replies``): else a reader trusted with re-rotated text computes
        the reply, and the copy is what spares it that."""
        if not self.replies_pay():
            return []
        limit = self.info.max_positions
        framing = self.reply_framing
        rerotated = self.anchors.rerotate_replies
        return [r for r in framing.rules(agent)
                if 0 < n - r.drop and (limit is None or n - r.drop + len(r.lead_in) + new_tokens + 1  # + the tail
                                       + len(r.lead_out) <= limit)
                and not (rerotated and all(self._rerotates(reader) for reader in framing.readers(agent, r)))]

    def after_audit(self, model, plan: CallPlan, agent: str, fingerprint: str, dense, reply: Optional[KVSegment],
                    fed: Sequence[int], tail: Sequence[int] = ()) -> tuple[int, float]:
        """The reply copies of a call whose prompt KV held estimated offsets (none rode on its
        decode: they would carry the estimate), fed after the call over its audit's dense prefill
        ``dense`` (:class:`~kvcomm_agents.audit.Audit`: exact KV of the same prompt ids) and
        recorded as versions: as exact as a call without estimates makes them. A KL-budget
        probe is always audited, so the readers of a probe's reply still find it computed in
        their framing. ``fed``: the reply ids the sender was fed; ``tail``: as
        :meth:`after_call`'s. Returns (versions recorded, seconds)."""
        n = plan.num_prompt
        if (not self.on or self.anchors.frozen or self.info.sliding_window is not None or not fed
                or plan.first_estimated() >= n):
            return 0, 0.0
        rules = self._rules(agent, n, len(fed))
        if not rules:
            return 0, 0.0
        started = time.perf_counter()
        framing = FramedDecode(rules, dense.slot_positions, n, chunk=len(fed))
        framing.feed_copies(model, dense.cache, fed)
        framing.flush(model, dense.cache, tail)  # the lead-outs
        with self.anchors.recording():
            done = record_framed_versions(framing, dense.cache, plan, reply, self.versions, self.info.rotator,
                                          self.store, fingerprint, next(self._turns))
        hf.wait_for(hf.input_device(model))  # the copies' end, not their launch
        seconds = time.perf_counter() - started
        self.copy_cost.record_copies("reply", framing.reply_copy_ids, seconds)  # a forward of their own
        return done, seconds

    def after_call(self, model, plan: CallPlan, layout: PromptLayout, agent: str, fingerprint: str,
                   framing: Optional[FramedDecode], cache, reply: Optional[KVSegment],
                   tail: Sequence[int] = (), steps: int = 0, steps_s: float = 0.0) -> tuple[int, float]:
        """Learn the framings this call gave others' replies and shared text; feed the copies
        what they still lack and record them as versions. ``tail``: the reply's text ids never
        fed (its last generated id, unless an end of sequence). ``steps``, ``steps_s``: the
        sender's single decode steps that carried ``framing`` and their seconds, what the reply
        copies are measured by, and text copies where they rode on the same steps
        (:meth:`~.cost.CopyCost.record_riding`). Returns (versions recorded, seconds)."""
        if not self.on or self.anchors.frozen:
            return 0, 0.0
        if self.config.reply_copies:
            self.reply_framing.learn(plan, agent)
        if self.config.text_copies and plan.dense_reason != "reuse_off":
            self.text_framing.learn(plan, agent)
        replied = bool(framing and framing.rules)  # a reply not kept (too short) still leads out
        if reply is not None and not reply.context_ids:
            reply = None
        if framing is None or not (replied or framing.texts):
            return 0, 0.0
        started = time.perf_counter()
        framing.flush(model, cache, tail)
        done = 0
        alone_s = framing.texts_s  # text copies computed in forwards of their own (a CPU)
        with self.anchors.recording():  # this call's copies do not evict each other
            if replied:
                done += record_framed_versions(framing, cache, plan, reply, self.versions, self.info.rotator,
                                               self.store, fingerprint, next(self._turns))
            if framing.texts:
                recording = time.perf_counter()
                done += record_text_versions(framing, layout, self.store, fingerprint, self.versions,
                                             self.info.rotator)
                if framing.texts_alone:  # what the copies cost, against the prefill they spare
                    hf.wait_for(hf.input_device(model))
                    alone_s += time.perf_counter() - recording
                    self.copy_cost.record_copies("text", _text_copy_ids(framing), alone_s)
        # the copies that rode on the sender's steps: what the steps took beyond plain ones
        hf.wait_for(hf.input_device(model))
        riding = {"reply": framing.reply_copy_ids if replied else 0,
                  "text": 0 if framing.texts_alone else _text_copy_ids(framing)}
        self.copy_cost.record_riding(riding, steps, steps_s, time.perf_counter() - started - alone_s)
        return done, time.perf_counter() - started


def _text_copy_ids(framing: FramedDecode) -> int:
    """Text ids the framing's text copies computed for their readers."""
    return sum(len(t.ids) for t in framing.texts if t.kv is not None)
