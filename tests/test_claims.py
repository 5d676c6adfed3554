"""contiguous_claim: a plan cut at its first hole, for engines that cannot compute holes (vLLM)."""

from __future__ import annotations

import pytest
import torch

from kvcomm_agents.paged.claims import contiguous_claim
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.segments import KVSegment
from kvcomm_agents.kv.store import PrefixEntry
from kvcomm_agents.plan import CallPlan, OwnTextPiece, PrefixHit, ReusedRun, SegmentDecision


def _segment(n: int, kind=("a", "assistant")) -> KVSegment:
    kv = KVBlock.stacked(torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4))
    return KVSegment.create(kind=kind, text="x" * n, token_ids=list(range(n)), char_spans=[None] * n, kv=kv,
                            fingerprint="f")


def _decision(segment: KVSegment, span, reused: int) -> SegmentDecision:
    return SegmentDecision(segment=segment.ref, segment_id=segment.id, message_index=0, found_by="tokens",
                           span=span, status="reused", reason="tokens", reused_tokens=reused)


def _prefix(n: int) -> PrefixHit:
    kv = KVBlock.stacked(torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4))
    return PrefixHit(PrefixEntry("p", torch.arange(n), kv, "f"), n)


def test_runs_after_the_first_hole_are_dropped_and_reported():
    first, second = _segment(10), _segment(12)
    own = _segment(3, ("a", "own_text"))
    runs = (ReusedRun(first, 5, 0, 10), ReusedRun(own, 15, 0, 3, own_text=True), ReusedRun(second, 20, 0, 12))
    pieces = (OwnTextPiece(15, 18, "k1", (1, 2, 3), first, reused=True),
              OwnTextPiece(32, 39, "k2", (4,) * 7, second, reused=False))
    plan = CallPlan(torch.arange(40), _prefix(5), runs,
                    (_decision(first, (5, 15), 10), _decision(second, (20, 32), 12)), pieces=pieces)
    claim = contiguous_claim(plan)
    assert claim.length == 18  # prefix 5 + run 10 + own text 3; 18..20 is a hole
    assert claim.dropped_tokens == 12
    assert [r.prompt_start for r in claim.plan.runs] == [5, 15]
    assert [(d.status, d.reason, d.reused_tokens) for d in claim.plan.decisions] == [
        ("reused", "tokens", 10), ("prefilled", "after_hole", 0)]
    assert [p.reused for p in claim.plan.pieces] == [True, False]
    assert claim.plan.computed_positions().tolist() == list(range(18, 40))
    assert claim.plan.reused_tokens == claim.length


def test_a_plan_without_holes_is_claimed_whole():
    seg = _segment(10)
    plan = CallPlan(torch.arange(16), _prefix(5), (ReusedRun(seg, 5, 0, 10),), (_decision(seg, (5, 15), 10),))
    claim = contiguous_claim(plan)
    assert claim.plan is plan and claim.length == 15 and claim.dropped_tokens == 0


def test_a_hole_right_after_the_prefix_leaves_only_the_prefix():
    seg = _segment(10)
    plan = CallPlan(torch.arange(30), _prefix(4), (ReusedRun(seg, 8, 0, 10),), (_decision(seg, (8, 18), 10),))
    claim = contiguous_claim(plan)
    assert claim.length == 4 and claim.plan.runs == () and claim.dropped_tokens == 10
    assert claim.plan.dense_reason is None  # the exact prefix is still reused


def test_nothing_reusable_is_a_dense_plan_with_a_reason():
    seg = _segment(10)
    plan = CallPlan(torch.arange(30), None, (ReusedRun(seg, 8, 0, 10),), (_decision(seg, (8, 18), 10),))
    claim = contiguous_claim(plan)
    assert claim.length == 0 and claim.plan.dense_reason == "nothing_to_reuse"
    assert claim.plan.decisions[0].reason == "after_hole"


def test_tokens_the_engine_already_holds_count():
    plan = CallPlan(torch.arange(30))
    assert contiguous_claim(plan, start=12).length == 12
    assert contiguous_claim(plan, start=40).length == 29  # never the last prompt token


def test_recomputed_positions_are_refused():
    seg = _segment(10)
    plan = CallPlan(torch.arange(30), None, (ReusedRun(seg, 0, 0, 10),), recompute=torch.tensor([2]))
    with pytest.raises(ValueError, match="recompute_head=0"):
        contiguous_claim(plan)


def test_the_dense_tail_is_computed_a_shared_run_claimed_up_to_it_and_an_exact_prefix_kept_whole():
    first, second, own = _segment(10), _segment(20), _segment(3, ("a", "own_text"))
    key = torch.arange(2 * 1 * 20 * 4, dtype=torch.float32).reshape(2, 1, 20, 4)
    runs = (ReusedRun(first, 5, 0, 10), ReusedRun(second, 15, 0, 20, key_offsets=key, value_offsets=key + 1),
            ReusedRun(own, 35, 0, 3, own_text=True))
    decisions = (_decision(first, (5, 15), 10), _decision(second, (15, 35), 20))
    plan = CallPlan(torch.arange(48), _prefix(5), runs, decisions)
    assert contiguous_claim(plan, dense_tail=10).length == 38  # nothing reaches into 38..48
    claim = contiguous_claim(plan, dense_tail=13)  # only the own-text run reaches into the tail: computed whole
    assert claim.length == 35 and [r.own_text for r in claim.plan.runs] == [False, False]
    claim = contiguous_claim(plan, dense_tail=16)  # tail 32..48: the second run up to 32 (17 >= 16 tokens)
    assert claim.length == 32 and claim.dropped_tokens == 3 + 3
    shortened = claim.plan.runs[1]
    assert shortened.length == 17 and shortened.key_offsets.shape[2] == 17
    torch.testing.assert_close(shortened.value_offsets, key[:, :, :17] + 1)
    assert [(d.status, d.reused_tokens) for d in claim.plan.decisions] == [("reused", 10), ("reused", 17)]
    assert claim.plan.reused_tokens == claim.length
    claim = contiguous_claim(plan, dense_tail=18)  # tail 30..48: 15 tokens of the run before it, fewer than 18
    assert claim.length == 15 and [(d.status, d.reason) for d in claim.plan.decisions] == [
        ("reused", "tokens"), ("prefilled", "dense_tail")]
    long_prefix = CallPlan(torch.arange(40), _prefix(35))
    assert contiguous_claim(long_prefix, dense_tail=20).length == 35  # exact KV is never cut
