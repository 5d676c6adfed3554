"""Baseline strategies the benchmark compares with: CacheBlend-style recompute (a plan hook of
``benchmarks/cacheblend.py``), exact-prefix only (``method="exact_prefix"``)."""

import math

import pytest
import torch

from benchmarks.cacheblend import CacheBlend, _probe_layer_kv, deviation_per_token, select_recompute
from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.alignment import assemble
from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.prompt import render_prompt

from .conftest import QUESTION, REPLY, first_logits, forced, replayed, solver_messages


def _receiver_plan(engine, tokenizer, system="You are solver two."):
    """Solver 1 answers; returns solver 2's messages and the engine's plan for them."""
    first = replayed(engine, solver_messages("You are solver one."), "s1")
    messages = solver_messages(system, first.text)
    layout = render_prompt(tokenizer, messages)
    with torch.inference_mode():
        plan = engine._calls.plan(layout, "s2", None, 4)
    return messages, plan


def _dense_logits(model, tokenizer, messages):
    return first_logits(KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense")), messages, "s2")


def test_probe_gives_the_dense_kv_of_its_layer(model, tokenizer, make_engine):
    engine = make_engine(model)
    messages, plan = _receiver_plan(engine, tokenizer)
    with torch.inference_mode():
        keys, values = _probe_layer_kv(model, plan, 1)
        full = hf.new_cache(model)
        hf.run_forward(model, plan.prompt_ids[None], full)
    dense_k, dense_v = hf.layer_kv(full, 1)
    assert keys.shape == dense_k.shape
    assert torch.allclose(keys, dense_k, atol=1e-5) and torch.allclose(values, dense_v, atol=1e-5)


def test_selection_takes_the_most_deviating_tokens(model, tokenizer, make_engine):
    engine = make_engine(model)
    _, plan = _receiver_plan(engine, tokenizer)
    reused = sum(run.length for run in plan.runs)
    with torch.inference_mode():
        new_plan, count = select_recompute(model, engine.info.rotator, plan, share=0.25)
        real = _probe_layer_kv(model, plan, 1)
        positions = torch.cat([torch.arange(r.prompt_start, r.prompt_end) for r in plan.runs])
        # the reused KV as the engine's assembly builds it (not the baseline's own reader)
        block = assemble(plan, engine.info.rotator)
        slots = plan.reused_positions().tolist()
        index = torch.tensor([slots.index(p) for p in positions.tolist()])
        reused_k, reused_v = block.layer(1)
        deviation = deviation_per_token(
            (real[0][:, :, positions], real[1][:, :, positions]),
            (reused_k[:, :, index], reused_v[:, :, index]),
        )
    assert count == math.ceil(0.25 * reused)
    dropped = new_plan.recompute.tolist()
    kept = {p for p in positions.tolist() if p not in dropped}
    assert len(dropped) == count and new_plan.recompute is not plan.recompute and plan.recompute is None
    by_position = dict(zip(positions.tolist(), deviation.tolist()))
    assert min(by_position[p] for p in dropped) >= max(by_position[p] for p in kept)


def test_deviation_is_the_squared_distance_per_token():
    real = (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    reused = (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    reused[0][0, 1, 2, 3] = 2.0
    reused[1][0, 0, 0, 0] = -1.0
    assert deviation_per_token(real, reused).tolist() == [1.0, 0.0, 4.0]
    with pytest.raises(ValueError):
        CacheBlend(0.0)
    with pytest.raises(ValueError):
        CacheBlend(0.5, probe_layers=1)


def test_recomputing_every_reused_token_is_dense(model, tokenizer, make_engine):
    engine = make_engine(model, plan_hook=CacheBlend(1.0))
    messages, _ = _receiver_plan(engine, tokenizer)
    result = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id])
    assert result.result.stats.recomputed_tokens > 0
    assert result.result.stats.reused_tokens == result.result.stats.prefix_tokens
    assert torch.allclose(result.first_token_logits, _dense_logits(model, tokenizer, messages), atol=1e-4)


def test_partial_recompute_moves_logits_toward_dense(model, tokenizer, make_engine):
    drift = {}
    for share in (0.0, 0.5):
        engine = make_engine(model, plan_hook=CacheBlend(share) if share else None)
        messages, _ = _receiver_plan(engine, tokenizer)
        result = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id])
        s = result.result.stats
        assert s.reused_tokens + s.computed_tokens == s.prompt_tokens
        assert (s.recomputed_tokens > 0) == (share > 0) and (s.hook_s > 0) == (share > 0)
        drift[share] = first_token_kl(_dense_logits(model, tokenizer, messages), result.first_token_logits)
    assert drift[0.0] > 0 and drift[0.5] < drift[0.0]


def test_exact_only_reuses_prefixes_and_reports_segments(llama, tokenizer, make_engine):
    engine = make_engine(llama, method="exact_prefix")
    engine.add_segment(QUESTION, kind=("user", None))  # a segment in the store (e.g. a shared store)
    history = solver_messages("You are solver one.")
    first = replayed(engine, history, "s1")
    assert first.segment is None  # exact prefix caching only: the reply is not cut as a segment
    # another agent: its own system text first, so no exact prefix beyond the template's start
    other = engine.chat(solver_messages("You are solver two.", first.text), agent="s2", max_new_tokens=2)
    assert [(d.status, d.reason) for d in other.stats.decisions] == [("prefilled", "exact_only")]
    assert other.stats.reused_tokens == other.stats.prefix_tokens
    # the same agent's next round starts with its earlier prompt and reply: an exact prefix
    again = history + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Check it again."}]
    second = engine.replay(again, agent="s1", reply_ids=forced(tokenizer))
    assert second.result.stats.prefix_tokens > 0 and second.result.stats.mode == "prefix"
    assert torch.allclose(second.first_token_logits, _dense_logits(llama, tokenizer, again), atol=1e-4)
