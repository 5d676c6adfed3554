"""Re-rotation alone, measured on calls that hold no estimate: cheap samples for the KL budget.

A call whose prompt KV holds no estimate (computed, exact prefixes, versions computed after the
same text) answers with dense's first-token logits (versions: within their measured error,
:mod:`.versions.match`). After its reply, the same prompt planned with re-rotation only (every
shared segment found is re-rotated, its head recomputed: ``method="rerotate"``) is prefilled
once more, and ``KL(call || re-rotated)`` on the first token is what serving this receiver
re-rotated would have cost (:meth:`.anchors.tracker.OffsetTracker.record_rerotated`). One
reuse prefill (only the tokens re-rotation computes), charged to the call as audit tokens, and
only until the receiver has ``min_samples`` samples: a dense audit costs a whole prefill and
answers only for calls that already reused.
"""

from __future__ import annotations

from typing import Optional

import torch

from .alignment import assemble
from .anchors import KVCommAnchors
from .config import KVCommConfig
from .engines import hf
from .fidelity import first_token_kl
from .kv.rope import RopeRotator
from .kv.store import SegmentStore
from .plan import CallPlan
from .prefill_cost import PrefillCost
from .planner import plan_call
from .prompt import PromptLayout

__all__ = ["RerotationCheck"]


class RerotationCheck:
    """Measures a receiver's re-rotation on its calls without estimates (one per engine; the
    engine's lock is held around its calls).

    Args:
        model: the engine's model.
        rotator: its re-rotation.
        config: the engine's settings (``method``, ``kl_budget``, ``audit_every``).
        store: the segment store (the re-rotation plan's segments).
        fingerprint: the engine's model fingerprint.
        anchors: the engine's anchors (their tracker gets the samples).
        prefill_cost: where reuse is weighed against a whole prefill (``dense_when_cheaper``),
            no sample of a re-rotation the engine would not serve (None: every one is taken).
    """

    def __init__(self, model, rotator: Optional[RopeRotator], config: KVCommConfig, store: SegmentStore,
                 fingerprint: str, anchors: KVCommAnchors, prefill_cost: Optional[PrefillCost] = None) -> None:
        self.model, self.rotator, self.config = model, rotator, config
        self.store, self.fingerprint, self.anchors = store, fingerprint, anchors
        self.prefill_cost = prefill_cost
        self._rerotate = config.model_copy(update={"method": "rerotate", "dense_when_cheaper": False})

    def due(self, plan: CallPlan, agent: str) -> bool:
        """Whether ``plan``'s call should be checked: KVCOMM with a KL budget and audits on,
        anchors learning, shared text found, no estimate in its prompt KV, and ``agent`` still
        short of samples."""
        c = self.config
        return (c.measures_rerotation and self.rotator is not None
                and not self.anchors.frozen and plan.dense_reason != "reuse_off"
                and any(d.segment is not None for d in plan.decisions)
                and plan.first_estimated() >= plan.num_prompt
                and self.anchors.tracker.wants_rerotation_sample(agent))

    def check(self, layout: PromptLayout, logits: torch.Tensor, agent: str) -> Optional[float]:
        """Prefill ``layout`` re-rotated only and record ``KL(logits || re-rotated)``; returns it,
        or None where re-rotation finds nothing, or too little to pay for its masked forward (a
        few short runs found in another text, as in a first agent's prompt). Run before the call's own KV is
        stored (the store as the call saw it). ``logits``: ``[vocab]`` the call's first-token
        logits."""
        plan = plan_call(layout, store=self.store, fingerprint=self.fingerprint, config=self._rerotate, agent=agent)
        if not plan.runs or (self.prefill_cost is not None and not self.prefill_cost.worth_reusing(plan)):
            return None  # little to re-rotate: a plan never served, and a sample costing most of a prefill
        pre = hf.prefill(self.model, plan.prompt_ids, plan.computed_positions(), assemble(plan, self.rotator),
                         plan.reused_positions(), masked=True)
        kl = first_token_kl(logits, pre.logits)
        self.anchors.tracker.record_rerotated(agent, kl)
        return kl
