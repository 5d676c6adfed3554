"""The whole-graph protocol (benchmarks/graph.py): every forward a strategy runs is charged to the
graph whose request caused it, copies, audits and work done ahead included; the competitors it
compares are what they say they are."""

import pytest
import torch

from benchmarks.graph import ModelMeter, known_prompts, run_graph
from benchmarks.graph_report import summarize_decisions, summarize_graphs
from benchmarks.strategies import EngineStrategy, build
from benchmarks.workloads import fan_out, gsm8k_debate
from kvcomm_agents.engines import hf
from kvcomm_agents.prompt import render_prompt


EXTRA = 10  # tokens a rogue strategy forwards without reporting them


class Rogue(EngineStrategy):
    """Re-rotation that also runs a forward of its own after each call (as a copy fed outside
    the engine would) and reports nothing of it."""

    def call(self, *args, **kwargs):
        out = super().call(*args, **kwargs)
        with torch.inference_mode():
            hf.run_forward(self.engine.model, torch.ones((1, EXTRA), dtype=torch.long), hf.new_cache(self.engine.model))
        return out


def _run(model, tokenizer, workload, strategies, warmup=1):
    meter = ModelMeter(model)
    try:
        return run_graph(workload, strategies, warmup=warmup, phase="t", tokenizer=tokenizer,
                         eos_ids={tokenizer.eos_token_id}, meter=meter)
    finally:
        meter.close()


def test_every_forward_is_charged_to_its_graph(llama, tokenizer):
    """KVCOMM with an audit on every reused call and copies switched on, a rogue strategy, pipelined
    prefill: a graph's tokens are what the model forwarded during its calls, whoever asked.
    (Re-rotation is not trusted on measurement for the audited one: readers served re-rotated
    get no copies. The default, with its re-rotation checks, is charged the same way.)"""
    audited_settings = {"method": "kvcomm", "audit_every": 1, "audit_share": None, "recompute_head": 4, "measured_rerotation": False,
                         "reply_copies": True, "text_copies": True}
    strategies = [build("dense", llama, tokenizer), EngineStrategy("kvcomm-audited", llama, tokenizer, audited_settings),
                  Rogue("rogue", llama, tokenizer, {"method": "rerotate"}), build("pipelined", llama, tokenizer),
                  build("lower-bound", llama, tokenizer), build("kvcomm-mean", llama, tokenizer)]
    workload = gsm8k_debate(requests=4, agents=3, reply_tokens=16, split="dev")
    records, _ = _run(llama, tokenizer, workload, strategies)
    by = lambda name: [r for r in records if r["strategy"] == name]  # noqa: E731
    for r in by("dense") + by("kvcomm-audited") + by("kvcomm-mean"):
        assert r["model_tokens"] == sum(r["forwarded"].values())
    # the default's re-rotation checks (a reuse prefill after a call it computed) are audit tokens
    assert sum(r["forwarded"]["audit"] for r in by("kvcomm-mean")) > 0
    assert all(r["model_tokens"] == sum(r["forwarded"].values()) + EXTRA for r in by("rogue"))
    audited = by("kvcomm-audited")
    assert sum(r["forwarded"]["audit"] for r in audited) > 0 and sum(r["forwarded"]["copies"] for r in audited) > 0
    # pipelined: the senders' turns carry the readers' prefixes computed ahead, the readers reuse them exactly
    pipelined = [r for r in by("pipelined") if not r["warmup"]]
    senders = [r for r in pipelined if r["agent_index"] < 3]
    assert all(r["model_tokens"] > sum(r["forwarded"].values()) for r in senders)
    readers = [r for r in pipelined if r["agent_index"] > 1]
    assert all(r["reused_tokens"] > 0 and r["kl"] < 1e-6 for r in readers)
    # the lower bound: exact, and charged only what it computes (its own text and the decode)
    bound = [r for r in by("lower-bound") if r["agent_index"] > 1 and not r["warmup"]]
    assert bound and all(r["kl"] < 1e-6 and 0 < r["model_tokens"] < r["prompt_tokens"] for r in bound)
    # ... and its graphs never forward more than an exact strategy's (prefix caching is free for it too)
    graph_tokens = lambda name: {q: sum(r["model_tokens"] for r in by(name) if r["request"] == q)  # noqa: E731
                                 for q in {r["request"] for r in pipelined}}
    limit, exact = graph_tokens("lower-bound"), graph_tokens("pipelined")
    assert all(limit[q] < exact[q] for q in limit)
    # the graph totals are the calls' sums, per request
    rows = {row["strategy"]: row for row in summarize_graphs(records)}
    assert rows["dense"]["speedup_vs_dense"] == 1.0 and rows["dense"]["tokens_vs_dense"] == 1.0
    measured = [r for r in by("rogue") if not r["warmup"]]
    requests = {r["request"] for r in measured}
    assert rows["rogue"]["tokens_mean"] == sum(r["model_tokens"] for r in measured) / len(requests)


