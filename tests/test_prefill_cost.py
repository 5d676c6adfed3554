"""A plan that reuses too little of its prompt computes it whole (kvcomm_agents.prefill_cost)."""

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.plan import CallPlan
from kvcomm_agents.prefill_cost import PrefillCost, prefill_cost

from .conftest import QUESTION, first_logits, replayed, tol

SYSTEM = "You are solver one."


def test_the_cost_model_weighs_the_masked_forward_against_the_causal_one():
    cost = PrefillCost(pair_cost=1e-3)
    assert cost.causal(1000) == 1000 * (1 + 0.5)
    assert cost.masked(900, 1000) == 900 * (1 + 1.0)
    # threshold at 1,000 tokens: 1 - 1.5 / 2 = 25% reused
    assert not cost.worth_reusing(CallPlan(torch.arange(1000)))  # nothing reused: the whole is cheaper
    assert PrefillCost(0.0).masked(10, 1000) < PrefillCost(0.0).causal(1000)


def test_pair_cost_comes_from_the_model_shape_and_only_on_a_cpu(llama):
    text = llama.config
    linear = sum(p.numel() for name, p in llama.named_parameters() if "embed" not in name and "lm_head" not in name)
    expected = 4 * text.num_attention_heads * (text.hidden_size // text.num_attention_heads) \
        * text.num_hidden_layers / (2 * linear)
    assert abs(prefill_cost(llama, torch.device("cpu")).pair_cost - expected) < 1e-12
    assert prefill_cost(llama, torch.device("meta")) is None


def _long(words: int = 160) -> str:
    return " ".join(QUESTION.split() * (words // len(QUESTION.split()) + 1))[: words * 6]


def _messages(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_a_short_shared_prefix_of_a_long_prompt_is_computed_whole(model, tokenizer):
    engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="exact_prefix", audit_every=0))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    replayed(engine, _messages(SYSTEM, "Hello there."), "a")
    long_prompt = _messages(SYSTEM, _long())
    stats = replayed(engine, long_prompt, "b").stats
    assert stats.prompt_tokens > 200
    assert stats.dense_reason == "little_reuse" and stats.reused_tokens == 0
    assert stats.computed_tokens == stats.prompt_tokens and stats.forwarded.prompt == stats.prompt_tokens
    reasons = {d.reason for d in stats.decisions}
    assert reasons <= {"little_reuse"} and all(d.status == "prefilled" for d in stats.decisions)
    assert torch.allclose(first_logits(engine, long_prompt, "c"), first_logits(dense, long_prompt), atol=tol(1e-4))


def test_the_same_prefix_is_reused_when_the_rule_is_off_or_the_share_is_large(llama, tokenizer):
    off = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="exact_prefix", audit_every=0,
                                                             dense_when_cheaper=False))
    replayed(off, _messages(SYSTEM, "Hello there."), "a")
    stats = replayed(off, _messages(SYSTEM, _long()), "b").stats
    assert stats.dense_reason is None and stats.prefix_tokens > 0

    on = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="exact_prefix", audit_every=0))
    long_prompt = _messages(SYSTEM, _long())
    replayed(on, long_prompt, "a")
    again = replayed(on, long_prompt + [{"role": "user", "content": "And then?"}], "b").stats
    assert again.dense_reason is None and again.reused_tokens > again.prompt_tokens // 2
