"""Baseline strategies the benchmark compares with: CacheBlend-style recompute, exact-prefix only."""

import math

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.cache import hf_cache
from kvcomm_agents.cache.assembly import assemble_layer
from kvcomm_agents.cache.blend import _probe_layer_kv, deviation_per_token, select_recompute
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.prompt import render_prompt

from ..conftest import QUESTION, solver_messages
from ..test_engine import REPLY, forced


def _receiver_plan(engine, tokenizer, system="You are solver two."):
    """Solver 1 answers; returns solver 2's messages and the engine's plan for them."""
    first = engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=forced(tokenizer))
    messages = solver_messages(system, first.text)
    layout = render_prompt(tokenizer, messages)
    with torch.inference_mode():
        plan = engine._plan(layout, messages, "s2", None, 4)
    return messages, plan


def _dense(model, tokenizer, messages):
    return KVCommEngine(model, tokenizer, config=KVCommConfig(reuse=False)).chat(
        messages, agent="s2", max_new_tokens=1, return_logits=True)


def test_probe_gives_the_dense_kv_of_its_layer(model, tokenizer, make_engine):
    engine = make_engine(model)
    messages, plan = _receiver_plan(engine, tokenizer)
    with torch.inference_mode():
        keys, values = _probe_layer_kv(model, plan, 1)
        full = hf_cache.new_cache(model)
        hf_cache.run_forward(model, plan.prompt_ids[None], full)
    dense_k, dense_v = hf_cache.layer_kv(full, 1)
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
        deviation = deviation_per_token(
            (real[0][:, :, positions], real[1][:, :, positions]),
            assemble_layer(plan, engine.info.rotator, 1, with_prefix=False),
        )
    assert count == math.ceil(0.25 * reused)
    dropped = new_plan.recompute.tolist()
    kept = {p for p in positions.tolist() if p not in dropped}
    assert len(dropped) == count
    by_position = dict(zip(positions.tolist(), deviation.tolist()))
    assert min(by_position[p] for p in dropped) >= max(by_position[p] for p in kept)


def test_recomputing_every_reused_token_is_dense(model, tokenizer, make_engine):
    engine = make_engine(model, recompute_share=1.0)
    messages, _ = _receiver_plan(engine, tokenizer)
    result = engine.chat(messages, agent="s2", max_new_tokens=1, return_logits=True)
    assert result.stats.recomputed_tokens > 0
    assert result.stats.reused_tokens == result.stats.prefix_tokens
    dense = _dense(model, tokenizer, messages)
    assert torch.allclose(result.first_token_logits, dense.first_token_logits, atol=1e-4)


def test_partial_recompute_moves_logits_toward_dense(model, tokenizer, make_engine):
    drift = {}
    for share in (0.0, 0.5):
        engine = make_engine(model, recompute_share=share)
        messages, _ = _receiver_plan(engine, tokenizer)
        result = engine.chat(messages, agent="s2", max_new_tokens=1, return_logits=True)
        s = result.stats
        assert s.reused_tokens + s.computed_tokens == s.prompt_tokens
        assert (s.recomputed_tokens > 0) == (share > 0) and (s.recompute_s > 0) == (share > 0)
        drift[share] = first_token_kl(_dense(model, tokenizer, messages).first_token_logits, result.first_token_logits)
    assert drift[0.0] > 0 and drift[0.5] < drift[0.0]


@pytest.mark.parametrize("offsets", ["none", "mean"])
def test_exact_only_reuses_prefixes_and_reports_segments(llama, tokenizer, make_engine, offsets):
    engine = make_engine(llama, segment_reuse=False, offsets=offsets)
    engine.add_segment(QUESTION, kind=("user", None))  # a segment in the store (e.g. a shared store)
    history = solver_messages("You are solver one.")
    first = engine.chat(history, agent="s1", force_reply_ids=forced(tokenizer))
    assert first.segment is None  # exact prefix caching only: the reply is not cut as a segment
    # another agent: its own system text first, so no exact prefix beyond the template's start
    other = engine.chat(solver_messages("You are solver two.", first.text), agent="s2", max_new_tokens=2)
    assert [(d.status, d.reason) for d in other.stats.decisions] == [("prefilled", "exact_only")]
    assert other.stats.reused_tokens == other.stats.prefix_tokens
    # the same agent's next round starts with its earlier prompt and reply: an exact prefix
    again = history + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Check it again."}]
    second = engine.chat(again, agent="s1", max_new_tokens=1, return_logits=True)
    assert second.stats.prefix_tokens > 0 and second.stats.mode == "prefix"
    dense = _dense(llama, tokenizer, again)
    assert torch.allclose(second.first_token_logits, dense.first_token_logits, atol=1e-4)
