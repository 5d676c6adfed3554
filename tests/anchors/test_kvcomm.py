"""``KVCommAnchors``: observations recorded in the canonical frame, limits and freezing on
synthetic tensors; exactness of anchors recorded in the same context on a tiny model, also with
the whole prompt shifted; audits feeding the pools."""

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.anchors import KVCommAnchors
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.kv.block_count import BlockCount
from kvcomm_agents.plan import CallPlan, Observation, ReusedRun
from kvcomm_agents.prompt import render_prompt

from ..conftest import REPLY, first_logits, forced, run_plan, solver_messages
from .synthetic import KIND, offsets, observe, segment
from ..conftest import mechanics


def registry(**kw) -> KVCommAnchors:
    return KVCommAnchors(**{"estimator": "weighted", "max_bytes": 1 << 30, **kw})


def test_observations_are_recorded_in_the_canonical_frame():
    """The receiver computed the segment 11 positions in: its offsets are ``real - base`` with
    the real keys moved back to the segment's frame, for the segment and the own-text piece."""
    reg = registry()
    seg, own = segment(0), segment(1, tokens=2, kind=("s2", "own_text"))
    k_off, v_off = offsets(0)
    own_k, own_v = offsets(1, tokens=2)
    observe(reg, "s2", seg, k_off, v_off, at=11, piece=("piece", own, own_k, own_v))
    pool = reg.pool(KIND)
    slot = pool.slot_of(seg.id)
    torch.testing.assert_close(pool.placeholder["s2"].slot(slot)[0][:, :, :6], k_off, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.placeholder["s2"].slot(slot)[1][:, :, :6], v_off, atol=1e-5, rtol=0)
    stack = pool.own_text[("s2", "piece")]
    torch.testing.assert_close(stack.slot(slot)[0], own_k, atol=1e-5, rtol=0)
    torch.testing.assert_close(stack.slot(slot)[1], own_v, atol=1e-5, rtol=0)
    assert reg.anchors(KIND) == 1 and reg.anchors(("other", None)) == 0


def test_the_budget_takes_the_oldest_anchors_of_the_largest_pool_and_keeps_its_newest():
    """Over the byte budget, the pool holding most bytes (long documents) gives up its oldest
    anchors, never the one just recorded; a small pool of replies recorded earlier keeps its
    anchors (before: the least recently recorded pool was emptied first, whatever its size)."""
    reg = registry()
    replies = ("s1", "assistant")
    observe(reg, "s2", segment(0, kind=replies), *offsets(0))
    documents = [segment(i, tokens=48) for i in range(1, 6)]
    for i, document in enumerate(documents[:4], start=1):
        observe(reg, "s2", document, *offsets(i, tokens=48))
    large = reg.pool(KIND)
    reg.max_bytes = reg.nbytes() - large.nbytes // 3
    observe(reg, "s2", documents[4], *offsets(5, tokens=48))
    assert reg.nbytes() <= reg.max_bytes
    assert reg.anchors(replies) == 1
    assert large.slot_of(documents[4].id) is not None
    assert large.slot_of(documents[0].id) is None and 1 <= len(large) < 5


def test_one_anchor_over_the_budget_costs_a_few_anchors_not_half_the_pool():
    """Eviction is sized after the empty slots are dropped: a budget that holds 8 anchors once
    compacted keeps about 90% of them when a ninth arrives (a pool's capacity doubles ahead of
    its anchors, so sizing by allocated bytes evicted about half)."""
    reg = registry(max_anchors=20)
    documents = [segment(i, tokens=24) for i in range(12)]
    for i, document in enumerate(documents[:8]):
        observe(reg, "s2", document, *offsets(i, tokens=24))
    pool = reg.pool(KIND)
    pool.compact()
    reg.max_bytes = reg.nbytes() + 1
    observe(reg, "s2", documents[8], *offsets(8, tokens=24))
    assert reg.nbytes() <= reg.max_bytes
    assert 6 <= len(pool) <= 8 and pool.slot_of(documents[8].id) is not None


def test_a_pool_just_recorded_is_kept_while_others_can_spare_anchors():
    """A new kind's first anchor (a long document) over the budget: the other pools give up
    their oldest anchors; the new one stays."""
    reg, alone = registry(), registry()
    replies = ("s1", "assistant")
    for i in range(6):
        observe(reg, "s2", segment(i, kind=replies), *offsets(i))
    document = segment(99, tokens=600)
    observe(alone, "s2", document, *offsets(99, tokens=600))
    reg.max_bytes = reg.nbytes() + alone.nbytes() - reg.nbytes() // 4
    observe(reg, "s2", document, *offsets(99, tokens=600))
    assert reg.nbytes() <= reg.max_bytes
    assert reg.pool(KIND) is not None and reg.pool(KIND).slot_of(document.id) is not None
    assert 1 <= reg.anchors(replies) < 6


