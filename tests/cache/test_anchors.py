"""Anchor pools: matching weights, the gate, eviction and limits on synthetic tensors; exactness
of anchors recorded in the same context on a tiny model, also with the whole prompt shifted."""

import math

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.cache.anchors import AnchorPool, AnchorRegistry, entropy_score, top_p_members
from kvcomm_agents.cache.assembly import prefill
from kvcomm_agents.cache.segments import KVSegment
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.plan import CallPlan
from kvcomm_agents.prompt import render_prompt

from ..conftest import solver_messages

LAYERS, HEADS, DIM = 4, 2, 8
KIND = ("solver-1", "assistant")


def segment(seed: int, tokens: int = 6, scale: float = 1.0) -> KVSegment:
    g = torch.Generator().manual_seed(seed)
    keys = [scale * torch.randn(1, HEADS, tokens, DIM, generator=g) for _ in range(LAYERS)]
    values = [scale * torch.randn(1, HEADS, tokens, DIM, generator=g) for _ in range(LAYERS)]
    return KVSegment.create(kind=KIND, text="x" * tokens, token_ids=list(range(tokens)), char_spans=[(i, i + 1) for i in range(tokens)],
                            keys=keys, values=values, model_fingerprint="m")


def offsets(seed: int, tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(LAYERS - 1, HEADS, tokens, DIM, generator=g), torch.randn(LAYERS - 1, HEADS, tokens, DIM, generator=g))


def stacked(seg: KVSegment) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([k[0] for k in seg.keys[1:]]), torch.stack([v[0] for v in seg.values[1:]])


def registry(**kw) -> AnchorRegistry:
    return AnchorRegistry(**{"estimator": "weighted", "max_bytes": 1 << 30, **kw})


def test_identical_anchor_gets_weight_one_and_its_exact_offsets():
    reg = registry()
    anchors = [segment(i, scale=20.0) for i in range(4)]  # distances >> temperature
    for i, seg in enumerate(anchors):
        reg.record("s2", seg, 0, *offsets(i), new_anchor=True)
    pool = reg.pool(KIND)
    query_k, query_v = stacked(anchors[2])
    slots = pool.candidates("s2", 6)
    est = pool.estimate("s2", query_k, query_v, slots, "weighted", 1.0)
    k_off, v_off = offsets(2)
    torch.testing.assert_close(est.keys, k_off, atol=1e-4, rtol=0)
    torch.testing.assert_close(est.values, v_off, atol=1e-4, rtol=0)
    distances = pool.value_distances(query_v, slots)
    _, p = entropy_score(distances)
    assert p[slots.tolist().index(pool.slot_of(anchors[2].id))] > 0.999
    mean = pool.estimate("s2", query_k, query_v, slots, "mean", 1.0)  # the plain average differs
    assert not torch.allclose(mean.keys, k_off, atol=1e-2)


def test_prefix_weights_are_right_aligned_per_channel():
    reg = registry()
    long_anchor, other = segment(0, tokens=9, scale=20.0), segment(1, tokens=9, scale=20.0)
    for i, seg in enumerate((long_anchor, other)):
        reg.record("s2", seg, 0, *offsets(i, tokens=9), new_anchor=True)
        reg.record_prefix("s2", seg, "piece", *offsets(10 + i, tokens=3))
    # the query is the last 6 tokens of the long anchor: right-aligned prefix weights pick it
    query_k, query_v = stacked(long_anchor)
    pool = reg.pool(KIND)
    est = pool.estimate("s2", query_k[:, :, 3:], query_v[:, :, 3:], pool.candidates("s2", 6), "weighted", 1.0, piece="piece")
    k_pre, v_pre = offsets(10, tokens=3)
    torch.testing.assert_close(est.prefix_keys, k_pre, atol=1e-4, rtol=0)
    torch.testing.assert_close(est.prefix_values, v_pre, atol=1e-4, rtol=0)


def test_equally_distant_anchors_give_maximal_entropy_and_a_new_anchor():
    score, p = entropy_score(torch.full((5,), 7.0))
    assert math.isclose(score, 1.0, rel_tol=1e-9) and torch.allclose(p, torch.full((5,), 0.2))
    reg = registry(gamma=0.3)
    base = segment(0)
    for i in range(4):  # anchors at exactly the same value distance from the query
        seg = segment(100 + i)
        for layer in range(1, LAYERS):
            seg.values[layer] = base.values[layer].clone()
            seg.values[layer][0, i % HEADS, i, 0] += 2.0
        reg.record("s2", seg, 0, *offsets(i), new_anchor=True)
    verdict = reg.judge("s2", base)
    assert verdict.anchors == 4 and math.isclose(verdict.entropy, 1.0, rel_tol=1e-6)
    assert not verdict.reuse and verdict.reason == "new_anchor"


