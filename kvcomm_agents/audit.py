"""Dense audits of live reused calls: how far a call's first token is from dense prefill.

An audit runs after a reused call has answered (outside its time to first token): a dense
prefill of the same prompt ids gives ``KL(dense || served)`` on the first token, which the call
reports (``CallStats.audit_kl``). For ``method="kvcomm"`` the same pass also:

- observes the reused segments' real offsets (the dense pass is exact everywhere), so anchors
  are recorded from audited calls too;
- runs one more reuse prefill with one segment kind's estimated offsets flipped (on where they
  were on, off where they were off), which gives :class:`~.anchors.tracker.OffsetTracker` a
  paired sample for ``(receiver, kind)``: the offset check and the KL budget read those.

When: every ``audit_every``-th reused call once reuse has paid for it (``audit_share``: the
audits' forwarded ids stay within that share of the prompt ids reuse spared), and a reused call carrying estimated offsets of a
kind the tracker has too few samples of for this receiver (or holds back under the budget, a
probe), at most one in ``tracker.warmup_gap`` of the receiver's calls; with
``experimental.audit_new_readers``, a receiver's first call served re-rotated on the other
receivers' samples alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .alignment import assemble
from .anchors import KVCommAnchors
from .capture import CallCapture
from .config import KVCommConfig
from .engines import hf
from .fidelity import first_token_kl
from .kv.rope import RopeRotator
from .plan import CallPlan

__all__ = ["CallAuditor", "Audit"]


@dataclass(frozen=True)
class Audit:
    """One audited call: ``KL(dense || served)`` on its first token, in nats, and the dense
    prefill of its prompt ids (exact KV: a call whose prompt KV was estimated feeds its reply's
    framed copies there, :meth:`kvcomm_agents.framing.framer.Framer.after_audit`)."""

    kl: float
    dense: hf.Prefill


class CallAuditor:
    """Decides which reused calls are audited and audits them (one per engine; the engine's
    lock is held around :meth:`audit`).

    Args:
        model: the engine's model.
        rotator: its re-rotation.
        config: the engine's settings (``audit_every``, ``method``).
        anchors: the engine's anchors (their tracker gets the paired samples).
        capture: where the dense pass's observations go.
    """

    def __init__(self, model, rotator: RopeRotator, config: KVCommConfig, anchors: KVCommAnchors,
                 capture: CallCapture) -> None:
        self.model, self.rotator, self.config = model, rotator, config
        self.anchors, self.capture = anchors, capture
        self.reused_calls = 0
        self.spared_ids = 0  # prompt ids reused calls did not prefill
        self.audit_ids = 0  # ids every audit forwarded
        self._period_due = False  # an every-N-th audit waits for reuse to pay for it

    def audit(self, plan: CallPlan, logits: torch.Tensor, agent: str) -> Optional[Audit]:
        """Audit a reused call if it is due; returns the :class:`Audit`, or None.

        Args:
            plan: the call's plan as it was prefilled.
            logits: ``[vocab]`` the call's first-token logits.
            agent: the receiving agent.
        """
        if not self.config.audit_every or not plan.runs:
            return None
        self.reused_calls += 1
        self.spared_ids += plan.reused_tokens
        self._period_due |= self.reused_calls % self.config.audit_every == 0
        kvcomm = self.config.method == "kvcomm"
        tracker = self.anchors.tracker
        kinds = plan.estimated_kinds() if kvcomm and not self.anchors.frozen else []
        warmup = bool(kinds) and tracker.warmup_audit_due(agent, kinds)
        rerotated = kvcomm and not kinds and any(getattr(run.verdict, "rerotated", False) for run in plan.runs)
        new_reader = (rerotated and self.config.experimental.audit_new_readers and not self.anchors.frozen
                      and not tracker.rerotation_samples(agent))  # served on the others' samples alone
        confirming = (rerotated and self.config.experimental.rerotation_trust == "audited"
                      and not self.anchors.frozen and tracker.rerotation_unconfirmed())
        unmeasured = new_reader or confirming  # re-rotation served on samples that are not this reader's, or none
        if not (self._period_due or warmup or unmeasured):
            return None
        kind = tracker.kind_to_flip(agent, kinds)
        flipped = plan.with_offsets_flipped(kind) if kind is not None else None
        cost = plan.num_prompt + (int(flipped.computed_positions().numel()) if flipped is not None else 0)
        if not (warmup or unmeasured or self.paid_for(cost)):
            return None  # the every-N-th audit waits for reuse to pay for it
        self._period_due = False
        self.audit_ids += cost
        tracker.audited(agent)
        flipped_logits = None
        if flipped is not None:
            flipped_logits = hf.prefill(self.model, flipped.prompt_ids, flipped.computed_positions(),
                                        assemble(flipped, self.rotator), flipped.reused_positions(),
                                        masked=True).logits
        dense = hf.prefill(self.model, plan.prompt_ids, torch.arange(plan.num_prompt))
        kl = first_token_kl(dense.logits, logits)
        if flipped_logits is not None:
            kl_flipped = first_token_kl(dense.logits, flipped_logits)
            on, off = (kl, kl_flipped) if plan.offsets_applied(kind) else (kl_flipped, kl)
            tracker.record(agent, kind, on, off)
        if rerotated:
            tracker.record_rerotated(agent, kl)  # served re-rotated where the gate would compute: keep measuring
        self.capture.observe(plan.as_observed(), agent, hf.kv_reader(dense.cache, dense.slot_positions),
                             self.anchors if kvcomm else None)
        return Audit(kl, dense)

    def paid_for(self, cost: int) -> bool:
        """Whether an audit forwarding ``cost`` ids keeps every audit's ids within
        ``audit_share`` of the prompt ids reuse spared (always without a share)."""
        share = self.config.audit_share
        return share is None or self.audit_ids + cost <= share * self.spared_ids
