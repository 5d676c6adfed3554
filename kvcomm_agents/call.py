"""The steps of one agent call on a :class:`~kvcomm_agents.engine.KVCommEngine`'s parts.

Render (the engine) -> plan: exact prefix, re-rotated shared segments, the rest computed
(:mod:`.planner`) -> align the reused KV (:mod:`.alignment`) and prefill in one forward
(:mod:`.engines.hf`) -> the decode loop, or a teacher-forced reply (:mod:`.decode_loop`) -> keep
the reply's KV, the anchors' observations and the framed copies (:mod:`.capture`,
:mod:`.framing.framer`), now and then a dense audit (:mod:`.audit`) -> the call's
:class:`~kvcomm_agents.results.CallStats`. The engine's
public calls (``stream``, ``replay``) string these steps together.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from .alignment import assemble
from .checks import check_reuse
from .forwards import ForwardTally, charging
from .anchors import KVCommAnchors
from .audit import CallAuditor
from .capture import CallCapture
from .config import KVCommConfig
from .kv.own_text import OwnTextStore
from .kv.store import SegmentStore
from .identity import WeightsWatch
from .support import ModelInfo
from .versions import Versions
from .decode_loop import DecodeLoop
from .decoding import TextAccumulator
from .engines import hf
from .framing import FramedDecode, Framer
from .in_flight import CallsInFlight
from .kv.segments import SegmentRef
from .plan import CallPlan
from .planner import plan_call
from .prefill_cost import PrefillCost
from .rerotation_check import RerotationCheck
from .prompt import PromptLayout, normalize_messages
from .results import CallStats, ChatResult, ForwardedTokens

__all__ = ["CallSteps", "EngineParts", "PreparedCall"]

logger = logging.getLogger("kvcomm_agents")
Messages = Sequence[Mapping[str, Any]]


@dataclass
class PreparedCall:
    """A call up to its first token: the prompt, its plan, the filled cache, the timings."""

    layout: PromptLayout
    plan: CallPlan
    pre: hf.Prefill
    started: float
    plan_s: float
    hook_s: float
    align_s: float
    prefill_s: float
    framing: Optional[FramedDecode] = None  # the reply's framed copies, fed with the sender's forwards
    framed: tuple[int, float] = (0, 0.0)  # framed versions recorded after the reply, seconds
    steps: int = 0  # single decode steps that carried ``framing``
    steps_s: float = 0.0  # their seconds (what the reply copies riding on them are measured by)
    tally: ForwardTally = field(default_factory=ForwardTally)  # every token the call forwards, by purpose
    rerotation_checked: bool = False  # its re-rotation check ran (at its keep, or before a sibling read it)
    fingerprint: str = ""  # the model's when it prefilled: nothing of it is kept under other weights
    device: Optional[torch.device] = None  # where its input ids go (read once per call, not per step)
    batched_steps: int = 0  # decode steps run in one forward with other calls' (:mod:`.batched_decode`)
    drafted: int = 0  # draft ids fed with its decode steps (:mod:`.drafting`)
    accepted: int = 0  # of those, ids its reply kept


@dataclass(frozen=True)
class EngineParts:
    """What the steps of a call work on: an engine's state, shared by all its calls.

    ``plan_hook()``: the plan hook to run now (the engine's ``plan_hook`` bound to the engine;
    None when unset), read per call. ``refresh_weights()``: drop what was learned from weights
    that changed in place (the engine's reaction to :class:`~.identity.WeightsWatch`)."""

    model: Any
    config: KVCommConfig
    info: ModelInfo
    lock: Any
    weights: WeightsWatch
    calibrating: Any
    store: SegmentStore
    anchors: KVCommAnchors
    versions: Versions
    own_texts: OwnTextStore
    framer: Framer
    auditor: CallAuditor
    capture: CallCapture
    plan_hook: Callable[[], Optional[Callable[[CallPlan], CallPlan]]]
    refresh_weights: Callable[[], None]
    prefill_cost: Optional[PrefillCost] = None  # None: reuse is never weighed against a whole prefill
    rerotation_check: Optional[RerotationCheck] = None  # None: re-rotation is measured by audits only
    remember: Callable[[], None] = lambda: None  # after each call: new re-rotation samples remembered


class CallSteps:
    """The steps of one call, on an engine's :class:`EngineParts`. Each step takes the engine
    lock around its compute, never across a yield."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.model, self.config, self.info = parts.model, parts.config, parts.info
        self.lock, self.weights, self.calibrating = parts.lock, parts.weights, parts.calibrating
        self.store, self.anchors, self.own_texts = parts.store, parts.anchors, parts.own_texts
        self.versions, self.framer, self.auditor, self.capture = parts.versions, parts.framer, parts.auditor, parts.capture
        self.in_flight = CallsInFlight(parts.capture, min_gain=parts.config.min_match_tokens)
        self.decoding = DecodeLoop(self.model, self.config, self.lock, self.framer, self.info.eos_ids)

    @contextmanager
    def prepared(self, layout: PromptLayout, messages: Messages, agent: str, reuse: Optional[bool],
                 new_tokens: int, started: float) -> Iterator[PreparedCall]:
        """Plan, run the plan hook, align the reused KV and prefill: the call up to its first
        token, in one hold of the engine lock (a sibling planned after it finds it in flight,
        :mod:`.in_flight`). The store entries the plan uses stay pinned, and the call stays in
        flight, until the block ends."""
        check_reuse(reuse)
        tally = ForwardTally()
        with ExitStack() as held:
            with self.lock, torch.inference_mode(), charging(tally, "prompt"):  # anchor tensors are inference tensors
                if self.weights.changed():
                    self.parts.refresh_weights()
                if self.config.reuse and reuse is not False and agent not in self.config.dense_agents:
                    self.in_flight.share_with(layout.ids)
                    self.short_sample(layout, agent, tally)
                plan = self.plan(layout, agent, reuse, new_tokens)
                planned = time.perf_counter()
                hooked = planned  # hook_s is 0.0 when no hook ran
                hook = self.parts.plan_hook()
                if hook is not None and plan.runs:
                    plan = hook(plan)
                    hooked = time.perf_counter()
                held.enter_context(self.store.pinned(_pins(plan)))
                block = assemble(plan, self.info.rotator) if plan.reused_tokens else None
                assembled = time.perf_counter()
                pre = hf.prefill(self.model, plan.prompt_ids, plan.computed_positions(), block,
                                 plan.reused_positions() if block is not None else None, masked=bool(plan.runs))
                hf.wait_for(pre.logits.device)  # the prefill's end, not its launch (the first token waits anyway)
                done = time.perf_counter()
                align_s = (assembled - hooked) + pre.align_s
                self.framer.copy_cost.record_prefill(plan.num_prompt - plan.reused_tokens, done - hooked - align_s)
                device = self.decoding.device
                framing = self.framer.for_call(plan, layout, agent, self.info.fingerprint, pre.slot_positions,
                                               new_tokens, device, calibrating=self.calibrating.active)
                call = PreparedCall(layout, plan, pre, started, planned - started, hooked - planned, align_s,
                                    done - hooked - align_s, framing, tally=tally, fingerprint=self.info.fingerprint,
                                    device=device)
                if self.config.reuse and self.info.sliding_window is None:
                    held.callback(self.in_flight.add(layout, plan, pre, message_roles(messages),
                                                     before_shared=lambda: self.check_rerotation(call, agent)))
            yield call

    def short_sample(self, layout: PromptLayout, agent: str, tally: ForwardTally) -> None:
        """Before the model's first re-rotation sample, measure re-rotation on ``layout`` cut
        short (:meth:`~kvcomm_agents.rerotation_check.RerotationCheck.short_sample`, charged to
        the call as audit tokens): where it is clear, the call is planned re-rotated instead of
        computing its shared text to be measured. Under the engine lock, before the plan."""
        check = self.parts.rerotation_check
        if check is not None and self.info.sliding_window is None and check.short_sample_due(agent):
            with charging(tally, "audit"):
                check.short_sample(layout, agent)

    def plan(self, layout: PromptLayout, agent: str, reuse: Optional[bool], new_tokens: int) -> CallPlan:
        """The call's plan (:func:`~kvcomm_agents.planner.plan_call`), or dense with the reason
        (reuse off, the agent opted out, a sliding window the prompt and reply outgrow, reuse too
        little to pay for its masked forward: :mod:`.prefill_cost`)."""
        if not self.config.reuse:
            return CallPlan(layout.ids, dense_reason="reuse_off")
        refuse = None
        window = self.info.sliding_window
        if reuse is False or agent in self.config.dense_agents:
            refuse = "reuse_off"
        elif window is not None and layout.ids.numel() + new_tokens > window:
            refuse = "sliding_window"
        with self.store.catalog_read_once():
            return plan_call(layout, store=self.store, fingerprint=self.info.fingerprint, config=self.config,
                             agent=agent, refuse_reason=refuse, anchors=self.anchors, versions=self.versions,
                             own_texts=self.own_texts, calibrating=self.calibrating.active,
                             prefill_cost=self.parts.prefill_cost)

    def keep(self, call: PreparedCall, messages: Messages, agent: str,
             text: TextAccumulator) -> tuple[Optional[SegmentRef], Optional[float]]:
        """After the reply: recorded as a draft source (:mod:`.drafting`), a re-rotation check
        (:mod:`.rerotation_check`), keep its KV and what else the call computed, the audit, then
        the reply's versions in its readers' framing (:mod:`.framing`: fed with the decode, or
        over the audit's dense prefill where the prompt KV held estimates). Returns the reply's
        reference and the audit's KL (None when not audited)."""
        self.decoding.recent.add(text.ids)  # a draft source for the calls after it
        with self.lock, torch.inference_mode():
            self.decoding.release(call)  # its decode steps' KV back in its own cache
            self.check_rerotation(call, agent)  # before the call's KV is stored
            segment = self.capture_call(call, messages, agent, text.ids, text.text) if self.config.reuse else None
            with charging(call.tally, "audit"):
                audit = self.auditor.audit(call.plan, call.pre.logits, agent)
            audit_kl = audit.kl if audit is not None else None
            copies_after_audit = (audit is not None and self.framer.on
                                  and (call.framing is None or not call.framing.rules))
            dense = audit.dense if copies_after_audit else None  # else its prompt KV is freed now
            audit = None
            wanted = segment is not None and (call.framing is not None or copies_after_audit)
            reply = self.store.get(segment.id) if wanted else None
            tail = [i for i in text.ids[-1:] if i not in self.info.eos_ids]  # the reply's last id: never fed
            with self.anchors.recording(), charging(call.tally, "copies"):  # the versions do not evict each other
                call.framed = self.framer.after_call(self.model, call.plan, call.layout, agent, self.info.fingerprint,
                                                     call.framing, call.pre.cache, reply, tail,
                                                     steps=call.steps, steps_s=call.steps_s)
                if copies_after_audit:
                    done, seconds = self.framer.after_audit(self.model, call.plan, agent, self.info.fingerprint,
                                                            dense, reply, text.ids[:-1], tail)
                    call.framed = (call.framed[0] + done, call.framed[1] + seconds)
            self.parts.remember()
            return segment, audit_kl

    def check_rerotation(self, call: PreparedCall, agent: str) -> None:
        """The call's re-rotation check (:mod:`.rerotation_check`), once, where due: at its keep,
        or earlier when a sibling is about to read what it computed (:mod:`.in_flight`), so that
        the check never finds the call's own KV in the store (a check not due then is not taken
        later). Under the engine lock."""
        check = self.parts.rerotation_check
        if call.rerotation_checked or check is None:
            return
        call.rerotation_checked = True
        if check.due(call.plan, agent):
            with charging(call.tally, "audit"):
                check.check(call.layout, call.pre.logits, agent)

    def capture_call(self, call: PreparedCall, messages: Messages, agent: str, ids: list[int],
                     reply: str) -> Optional[SegmentRef]:
        """Keep what the call computed (:meth:`~kvcomm_agents.capture.CallCapture.keep_call`) from
        the sender's own cache slots; nothing where a sliding window dropped early KV or the
        weights changed since its prefill."""
        plan, cache = call.plan, call.pre.cache
        n = plan.num_prompt
        generated = ids[:-1]  # the last generated id was never fed: it has no KV
        slots = (call.framing.slot_positions(0) if call.framing is not None  # the framed copies' slots: -1
                 else torch.cat([call.pre.slot_positions, torch.arange(n, n + len(generated))]))
        if call.fingerprint != self.info.fingerprint:  # the weights changed while it answered
            logger.debug("weights changed during the call; nothing kept")
            return None
        if hf.num_cached(cache) != slots.numel():  # a sliding window dropped early KV
            logger.debug("cache holds %d of %d tokens; nothing kept", hf.num_cached(cache), slots.numel())
            return None
        return self.capture.keep_call(plan, agent, generated, reply, hf.kv_reader(cache, slots),
                                      self.kvcomm_anchors(), call.layout, message_roles(messages))

    def kvcomm_anchors(self) -> Optional[KVCommAnchors]:
        """The anchors to feed observations to (``method="kvcomm"`` only)."""
        return self.anchors if self.config.method == "kvcomm" else None

    def result(self, call: PreparedCall, agent: str, reuse: Optional[bool], text: TextAccumulator, finish: str,
               segment: Optional[SegmentRef], ttft: float, audit_kl: Optional[float]) -> ChatResult:
        """The call's :class:`~kvcomm_agents.results.ChatResult` with its stats."""
        plan = call.plan
        recomputed = 0 if plan.recompute is None else int(plan.recompute.numel())
        stats = CallStats(
            agent=agent,
            prompt_tokens=plan.num_prompt,
            reused_tokens=plan.reused_tokens,
            computed_tokens=plan.num_prompt - plan.reused_tokens,
            prefix_tokens=plan.prefix_length,
            generated_tokens=len(text.ids),
            batched_steps=call.batched_steps,
            drafted_tokens=call.drafted,
            accepted_tokens=call.accepted,
            ttft_s=ttft,
            align_s=call.align_s,
            plan_s=call.plan_s,
            prefill_s=call.prefill_s,
            hook_s=call.hook_s,
            recomputed_tokens=recomputed,
            total_s=time.perf_counter() - call.started,
            mode="reuse" if plan.runs else ("prefix" if plan.prefix else "dense"),
            dense_reason=plan.dense_reason,
            decisions=list(plan.decisions),
            opted_out=self.config.reuse and (reuse is False or agent in self.config.dense_agents),
            own_text_tokens=plan.own_text_tokens,
            framed_versions=call.framed[0],
            framed_s=call.framed[1],
            reused_spans=plan.reused_spans(),
            anchors_consulted=sum(d.gate.anchors for d in plan.decisions if d.gate is not None),
            anchor_bytes=self.anchors.nbytes() if self.config.method == "kvcomm" else 0,
            audit_kl=audit_kl,
            forwarded=ForwardedTokens(**call.tally.tokens),
        )
        return ChatResult(text=text.text, token_ids=list(text.ids), segment=segment, finish_reason=finish, stats=stats)


def _pins(plan: CallPlan) -> list:
    """Store entries a call uses (kept from eviction while it runs)."""
    return [run.segment for run in plan.runs] + ([plan.prefix.entry] if plan.prefix else [])


def message_roles(messages: Messages) -> list[tuple[Optional[str], Optional[str]]]:
    """Per message, ``(role, tool or speaker name)``: what a kept message's segment kind is named by."""
    return [(m.get("role"), m.get("name") or m.get("tool_call_id")) for m in normalize_messages(messages)]
