"""A plan whose reused KV is one contiguous prefix of the prompt: for engines that cannot compute holes.

The HF runtime computes any positions between reused runs (the template glue, a segment judged
new, the recomputed head of a run) with a position mask. Paged engines such as vLLM cannot: an
external KV loader may claim only the first ``k`` prompt tokens, and the engine computes every
token after them (``../docs/scale-out.md``). :func:`contiguous_claim` cuts a plan at its first
computed position: the runs before it stay reused, every run after it is computed in context by
the engine (decision reason ``after_hole``), so that engine and plan agree on what was reused.
Pure bookkeeping on token positions: no tensors are touched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..plan import CallPlan, ReusedRun

__all__ = ["Claim", "contiguous_claim", "DENSE_TAIL"]

#: Last prompt tokens a runtime without holes computes itself rather than load from reused runs
#: (an exact prefix may still reach into them): the first reply token reads the prompt's last
#: tokens most, and there estimated or re-rotated KV (a reply's tail found as a token run, the
#: generation header from the receiver's own-text KV) moved the first-token distribution most
#: on vLLM (``docs/scale-out.md``, "The client's copies"). A named heuristic, measured, not tuned.
DENSE_TAIL = 32


@dataclass(frozen=True)
class Claim:
    """What an engine without holes loads for one prompt.

    Attributes:
        plan: the plan as the engine will run it (runs after the first hole dropped).
        length: prompt tokens ``0 .. length`` served from reused KV (exact prefix plus the runs
            that follow it without a gap); the engine computes ``length .. N``.
        dropped_tokens: reused tokens of the original plan that the engine computes instead.
    """

    plan: CallPlan
    length: int
    dropped_tokens: int


def contiguous_claim(plan: CallPlan, start: int = 0, dense_tail: int = 0) -> Claim:
    """Cut ``plan`` at its first computed position at or after ``start``.

    Args:
        plan: a planner's plan (``plan.recompute`` must be None: a recomputed position is a hole).
        start: positions the engine already holds (its own exact prefix cache); the claim never
            ends before it.
        dense_tail: the prompt's last ``dense_tail`` tokens are never served from reused runs
            (:data:`DENSE_TAIL`): a shared run reaching into them is claimed up to them when that
            part is at least as long as the tail (else computed whole: a few re-rotated tokens
            right before the tail moved the first token as much as the tail itself), an own-text
            run there is computed whole; the exact prefix is kept whole.

    Returns:
        The claim: the kept plan and the number of prompt tokens it serves from reused KV.
    """
    if plan.recompute is not None:
        raise ValueError("a plan with recomputed positions has holes; build it with recompute_head=0")
    end = max(plan.prefix_length, 0)
    limit = plan.num_prompt - dense_tail
    kept: list[ReusedRun] = []
    reason = "after_hole"
    for run in plan.runs:  # sorted and disjoint
        if run.prompt_start != end:
            break
        if run.prompt_end > limit:
            reason = "dense_tail"  # every run after it lies in the tail too
            if not run.own_text and limit - run.prompt_start >= dense_tail:  # a shared run's part before
                kept.append(_shortened(run, limit - run.prompt_start))  # the tail, when that is no shorter
                end = limit
            break
        kept.append(run)
        end = run.prompt_end
    length = max(end, min(start, plan.num_prompt - 1))
    if len(kept) == len(plan.runs) and (not kept or kept[-1] is plan.runs[-1]):  # nothing cut or shortened
        return Claim(plan, length, 0)
    lost: dict[str, int] = {}
    for run in plan.runs:
        if not run.own_text:
            lost[run.segment.id] = lost.get(run.segment.id, 0) + run.length
    for run in kept:
        if not run.own_text:
            lost[run.segment.id] -= run.length
    dropped = sum(run.length for run in plan.runs) - sum(run.length for run in kept)
    decisions = []
    for decision in plan.decisions:
        cut = max(lost.pop(decision.segment_id, 0), 0) if decision.status == "reused" else 0
        if cut:
            left = max(decision.reused_tokens - cut, 0)
            decision = decision.model_copy(update={"reused_tokens": left} if left else
                                           {"reused_tokens": 0, "status": "prefilled", "reason": reason})
        decisions.append(decision)
    kept_own = {run.prompt_start for run in kept if run.own_text}
    pieces = tuple(replace(piece, reused=False) if piece.reused and piece.start not in kept_own else piece
                   for piece in plan.pieces)
    cut_plan = replace(plan, runs=tuple(kept), decisions=tuple(decisions), pieces=pieces)
    if cut_plan.reused_tokens == 0 and cut_plan.dense_reason is None:
        cut_plan = replace(cut_plan, dense_reason="nothing_to_reuse")
    return Claim(cut_plan, length, dropped)


def _shortened(run: ReusedRun, length: int) -> ReusedRun:
    """``run``'s first ``length`` tokens (its offsets sliced alike)."""
    def first(tensor, dim):
        return None if tensor is None else tensor.narrow(dim, 0, length)

    return replace(run, length=length, key_offsets=first(run.key_offsets, 2), value_offsets=first(run.value_offsets, 2))