def test_records_of_one_call_do_not_evict_each_other():
    """Inside ``recording()`` (one call's copies) the second record over the budget does not
    evict the first, though it is the least used: both were just recorded; older anchors go."""
    reg = registry(eviction_window=8)
    old = [segment(i, tokens=24) for i in range(4)]
    for i, document in enumerate(old):
        observe(reg, "s2", document, *offsets(i, tokens=24))
    first, second = segment(10, tokens=24), segment(11, tokens=24)
    reg.pool(KIND).compact()
    reg.pool(KIND).activations += 5  # the old anchors were used: the least activated would be `first`
    reg.max_bytes = reg.nbytes() + 1
    with reg.recording():
        observe(reg, "s2", first, *offsets(10, tokens=24))
        observe(reg, "s2", second, *offsets(11, tokens=24))
    pool = reg.pool(KIND)
    assert pool.slot_of(first.id) is not None and pool.slot_of(second.id) is not None
    assert reg.nbytes() <= reg.max_bytes


def test_observations_after_the_first_rerotated_token_are_not_recorded():
    reg = registry()
    seg = segment(0)
    real = seg.kv.with_offsets(*offsets(0))
    other = segment(1)
    plan = CallPlan(torch.arange(20), runs=(ReusedRun(other, 2, 0, 6),), observations=(Observation(seg, 9, 0, 6),))
    reg.observe("s2", plan, lambda start, length: real.window(0, length), None)
    assert reg.nbytes() == 0 and reg.pool(KIND) is None


def test_pools_never_exceed_their_limits():
    count = BlockCount()
    reg = registry(max_anchors=4, eviction_window=2, freeze=count)
    own = segment(99, tokens=2, kind=("s2", "own_text"))
    for i in range(11):
        observe(reg, "s2", segment(i), *offsets(i), piece=("p", own, *offsets(i, tokens=2)))
        assert len(reg.pool(KIND)) <= 4 and len(reg.pool(KIND).bases) <= 4
    assert reg.pool(KIND).own_text[("s2", "p")].has.sum() == 4
    one = reg.nbytes()
    reg.max_bytes = one // 2
    observe(reg, "s2", segment(50), *offsets(50))
    assert reg.nbytes() <= reg.max_bytes and len(reg.pool(KIND)) >= 1
    count.enter()
    count.enter()
    count.leave()  # nested blocks: still frozen
    before = reg.nbytes()
    observe(reg, "s2", segment(60), *offsets(60))
    assert reg.frozen and reg.nbytes() == before and reg.pool(KIND).slot_of(segment(60).id) is None
    count.leave()
    assert not reg.frozen
    reg.clear()
    assert reg.nbytes() == 0 and reg.anchors(KIND) == 0


def _engine(model, tokenizer, method="kvcomm", **experimental):
    config = mechanics(method=method, prefix_cache=False, experimental={"min_anchors": 1, **experimental})
    return KVCommEngine(model, tokenizer, config=config)


