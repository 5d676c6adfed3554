"""``CallPlan`` (no model): frozen, positions, and the plan an audit's dense pass observed."""

import dataclasses

import pytest
import torch

from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.segments import KVSegment
from kvcomm_agents.plan import CallPlan, Observation, OwnTextPiece, ReusedRun


def seg(tokens: int) -> KVSegment:
    kv = KVBlock.stacked(torch.zeros(2, 1, tokens, 4), torch.zeros(2, 1, tokens, 4))
    return KVSegment.create(kind=("a", "assistant"), text="x" * tokens, token_ids=list(range(tokens)),
                            char_spans=[(i, i + 1) for i in range(tokens)], kv=kv, fingerprint="m")


def plan() -> CallPlan:
    shared, own = seg(6), seg(2)
    runs = (ReusedRun(shared, 4, 0, 6, key_offsets=torch.ones(1, 1, 6, 4)), ReusedRun(own, 10, 0, 2, own_text=True),
            ReusedRun(shared, 14, 1, 3))
    pieces = (OwnTextPiece(10, 12, "k", (0, 1), shared, reused=True), OwnTextPiece(17, 19, "k2", (5, 6), shared))
    return CallPlan(torch.arange(20), runs=runs, pieces=pieces, observations=(Observation(shared, 1, 0, 2),))


def test_positions_and_counts():
    p = plan()
    assert p.reused_tokens == 11 and p.own_text_tokens == 2 and p.first_rerotated() == 4
    assert p.computed_positions().tolist() == [0, 1, 2, 3, 12, 13, 17, 18, 19]
    assert p.reused_positions().tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 14, 15, 16]
    assert p.runs[2].shift == 13 and p.runs[2].prompt_end == 17
    hooked = dataclasses.replace(p, recompute=torch.tensor([5, 15]))
    assert hooked.reused_tokens == 9 and hooked.reused_positions().tolist() == [4, 6, 7, 8, 9, 10, 11, 14, 16]
    assert hooked.computed_positions().tolist() == [0, 1, 2, 3, 5, 12, 13, 15, 17, 18, 19]
    assert CallPlan(torch.arange(5)).first_rerotated() == 5


def test_plans_are_frozen():
    p = plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.recompute = torch.tensor([1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.runs[0].key_offsets = None


def test_as_observed_turns_reused_shared_runs_into_observations():
    p = plan()
    seen = p.as_observed()
    assert seen.runs == () and seen.prefix is None and seen.reused_tokens == 0
    assert seen.first_rerotated() == 20 and torch.equal(seen.prompt_ids, p.prompt_ids)
    assert [(o.segment, o.prompt_start, o.segment_start, o.length) for o in seen.observations] == [
        (p.runs[0].segment, 4, 0, 6), (p.runs[2].segment, 14, 1, 3)]  # own-text runs are not segments
    assert [(x.start, x.end, x.key, x.reused, x.observed) for x in seen.pieces] == [
        (10, 12, "k", False, True), (17, 19, "k2", False, True)]
    assert seen.observations[0].reaches_end and not seen.observations[1].reaches_end
    assert p.pieces[0].reused and not p.pieces[0].observed  # the plan itself is unchanged