def test_gate_needs_two_anchors_and_reuses_a_clear_nearest():
    reg = registry(gamma=0.3)
    query = segment(0)
    reg.record("s2", segment(1, scale=5.0), 0, *offsets(1), new_anchor=True)
    assert reg.judge("s2", query).reason == "new_anchor"  # one anchor only
    assert reg.judge("s3", query).anchors == 0  # no offsets for this receiver
    near = segment(0)  # same tensors as the query, another segment id
    reg.record("s2", near, 0, *offsets(2), new_anchor=True)
    verdict = reg.judge("s2", query)
    assert verdict.reuse and verdict.anchors == 2 and verdict.entropy < 0.01
    assert int(reg.pool(KIND).activations[reg.pool(KIND).slot_of(near.id)]) == 1  # credited
    assert int(reg.pool(KIND).activations[reg.pool(KIND).slot_of(query.id) or 0]) == 0


def test_error_gate_uses_the_measured_estimate_error():
    reg = registry(gate="error", max_error=0.5, estimator="mean")
    same = offsets(0)
    for i in range(2):
        reg.record("s2", segment(i), 0, *same, new_anchor=True)  # second one measures error 0
    assert reg.measured_error("s2", KIND) == pytest.approx(0.0, abs=1e-6)
    verdict = reg.judge("s2", segment(5))
    assert verdict.reuse and verdict.score == pytest.approx(0.0, abs=1e-6)
    reg.record("s2", segment(6), 0, *offsets(6), new_anchor=True)  # unrelated offsets: error ~1.2
    reg.record("s2", segment(7), 0, *offsets(7), new_anchor=True)
    assert reg.measured_error("s2", KIND) > 0.5
    assert not reg.judge("s2", segment(8)).reuse


def test_top_p_credits_only_the_nearest():
    assert top_p_members(torch.tensor([0.05, 0.6, 0.3, 0.05]), 0.9).tolist() == [1, 2]
    assert top_p_members(torch.tensor([0.95, 0.05]), 0.9).tolist() == [0]


def test_eviction_drops_the_least_activated_of_the_oldest():
    pool = AnchorPool(KIND, max_anchors=6, eviction_window=3)
    segs = [segment(i) for i in range(6)]
    for seg in segs:
        pool.add(seg)
    pool.activations[pool.slot_of(segs[0].id)] = 5
    pool.activations[pool.slot_of(segs[1].id)] = 1
    pool.activations[pool.slot_of(segs[2].id)] = 3
    pool.activations[pool.slot_of(segs[3].id)] = 0  # least activated overall, but not among the 3 oldest
    pool.add(segment(6))
    assert pool.slot_of(segs[1].id) is None and len(pool) == 6
    pool.add(segment(7))  # oldest now 0, 2, 3 -> 3 (activation 0) goes
    assert pool.slot_of(segs[3].id) is None and pool.slot_of(segs[0].id) is not None


def test_pools_never_exceed_their_limits():
    reg = registry(max_anchors=4, eviction_window=2)
    for i in range(11):
        reg.record("s2", segment(i), 0, *offsets(i), new_anchor=True)
        reg.record_prefix("s2", segment(i), "p", *offsets(i, tokens=2))
        assert len(reg.pool(KIND)) <= 4 and reg.pool(KIND).base_keys.shape[0] <= 4
    one = reg.nbytes()
    reg.max_bytes = one // 2
    reg.record("s2", segment(50), 0, *offsets(50), new_anchor=True)
    assert reg.nbytes() <= reg.max_bytes and len(reg.pool(KIND)) >= 1
    reg.frozen = True
    before = reg.nbytes()
    assert reg.record("s2", segment(60), 0, *offsets(60), new_anchor=True) is None and reg.nbytes() == before


REPLY = "The answer is 72 because 48 plus 24 equals 72."


def _engines(model, tokenizer, **config):
    return KVCommEngine(model, tokenizer, config=KVCommConfig(min_anchors=1, prefix_cache=False, **config))


@pytest.mark.parametrize("offsets_mode,template", [("mean", "in_context"), ("weighted", "in_context"), ("weighted", "reuse")])
def test_anchor_from_the_same_context_reproduces_dense_logits(model, tokenizer, offsets_mode, template):
    """Solver 2 sees the question and solver 1's reply twice in the same context: the first call
    is a new anchor (prefilled, recorded); the second reuses with the recorded offsets, which
    restore the real KV exactly (template pieces too, with template reuse), so logits equal dense."""
    reply_ids = tokenizer(REPLY)["input_ids"] + [tokenizer.eos_token_id]
    receiver = solver_messages("You are solver two, and you check the work of others.", REPLY)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(reuse=False))
    dense_logits = dense.chat(receiver, agent="s2", max_new_tokens=1, return_logits=True).first_token_logits
    results = {}
    for mode in (offsets_mode, "none"):
        engine = _engines(model, tokenizer, offsets=mode, template=template)
        engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=reply_ids)
        first = engine.chat(receiver, agent="s2", max_new_tokens=1)
        second = engine.chat(receiver, agent="s2", max_new_tokens=1, return_logits=True)
        results[mode] = (first, second)
    first, second = results[offsets_mode]
    assert [d.reason for d in first.stats.decisions] == ["new_anchor", "after_new_anchor"]
    assert first.stats.reused_tokens == 0 and first.stats.decisions[0].gate.decision == "new_anchor"
    assert second.stats.mode == "reuse" and all(d.status == "reused" for d in second.stats.decisions)
    assert (second.stats.template_tokens > 0) == (template == "reuse")
    torch.testing.assert_close(second.first_token_logits, dense_logits, atol=1e-4, rtol=0)
    rerotated = results["none"][1]
    assert rerotated.stats.reused_tokens == second.stats.reused_tokens  # same reuse, no offsets
    assert first_token_kl(dense_logits, rerotated.first_token_logits) > 100 * first_token_kl(dense_logits, second.first_token_logits)


