"""Computing where the anchors disagree (``experimental.recompute_spread``): the estimate's
per-token spread, the least sure tokens picked from it, and the call that computes them."""

from __future__ import annotations

import math

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.anchors.estimate import estimate_offsets
from kvcomm_agents.config import ExperimentalSettings
from kvcomm_agents.planner import _least_sure
from kvcomm_agents.plan import ReusedRun

USER = ("user", None)
QUESTIONS = [f"How many apples are left if Sam has {'very ' * (8 - i)}many and eats {i}?" for i in range(4)]


def _engine(model, tokenizer, spread: float) -> KVCommEngine:
    config = KVCommConfig(gamma=1.0, audit_every=0, prefix_cache=False, kl_budget=None,
                          experimental=ExperimentalSettings(recompute_spread=spread))
    return KVCommEngine(model, tokenizer, config=config)


def _third_call(engine: KVCommEngine, tokenizer):
    """Two questions make two anchors for s2; the third (shorter) is reused with estimates."""
    for question in QUESTIONS[:3]:
        engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)
        result = engine.replay([{"role": "system", "content": "You are solver two."},
                                {"role": "user", "content": question}], agent="s2",
                               reply_ids=[tokenizer.eos_token_id]).result
    return result.stats


def test_the_least_sure_share_of_estimated_tokens_is_computed(model, tokenizer):
    plain = _third_call(_engine(model, tokenizer, 0.0), tokenizer)
    (decision,) = plain.shared_decisions
    assert decision.gate.offsets == "estimated" and plain.recomputed_tokens == 0
    estimated = decision.reused_tokens
    spread = _third_call(_engine(model, tokenizer, 0.25), tokenizer)
    assert spread.recomputed_tokens == math.ceil(0.25 * estimated)
    assert spread.reused_tokens == plain.reused_tokens - spread.recomputed_tokens


def test_the_spread_is_the_anchors_variance_and_the_top_tokens_are_picked(model, tokenizer):
    engine = _engine(model, tokenizer, 0.25)
    _third_call(engine, tokenizer)
    pool = engine.anchors.pool(USER)
    slots = torch.tensor([0, 1])
    t = int(pool.lengths[slots].min())
    base = pool.base(0)[0][:, :, :t]
    got = estimate_offsets(pool, "s2", base, base, slots, "mean", 1.0, spread=True)
    k, v = pool.placeholder["s2"].dense(slots, t)
    expected = k.var(dim=0).mean(dim=(0, 1, 3)) + v.var(dim=0).mean(dim=(0, 1, 3))
    torch.testing.assert_close(got.spread, expected)
    assert estimate_offsets(pool, "s2", base, base, slots, "mean", 1.0).spread is None  # only when asked

    segment = object()
    runs = [ReusedRun(segment, 10, 0, 4, spread=torch.tensor([0.1, 0.9, 0.2, 0.3])),
            ReusedRun(segment, 20, 0, 4, spread=torch.tensor([0.8, 0.0, 0.0, 0.7])),
            ReusedRun(segment, 30, 0, 4, spread=torch.tensor([5.0, 5.0, 5.0, 5.0]), offsets_on=False),
            ReusedRun(segment, 40, 0, 4)]  # exact or a version: never picked
    assert _least_sure(runs, 3 / 8).tolist() == [11, 20, 23]
    assert _least_sure(runs, 0.0) is None and _least_sure(runs[3:], 0.5) is None