def test_known_prompts_are_prefixes_of_the_readers_real_prompts(tokenizer):
    request = gsm8k_debate(requests=1, agents=4, split="dev").requests[0]
    replies = ["Forty-two is the answer, since six times seven is 42.", "I agree: 42."]
    known = known_prompts(tokenizer, request, 1, replies[:1])  # while agent 2 (index 1) decodes
    assert len(known) == 2
    for j, ids in zip((2, 3), known):
        real = render_prompt(tokenizer, request.messages(j, replies + ["x"] * (j - 2))).ids
        assert ids.numel() > 10 and torch.equal(real[: ids.numel()], ids)
        assert tokenizer.decode(ids).count(replies[0]) == 1  # the reply written is known, the next one not


def test_the_decider_is_compared_with_dense_on_the_same_candidates(llama, tokenizer):
    workload = fan_out(requests=2, reply_tokens=4, split="dev")
    strategies = [build("dense", llama, tokenizer), build("rerotate", llama, tokenizer)]
    _, answers = _run(llama, tokenizer, workload, strategies, warmup=0)
    assert len(answers) == 2 and all(set(a["answers"]) == {"dense", "rerotate"} for a in answers)
    rows = {row["strategy"]: row for row in summarize_decisions(answers)}
    assert rows["dense"]["same_as_dense"] == 1.0 and rows["rerotate"]["requests"] == 2


class Spy(EngineStrategy):
    """An engine strategy that notes, per replayed call, the agent and whether the reply was fed one
    step per token (a decision generated apart is not a replay)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def call(self, messages, agent, forced_ids=None, max_new_tokens=128, *, stepwise=True, shared_texts=()):
        if forced_ids is not None:
            self.calls.append((agent, stepwise))
        return super().call(messages, agent, forced_ids, max_new_tokens, stepwise=stepwise, shared_texts=shared_texts)


def test_decision_only_requests_feed_replies_at_once_and_the_noise_floor_runs_the_decider_only(llama, tokenizer):
    """A request that not every strategy runs is not timed (its replies are fed in one forward);
    the bf16 noise floor takes part in the decider's calls only and is a decision row, not a graph."""
    from benchmarks.strategies import noise_floor

    workload = fan_out(requests=3, reply_tokens=4, split="dev")
    deciding = Spy("rerotate", llama, tokenizer, {"method": "rerotate", "audit_every": 0})
    timed_only = Spy("prefix", llama, tokenizer, {"method": "exact_prefix", "audit_every": 0})
    timed_only.requests = range(2)
    floor = noise_floor(llama, tokenizer, requests=range(1, 3))
    records, answers = _run(llama, tokenizer, workload, [build("dense", llama, tokenizer), deciding, timed_only, floor])
    agents = [len(r.agents) for r in workload.requests]
    # request 0 a warm-up, 1 timed (every strategy), 2 the decision strategies' only
    assert [s for _, s in deciding.calls] == [False] * agents[0] + [True] * agents[1] + [False] * agents[2]
    assert [s for _, s in timed_only.calls] == [False] * agents[0] + [True] * agents[1]
    ours = [r for r in records if r["strategy"] == floor.name]
    assert [(r["request"], r["agent_index"]) for r in ours] == [(1, agents[1]), (2, agents[2])]  # 1-based
    assert floor.name not in {row["strategy"] for row in summarize_graphs(records)}
    rows = {row["strategy"]: row for row in summarize_decisions(answers)}
    assert rows[floor.name]["requests"] == 2 and rows["prefix"]["requests"] == 1
    # the decider's KL is the decider's call's, per strategy
    assert rows[floor.name]["decider_kl_mean"] > 0 and rows["dense"]["decider_kl_mean"] == 0.0
    expected = sum(r["kl"] for r in records if r["strategy"] == "rerotate" and not r["warmup"]
                   and r["agent_index"] == agents[r["request"]]) / 2
    assert rows["rerotate"]["decider_kl_mean"] == pytest.approx(expected)


def test_a_cold_run_gives_every_request_fresh_strategies(llama, tokenizer):
    """``renew`` (``python -m benchmarks --cold``): each request runs on strategies built anew,
    so its first agent finds nothing stored; without it, a later request's first agent reuses the
    system prompt the earlier request left behind."""
    workload = gsm8k_debate(requests=3, agents=2, reply_tokens=4, split="dev")

    def fresh():
        return [build("dense", llama, tokenizer), build("prefix", llama, tokenizer)]

    firsts = {}
    for cold in (True, False):
        meter = ModelMeter(llama)
        try:
            records, _ = run_graph(workload, fresh(), warmup=0, phase="t", tokenizer=tokenizer,
                                   eos_ids={tokenizer.eos_token_id}, meter=meter, renew=fresh if cold else None)
        finally:
            meter.close()
        firsts[cold] = [r["reused_tokens"] for r in records if r["strategy"] == "prefix" and r["agent_index"] == 1]
    assert len(firsts[True]) == 3 and not any(firsts[True])
    assert firsts[False][0] == 0 and all(n > 0 for n in firsts[False][1:])