def test_anchor_is_exact_with_the_whole_prompt_shifted(llama, tokenizer):
    """Anchors live in the canonical frame: the same plan run 37 positions later gives the
    dense logits of the shifted prompt."""
    reply_ids = tokenizer(REPLY)["input_ids"] + [tokenizer.eos_token_id]
    receiver = solver_messages("You are solver two, and you check the work of others.", REPLY)
    engine = _engines(llama, tokenizer, offsets="weighted", template="reuse")
    engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=reply_ids)
    engine.chat(receiver, agent="s2", max_new_tokens=1)
    layout = render_prompt(tokenizer, receiver)
    plan = engine._plan(layout, receiver, "s2", None, 1)
    assert plan.runs and plan.template_tokens > 0
    with torch.inference_mode():
        dense = prefill(llama, engine.info.rotator, CallPlan(layout.ids), position_offset=37).logits
        reused = prefill(llama, engine.info.rotator, plan, position_offset=37).logits
        unshifted_dense = prefill(llama, engine.info.rotator, CallPlan(layout.ids)).logits
    torch.testing.assert_close(reused, dense, atol=1e-4, rtol=0)
    torch.testing.assert_close(dense, unshifted_dense, atol=1e-4, rtol=0)


def test_freeze_anchors_stops_learning(llama, tokenizer):
    engine = _engines(llama, tokenizer, offsets="mean", template="reuse")
    reply_ids = tokenizer(REPLY)["input_ids"] + [tokenizer.eos_token_id]
    with engine.freeze_anchors():
        engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=reply_ids)
        engine.chat(solver_messages("You are solver two.", REPLY), agent="s2", max_new_tokens=1)
    assert engine.anchors.nbytes() == 0 and len(engine.templates) == 0
    engine.chat(solver_messages("You are solver two.", REPLY), agent="s2", max_new_tokens=1)
    assert engine.anchors.anchors(("user", None)) == 1 and len(engine.templates) > 0


def test_audits_record_the_reused_segments_as_anchors(llama, tokenizer):
    engine = _engines(llama, tokenizer, offsets="mean", gate="error", max_error=10.0, audit_every=1)
    # each question shorter than the last, so earlier anchors are long enough to be consulted
    questions = [f"How many apples are left if Sam has {'very ' * (4 - i)}many and eats {i}?" for i in range(3)]
    for question in questions:
        engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)  # captures it
        result = engine.chat([{"role": "system", "content": "You are solver two."},
                              {"role": "user", "content": question}], agent="s2", max_new_tokens=1)
    # questions 1-2 are new anchors (the 2nd measures the estimate's error); the 3rd is reused,
    # audited, and the audit's exact KV makes it an anchor as well
    assert result.stats.mode == "reuse" and result.stats.audit_kl is not None
    assert [d.gate.decision for d in result.stats.shared_decisions] == ["reuse"]
    assert engine.anchors.anchors(("user", None)) == 3


def test_offsets_measured_worse_than_none_are_not_applied(llama, tokenizer):
    questions = [f"How many apples are left if Sam has {'very ' * (4 - i)}many and eats {i}?" for i in range(3)]

    def third_plan(**config):
        engine = _engines(llama, tokenizer, offsets="mean", gamma=1.0, **config)
        for question in questions:
            engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)
            messages = [{"role": "system", "content": "You are solver two."}, {"role": "user", "content": question}]
            layout = render_prompt(tokenizer, messages)
            plan = engine._plan(layout, messages, "s2", None, 1)
            engine.chat(messages, agent="s2", max_new_tokens=1)
        return plan

    with_offsets, capped = third_plan(), third_plan(offset_max_error=1e-6)
    assert with_offsets.runs and all(r.key_offsets is not None for r in with_offsets.runs)
    assert [d.gate.error > 1e-6 for d in capped.decisions] == [True]
    assert capped.runs and all(r.key_offsets is None for r in capped.runs)  # still reused, re-rotated only
