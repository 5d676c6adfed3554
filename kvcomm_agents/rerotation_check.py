"""Re-rotation alone, measured on calls that hold no estimate: cheap samples for the KL budget.

A call whose prompt KV holds no estimate (computed, exact prefixes, versions computed after the
same text) answers with dense's first-token logits (versions: within their measured error,
:mod:`.versions.match`). After its reply, the same prompt planned with re-rotation only (every
shared segment found is re-rotated, its head recomputed: ``method="rerotate"``; replies
computed, since the gate's fallback never re-rotates them alone: ``experimental.rerotate_replies``) is prefilled
once more, and ``KL(call || re-rotated)`` on the first token is what serving this receiver
re-rotated would have cost (:meth:`.anchors.tracker.OffsetTracker.record_rerotated`). One
reuse prefill (only the tokens re-rotation computes), charged to the call as audit tokens, and
only until the receiver has ``min_samples`` samples: a dense audit costs a whole prefill and
answers only for calls that already reused.

Before the model has any sample, a reader of a long shared text would compute it whole just to
be measured. A *short sample* (``experimental.short_rerotation_sample``) measures the same on the
reader's prompt with every long reused run cut to its first :data:`SHORT_SAMPLE_IDS` ids, dense
against re-rotated, before the call is planned; within :data:`SHORT_SAMPLE_MARGIN` of the budget
it is the receiver's first sample, and the reader itself is served re-rotated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .alignment import assemble
from .anchors import KVCommAnchors
from .config import KVCommConfig
from .engines import hf
from .fidelity import first_token_kl
from .kv.block import KVBlock
from .kv.rope import RopeRotator
from .kv.segments import is_reply
from .kv.store import SegmentStore
from .plan import CallPlan
from .prefill_cost import PrefillCost
from .planner import plan_call
from .prompt import PromptLayout

__all__ = ["RerotationCheck", "SHORT_SAMPLE_IDS", "SHORT_SAMPLE_MARGIN", "cut_runs"]

#: Ids a short sample keeps of each long reused run: the cut run is still re-rotated past its
#: 16-id computed head and the 64-id short-run rule (the sample is planned without
#: ``recompute_last_run``, which would compute a cut run the whole prompt re-rotates). On the
#: development range (128 against 256) both tracked the whole check alike, 128 at half the cost
#: (``benchmarks/short_samples.py``).
SHORT_SAMPLE_IDS = 128
#: A short sample trusts re-rotation only at this share of the KL budget or less: it is a proxy
#: (37 reader prompts of the development range: 0.3x to 15x the whole prompt's KL, below it on 8;
#: where a sample was that clear, 32 of them, the whole prompt read 0.0072 or less, half the
#: default budget).
SHORT_SAMPLE_MARGIN = 0.25


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
        self._cut = self._rerotate.model_copy(update={"recompute_last_run": 0})  # a short sample's plan
        self._short_sampled_under: Optional[str] = None  # the fingerprint of the weights last sampled short

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
        plan = self._plan(layout, agent)
        if not plan.runs or (self.prefill_cost is not None and not self.prefill_cost.worth_reusing(plan)):
            return None  # little to re-rotate: a plan never served, and a sample costing most of a prefill
        pre = hf.prefill(self.model, plan.prompt_ids, plan.computed_positions(), assemble(plan, self.rotator),
                         plan.reused_positions(), masked=True)
        kl = first_token_kl(logits, pre.logits)
        self.anchors.tracker.record_rerotated(agent, kl)
        return kl

    def _plan(self, layout: PromptLayout, agent: str, config: Optional[KVCommConfig] = None) -> CallPlan:
        """``layout`` planned with re-rotation only, runs of replies computed unless
        ``experimental.rerotate_replies`` (the gate's fallback never serves a reply re-rotated
        alone then, so a sample must not measure one). Conservative: where a refused reply is
        served, the text after it is computed too, which this plan re-rotates."""
        plan = plan_call(layout, store=self.store, fingerprint=self.fingerprint, config=config or self._rerotate,
                         agent=agent)
        if self.config.experimental.rerotate_replies:
            return plan
        return replace(plan, runs=tuple(run for run in plan.runs if not is_reply(run.segment.ref.kind)))

    def short_sample_due(self, agent: str) -> bool:
        """Whether a short sample may be taken before ``agent``'s call is planned: KVCOMM with
        a KL budget and audits on, ``experimental.short_rerotation_sample``, anchors learning, no
        re-rotation sample on this model yet (remembered ones count), and none taken under these
        weights."""
        c, tracker = self.config, self.anchors.tracker
        return (c.measures_rerotation and c.experimental.short_rerotation_sample and self.rotator is not None
                and not self.anchors.frozen and self.fingerprint != self._short_sampled_under
                and not tracker.trust_unmeasured  # rerotation_trust="audited" serves before any sample
                and not tracker.pooled_rerotation_samples() and tracker.wants_rerotation_sample(agent))

    def short_sample(self, layout: PromptLayout, agent: str) -> Optional[float]:
        """Measure re-rotation on ``layout`` with its long reused runs cut (:func:`cut_runs`):
        ``KL(dense || re-rotated)`` on the first token of the cut prompt, both prefilled here.
        Recorded as ``agent``'s re-rotation sample where within :data:`SHORT_SAMPLE_MARGIN` of
        the budget; returns it, or None where nothing was forwarded (no run longer than
        :data:`SHORT_SAMPLE_IDS`, or a sample forwarding more than half the ids of the whole
        check: the reader's dense prefill and its re-rotated one)."""
        whole = self._plan(layout, agent)
        cut = cut_runs(whole.prompt_ids, whole.runs, SHORT_SAMPLE_IDS)
        if cut is None:
            return None
        short = self._plan(PromptLayout.of_ids(cut), agent, self._cut)
        if not short.runs or 2 * _sample_ids(short) > _check_ids(whole):
            return None
        self._short_sampled_under = self.fingerprint
        n, lead = short.num_prompt, _lead(short)
        dense = hf.prefill(self.model, short.prompt_ids, torch.arange(n))
        # the ids before the first re-rotated one (exact prefix, or computed in context) are the
        # same KV in both prefills: the dense one's is reused, and the re-rotated runs follow it
        positions = short.reused_positions()
        assembled = assemble(short, self.rotator)
        runs = assembled.window(int((positions < lead).sum()), assembled.num_tokens)
        block = KVBlock.cat([hf.kv_at_positions(dense.cache, torch.arange(n), torch.arange(lead)), runs])
        computed = short.computed_positions()
        reused = hf.prefill(self.model, short.prompt_ids, computed[computed >= lead], block,
                            torch.cat([torch.arange(lead), positions[positions >= lead]]), masked=True)
        kl = first_token_kl(dense.logits, reused.logits)
        if kl <= SHORT_SAMPLE_MARGIN * self.config.kl_budget:
            self.anchors.tracker.record_rerotated(agent, kl)
        return kl


def _check_ids(plan: CallPlan) -> int:
    """Ids a check of ``plan``'s prompt forwards: a dense prefill and the re-rotated one."""
    return 2 * plan.num_prompt - plan.reused_tokens


def _lead(plan: CallPlan) -> int:
    """Prompt ids before ``plan``'s first re-rotated one: its exact prefix and the ids computed
    in context after it."""
    positions = plan.reused_positions()
    runs = positions[positions >= plan.prefix_length]
    return int(runs[0]) if runs.numel() else plan.num_prompt


def _sample_ids(plan: CallPlan) -> int:
    """Ids a short sample of ``plan``'s prompt forwards: a dense prefill, then the re-rotated
    one past the lead the dense one computed alike."""
    computed = plan.computed_positions()
    return plan.num_prompt + int((computed >= _lead(plan)).sum())


def cut_runs(ids: torch.Tensor, runs, length: int) -> Optional[torch.Tensor]:
    """``ids`` (``[N]``) with every reused run longer than ``length`` cut to its first
    ``length`` ids, the ids after the run following at once: a prompt whose reused KV deviates
    as the whole one's does near each run's start (the KV of a run's first ids depends on
    nothing after them). ``runs``: a plan's :class:`~kvcomm_agents.plan.ReusedRun` list, sorted.
    None where no run is that long."""
    keep, start = [], 0
    for run in runs:
        if run.length > length:
            keep.append(ids[start:run.prompt_start + length])
            start = run.prompt_start + run.length
    if not keep:
        return None
    keep.append(ids[start:])
    return torch.cat(keep)