@pytest.mark.parametrize("estimator,own_text", [("mean", "in_context"), ("weighted", "in_context"), ("weighted", "reuse")])
def test_anchor_from_the_same_context_reproduces_dense_logits(model, tokenizer, estimator, own_text):
    """Solver 2 sees the question and solver 1's reply twice in the same context: the first call
    is a new anchor (prefilled, recorded); the second reuses with the recorded offsets, which
    restore the real KV exactly (own-text pieces too, with own-text reuse), so logits equal dense."""
    receiver = solver_messages("You are solver two, and you check the work of others.", REPLY)
    dense_logits = first_logits(KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense")), receiver)
    results = {}
    for method in ("kvcomm", "rerotate"):
        engine = _engine(model, tokenizer, method, estimator=estimator, own_text=own_text)
        engine.replay(solver_messages("You are solver one."), agent="s1", reply_ids=forced(tokenizer))
        first = engine.chat(receiver, agent="s2", max_new_tokens=1)
        second = engine.replay(receiver, agent="s2", reply_ids=[tokenizer.eos_token_id])
        results[method] = (first, second)
    first, second = results["kvcomm"]
    assert [d.reason for d in first.stats.decisions] == ["new_anchor", "after_new_anchor"]
    assert first.stats.reused_tokens == 0 and first.stats.decisions[0].gate.decision == "new_anchor"
    stats = second.result.stats
    assert stats.mode == "reuse" and all(d.status == "reused" for d in stats.decisions)
    assert (stats.own_text_tokens > 0) == (own_text == "reuse")
    torch.testing.assert_close(second.first_token_logits, dense_logits, atol=1e-4, rtol=0)
    rerotated = results["rerotate"][1]
    assert rerotated.result.stats.reused_tokens == stats.reused_tokens  # same reuse, no offsets
    assert first_token_kl(dense_logits, rerotated.first_token_logits) > 100 * first_token_kl(dense_logits, second.first_token_logits)


def test_anchor_is_exact_with_the_whole_prompt_shifted(llama, tokenizer):
    """Anchors live in the canonical frame: the same plan run 37 positions later gives the
    dense logits of the shifted prompt."""
    receiver = solver_messages("You are solver two, and you check the work of others.", REPLY)
    engine = _engine(llama, tokenizer, estimator="weighted", own_text="reuse")
    engine.replay(solver_messages("You are solver one."), agent="s1", reply_ids=forced(tokenizer))
    engine.chat(receiver, agent="s2", max_new_tokens=1)
    layout = render_prompt(tokenizer, receiver)
    with torch.inference_mode():
        plan = engine._calls.plan(layout, "s2", None, 1)
    assert plan.runs and plan.own_text_tokens > 0
    rotator = engine.info.rotator
    dense = run_plan(llama, rotator, CallPlan(layout.ids), position_offset=37).logits
    reused = run_plan(llama, rotator, plan, position_offset=37).logits
    unshifted_dense = run_plan(llama, rotator, CallPlan(layout.ids)).logits
    torch.testing.assert_close(reused, dense, atol=1e-4, rtol=0)
    torch.testing.assert_close(dense, unshifted_dense, atol=1e-4, rtol=0)


def test_freeze_anchors_stops_learning_and_nests(llama, tokenizer):
    engine = _engine(llama, tokenizer, own_text="reuse")
    with engine.freeze_anchors():
        with engine.freeze_anchors():
            engine.replay(solver_messages("You are solver one."), agent="s1", reply_ids=forced(tokenizer))
        # the inner block ended, the outer one still freezes
        engine.chat(solver_messages("You are solver two.", REPLY), agent="s2", max_new_tokens=1)
    assert engine.anchors.nbytes() == 0 and len(engine.own_texts) == 0
    assert not engine.anchors.frozen and not engine.own_texts.frozen
    engine.chat(solver_messages("You are solver two.", REPLY), agent="s2", max_new_tokens=1)
    assert engine.anchors.anchors(("user", None)) == 1 and len(engine.own_texts) > 0


def test_audits_record_the_reused_segments_as_anchors(llama, tokenizer):
    # gamma 1 reuses as soon as two anchors are consulted (the entropy score is at most 1)
    engine = KVCommEngine(llama, tokenizer, config=mechanics(gamma=1.0, audit_every=1, prefix_cache=False, kl_budget=None))
    # each question shorter than the last, so earlier anchors are long enough to be consulted
    questions = [f"How many apples are left if Sam has {'very ' * (4 - i)}many and eats {i}?" for i in range(3)]
    for question in questions:
        engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)  # captures it
        result = engine.chat([{"role": "system", "content": "You are solver two."},
                              {"role": "user", "content": question}], agent="s2", max_new_tokens=1)
    # questions 1-2 are new anchors (0, then 1 anchor consulted); the 3rd is reused, audited,
    # and the audit's exact KV makes it an anchor as well
    assert result.stats.mode == "reuse" and result.stats.audit_kl is not None
    assert [(d.gate.decision, d.gate.anchors) for d in result.stats.shared_decisions] == [("reuse", 2)]
    assert engine.anchors.anchors(("user", None)) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_grows_to_what_was_observed_keeping_its_data_and_zero_elsewhere(dtype):
    """Each slot holds its own offsets, as long as the last token observed: a later pass over
    further tokens extends the slot's tensors, keeps what they held, and reads zero where nothing
    was observed; another slot's size is its own (no padding to the longest), in any dtype."""
    from kvcomm_agents.anchors.pool import OffsetStack

    stack = OffsetStack()
    stack.write(1, 2, torch.full((3, 2, 3, 4), 7.0, dtype=dtype), torch.ones(3, 2, 3, 4, dtype=dtype), slots=2)
    keys, values = stack.slot(1)
    assert keys.shape == (3, 2, 5, 4) and keys.dtype == torch.float32 and not keys[:, :, :2].any()
    assert bool((keys[:, :, 2:] == 7).all()) and stack.slot(0) is None
    stack.write(1, 6, torch.full((3, 2, 3, 4), 5.0, dtype=dtype), torch.ones(3, 2, 3, 4, dtype=dtype), slots=2)
    keys, _ = stack.slot(1)
    assert keys.shape == (3, 2, 9, 4) and bool((keys[:, :, 2:5] == 7).all()) and not keys[:, :, 5].any()
    assert bool((keys[:, :, 6:] == 5).all())
    stack.write(0, 0, torch.ones(3, 2, 1, 4, dtype=dtype), torch.ones(3, 2, 1, 4, dtype=dtype), slots=2)
    # stored from the first observed token: slot 1 holds tokens 2..9, slot 0 token 0
    assert stack.slot(0)[0].shape[2] == 1 and stack.nbytes == 2 * 4 * 3 * 2 * 4 * (7 + 1)
    assert stack.starts == {1: 2, 0: 0}
    dense, _ = stack.dense(torch.tensor([0, 1]), 9)
    assert dense.shape == (2, 3, 2, 9, 4) and not dense[0, :, :, 1:].any()
    stack.clear_slot(1)
    assert stack.slot(1) is None and stack.nbytes == 2 * 4 * 3 * 2 * 4
    stack.write(0, 5, torch.ones(3, 2, 2, 4, dtype=dtype), torch.ones(3, 2, 2, 4, dtype=dtype), slots=2)
    keys, _ = stack.slot(0)  # a later pass after a gap: one part from token 0 to 7, zeros between
    assert keys.shape[2] == 7 and not keys[:, :, 1:5].any() and bool((keys[:, :, 5:] == 1).all())
