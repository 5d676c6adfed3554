"""KVCOMM for a runtime that computes prompts itself (vLLM, through its KV connector).

The HF engine plans, aligns, computes and keeps in one call. A serving engine such as vLLM owns
the compute, the paged KV memory and the scheduling; it asks, per request, how many prompt
tokens an external loader can provide, lets the loader write their KV, computes the rest, and
reports when the request has finished. :class:`KVCommBroker` answers those three moments with
the core's own parts, on token ids alone:

1. :meth:`plan`: the planner over an ids-only layout (shared text found as token runs, exact
   prefixes, anchors, recorded versions), cut at its first hole (:func:`~.claims.contiguous_claim`):
   the runtime cannot compute holes, so the claim is the reused prefix of the prompt;
2. :meth:`aligned`: the claimed KV, re-rotated and offset (:func:`~.alignment.assemble`);
3. :meth:`finish`: what the request computed becomes segments, exact prefixes, own-text KV and
   anchor observations (:meth:`~.capture.CallCapture.keep_call`), read through ``kv_at``; inline,
   or (``background=True``) on the broker's capture thread (:mod:`.capture_queue`), later plans
   that could read it waiting for it.

No runtime imports: the runtime adapter (``integrations/kvcomm_vllm``) moves KV between its
memory and :class:`~.kv.block.KVBlock` tensors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..alignment import assemble
from ..anchors import KVCommAnchors
from ..budgets import default_budgets
from ..capture import CallCapture, KVAt
from .capture_queue import EXIT_WAIT_S, CaptureQueue, CaptureTouch
from .claims import DENSE_TAIL, Claim, contiguous_claim
from ..config import KVCommConfig
from ..kv.block import KVBlock
from ..kv.block_count import BlockCount
from ..kv.own_text import OwnTextStore
from ..kv.rope import RopeRotator
from ..kv.shared import SharedSegments
from ..kv.store import SegmentStore
from ..planner import plan_call
from ..plan import CallPlan
from ..prompt import PromptLayout
from ..versions import Versions

__all__ = ["KVCommBroker", "BrokeredRequest", "for_runtime"]


def for_runtime(config: KVCommConfig) -> KVCommConfig:
    """``config`` adapted to a runtime without holes: no recomputed run heads or tails (each would end the
    claim), the receiver's own text reused from its own-text KV (otherwise the template glue after
    the first segment ends it), no audits (the runtime does not run the dense shadow pass yet),
    no framed copies of replies or shared text (they ride on the HF engine's own decode steps).
    Without audits the KL budget is never measured, so the broker serves no estimated offsets
    unless ``kl_budget=None`` (exact prefixes, versions and own text only: the HF engine's
    fidelity before its audits have measured the estimates)."""
    data = config.model_dump()
    data["audit_every"] = 0
    data.update(recompute_head=0, recompute_tail=0, recompute_short_runs=0, recompute_last_run=0, reply_copies=False,
                text_copies=False)
    data["experimental"] = {**data["experimental"], "own_text": "reuse"}
    return KVCommConfig(**data)


@dataclass
class BrokeredRequest:
    """One request between :meth:`KVCommBroker.plan` and :meth:`KVCommBroker.finish`."""

    agent: str
    claim: Claim

    @property
    def plan(self) -> CallPlan:
        return self.claim.plan


class KVCommBroker:
    """Plans claims and keeps finished requests' KV for a runtime that computes prompts itself.

    Args:
        tokenizer: the model's tokenizer (to align reply ids with their text).
        rotator: the model's re-rotation (:func:`~.support.rotator_from_config`).
        fingerprint: identifies model, dtype and tokenizer; stamped on every segment.
        config: settings, adapted with :func:`for_runtime`.
        device: where budgets are measured (the runtime's KV device).
        shared: a segment tier shared with other replicas (:mod:`.kv.shared`); None: this one only.
    """

    def __init__(self, tokenizer, rotator: RopeRotator, fingerprint: str, config: KVCommConfig,
                 device: torch.device | str = "cpu", shared: Optional[SharedSegments] = None):
        self.tokenizer, self.rotator, self.fingerprint = tokenizer, rotator, fingerprint
        self.config = c = for_runtime(config)
        store_budget, anchor_budget = default_budgets(torch.device(device))
        self.store = SegmentStore(c.store_max_bytes if c.store_max_bytes is not None else store_budget,
                                  min_run=c.min_match_tokens, shared=shared)
        freeze = BlockCount()
        self.anchors = KVCommAnchors.from_config(c, default_max_bytes=anchor_budget, freeze=freeze, can_audit=False)
        self.versions = Versions.from_config(c, self.anchors, tokenizer)
        self.own_texts = OwnTextStore(c.experimental.own_text_max_bytes, freeze)
        self._prefix_config = c.model_copy(update={"method": "exact_prefix", "experimental": c.experimental.model_copy(
            update={"own_text": "in_context"})})
        self.capture = CallCapture(self.store, tokenizer, rotator, fingerprint, c, self.own_texts)
        self._requests: dict[str, BrokeredRequest] = {}
        self._lock = threading.RLock()
        self._captures = CaptureQueue()

    # ---- the runtime's three moments ------------------------------------------------------
    def plan(self, request_id: str, prompt_ids: Sequence[int] | torch.Tensor, agent: str = "default", *,
             reuse: bool = True, held: int = 0, prefix_only: bool = False) -> Claim:
        """Plan a request once (later calls for the same id return the same claim).

        Args:
            request_id: the runtime's request id.
            prompt_ids: the prompt's ``[N]`` token ids.
            agent: the receiving agent (anchors and own text are per receiver).
            reuse: False: the request runs dense (reason ``reuse_off``); what it computes is kept.
            held: prompt tokens the runtime already holds (its own exact prefix cache).
            prefix_only: claim exact prefixes only (no token runs, versions or own text), so
                that what the request computes is exact and kept as an exact prefix: a client's
                copy of a later reader's prompt (:mod:`~kvcomm_vllm.reply_ahead`).
        """
        with self._lock:
            known = self._requests.get(request_id)
        if known is not None:  # vLLM asks again for a request still waiting for blocks
            return known.claim
        if reuse and self.config.reuse:
            self._captures.settle(agent, prompt_ids)  # the captures queued before it that it could read
        with self._lock:
            known = self._requests.get(request_id)
            if known is not None:
                return known.claim
            layout = PromptLayout.of_ids(prompt_ids)
            if not self.config.reuse:
                plan = CallPlan(layout.ids, dense_reason="reuse_off")
            else:
                with self.store.catalog_read_once():
                    plan = plan_call(layout, store=self.store, fingerprint=self.fingerprint,
                                     config=self._prefix_config if prefix_only else self.config,
                                     agent=agent, refuse_reason=None if reuse else "reuse_off",
                                     anchors=self.anchors if self.config.method == "kvcomm" else None,
                                     versions=self.versions, own_texts=self.own_texts)
            claim = contiguous_claim(plan, held, DENSE_TAIL)
            self._requests[request_id] = BrokeredRequest(agent, claim)
            return claim

    def claim(self, request_id: str) -> Optional[Claim]:
        """The claim planned for a pending request, or None."""
        request = self._requests.get(request_id)
        return None if request is None else request.claim

    def aligned(self, request_id: str) -> Optional[KVBlock]:
        """KV of the claimed positions ``0 .. claim.length`` (storage order = position order),
        keys at their prompt positions: ``[L, kv_heads, length, head_dim]`` per device group.
        None when the claim holds nothing reused."""
        request = self._requests[request_id]
        if request.plan.reused_tokens == 0:
            return None
        return assemble(request.plan, self.rotator)

    def finish(self, request_id: str, output_ids: Sequence[int], kv_at: Optional[KVAt], *,
               background: bool = False) -> dict[str, Any]:
        """Keep what a finished request computed and forget it; returns its report
        (:meth:`report`).

        Args:
            output_ids: every generated id (the last one has no KV).
            kv_at: the request's KV at ``[n]`` positions of prompt plus reply (None: the runtime
                could not read it, e.g. the request was aborted before its prefill; nothing kept).
            background: keep it on the broker's capture thread and return at once (``kv_at``
                must stay readable until then: a copy, not the runtime's live cache); a later
                :meth:`plan` that could read it (same agent, same first ids, or holding its
                reply or shared texts: :mod:`.capture_queue`) waits for it. A failure there is
                logged and costs later reuse only.
        """
        with self._lock:
            request = self._requests.pop(request_id, None)
        if request is None:
            return {}
        report = self._report(request)
        if kv_at is not None and self.config.reuse:
            generated = [int(t) for t in output_ids][:-1]
            if background:
                touch = CaptureTouch.of(request.agent, request.plan.prompt_ids, generated,
                                        [d.span for d in request.plan.decisions])
                self._captures.submit(touch, lambda: self._keep(request, generated, kv_at))
            else:
                self._keep(request, generated, kv_at)
        return report

    def settle(self) -> None:
        """Wait until every capture queued by ``finish(..., background=True)`` has been kept."""
        self._captures.settle()

    def close(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """Keep the captures queued by ``finish(..., background=True)`` (for at most
        ``timeout_s``; those left are dropped, logged) and end the capture thread, so that a
        runtime shutting down leaves no thread behind. The store, anchors and shared tier stay as
        they are: ``plan`` and ``finish`` go on working, a background ``finish`` then keeping its
        capture inline. A second call does nothing."""
        self._captures.close(timeout_s)

    @property
    def pending_captures(self) -> int:
        """Captures queued by ``finish(..., background=True)`` and not yet kept."""
        return self._captures.pending

    def _keep(self, request: BrokeredRequest, generated: list[int], kv_at: KVAt) -> None:
        with self._lock, torch.inference_mode():
            reply = self.tokenizer.decode(generated, skip_special_tokens=True)
            self.capture.keep_call(request.plan, request.agent, generated, reply, kv_at,
                                   self.anchors if self.config.method == "kvcomm" else None)

    def drop(self, request_id: str) -> None:
        """Forget a request without keeping anything (aborted, or its load failed)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def report(self, request_id: str) -> dict[str, Any]:
        """JSON-safe summary of a pending request's claim (see :meth:`finish`)."""
        request = self._requests.get(request_id)
        return {} if request is None else self._report(request)

    @staticmethod
    def _report(request: BrokeredRequest) -> dict[str, Any]:
        plan, claim = request.plan, request.claim
        return {
            "agent": request.agent,
            "prompt_tokens": plan.num_prompt,
            "reused_tokens": claim.length,
            "prefix_tokens": plan.prefix_length,
            "own_text_tokens": plan.own_text_tokens,
            "computed_tokens": plan.num_prompt - claim.length,
            "dropped_tokens": claim.dropped_tokens,
            "dense_reason": plan.dense_reason,
            "decisions": [d.model_dump(mode="json") for d in plan.decisions],
        }
