"""Learned offsets: the running mean itself, and exactness when an anchor matches the context."""

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.cache.offsets import OffsetPool
from kvcomm_agents.fidelity import first_token_kl

from ..conftest import solver_messages


def offsets(value, tokens=3, layers=3):
    return [torch.full((1, 2, tokens, 4), float(value)) for _ in range(layers)]


def test_running_mean_per_token_index():
    pool = OffsetPool(max_bytes=1 << 20)
    pool.record("judge", ("user", None), 0, offsets(1.0), offsets(10.0))
    pool.record("judge", ("user", None), 1, offsets(3.0, tokens=4), offsets(30.0, tokens=4))
    keys, values = pool.estimate("judge", ("user", None), 0, 6)
    assert keys[0] is None and values[0] is None  # layer 0 is exact: never offset
    assert keys[1][0, 0, :, 0].tolist() == [1.0, 2.0, 2.0, 3.0, 3.0, 0.0]  # index 5 never observed
    assert values[2][0, 1, 1, 3].item() == 20.0
    assert pool.anchors("judge", ("user", None)) == 2
    assert pool.estimate("judge", ("solver-1", "assistant"), 0, 3) is None
    assert pool.estimate("other", ("user", None), 0, 3) is None


def test_frozen_pool_does_not_change_and_budget_evicts_oldest():
    pool = OffsetPool(max_bytes=1 << 20)
    pool.frozen = True
    pool.record("a", ("user", None), 0, offsets(1.0), offsets(1.0))
    assert pool.anchors("a", ("user", None)) == 0
    pool.frozen = False
    pool.record("a", ("user", None), 0, offsets(1.0), offsets(1.0))
    one_pool = pool.nbytes()
    pool.max_bytes = one_pool
    pool.record("b", ("user", None), 0, offsets(1.0), offsets(1.0))
    assert pool.anchors("a", ("user", None)) == 0 and pool.anchors("b", ("user", None)) == 1
    assert pool.nbytes() <= pool.max_bytes


REPLY = "The answer is 72 because 48 plus 24 equals 72."


def test_anchor_from_the_same_context_reproduces_dense_logits(model, tokenizer):
    """Solver 2 sees the question and solver 1's reply twice in the same context: the first call
    is a new anchor (prefilled, recorded); the second reuses with the recorded offsets, which
    restore the real KV exactly, so the logits equal dense."""
    reply_ids = tokenizer(REPLY)["input_ids"] + [tokenizer.eos_token_id]
    receiver = solver_messages("You are solver two, and you check the work of others.", REPLY)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(reuse=False))
    dense_logits = dense.chat(receiver, agent="s2", max_new_tokens=1, return_logits=True).first_token_logits
    results = {}
    for mode in ("mean", "none"):
        engine = KVCommEngine(model, tokenizer, config=KVCommConfig(offsets=mode, min_anchors=1, prefix_cache=False))
        engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=reply_ids)
        first = engine.chat(receiver, agent="s2", max_new_tokens=1)
        second = engine.chat(receiver, agent="s2", max_new_tokens=1, return_logits=True)
        results[mode] = (first, second)
    first, second = results["mean"]
    assert {d.reason for d in first.stats.decisions} == {"new_anchor", "after_new_anchor"}
    assert first.stats.reused_tokens == 0
    assert second.stats.mode == "reuse" and all(d.status == "reused" for d in second.stats.decisions)
    torch.testing.assert_close(second.first_token_logits, dense_logits, atol=1e-4, rtol=0)
    rerotated = results["none"][1]
    assert rerotated.stats.reused_tokens == second.stats.reused_tokens  # same reuse, no offsets
    assert first_token_kl(dense_logits, rerotated.first_token_logits) > 100 * first_token_kl(dense_logits, second.first_token_logits)


def test_freeze_anchors_stops_learning(llama, tokenizer):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(offsets="mean", min_anchors=1, prefix_cache=False))
    reply_ids = tokenizer(REPLY)["input_ids"] + [tokenizer.eos_token_id]
    with engine.freeze_anchors():
        engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=reply_ids)
        engine.chat(solver_messages("You are solver two.", REPLY), agent="s2", max_new_tokens=1)
    assert engine.offsets.nbytes() == 0
    engine.chat(solver_messages("You are solver two.", REPLY), agent="s2", max_new_tokens=1)
    assert engine.offsets.anchors("s2", ("user", None)) == 1
