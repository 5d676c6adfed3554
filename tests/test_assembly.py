"""Exactness of the assembly: re-rotated layer-0 KV, exact prefixes, and the mask oracle."""

import pytest
import torch

from kvcomm_agents.cache import hf_cache
from kvcomm_agents.cache.assembly import prefill
from kvcomm_agents.cache.store import SegmentStore
from kvcomm_agents.packaging import cut_segment
from kvcomm_agents.plan import CallPlan, PrefixHit, ReusedRun
from kvcomm_agents.planner import plan_call
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.support import inspect_model

from .conftest import rtol, solver_messages, tol


@torch.inference_mode()
def dense_cache(model, ids):
    cache = hf_cache.new_cache(model)
    logits = hf_cache.run_forward(model, ids[None].to(model.device), cache)
    return logits[0, -1].float(), cache


@pytest.mark.exact
def test_layer0_of_rerotated_segment_equals_dense(model, make_engine, tokenizer):
    """A shared question and a reply reused at new positions: layer 0 is exact after re-rotation."""
    engine = make_engine(model)
    reply = tokenizer("The answer is 72 because 48 plus 24 equals 72.")["input_ids"] + [tokenizer.eos_token_id]
    first = engine.chat(solver_messages("You are solver one."), agent="s1", force_reply_ids=reply)
    assert first.text == "The answer is 72 because 48 plus 24 equals 72."
    receiver = solver_messages("You are solver two, and you check the work of others.", first.text)
    layout = render_prompt(tokenizer, receiver)
    plan = plan_call(layout, receiver, store=engine.store, model=engine.fingerprint, config=engine.config)
    assert {d.reason for d in plan.decisions} == {"content"} and len(plan.runs) == 2
    _, cache = dense_cache(model, layout.ids)
    dense_k, dense_v = hf_cache.layer_kv(cache, 0)
    for run in plan.runs:
        segment_slice = slice(run.segment_start, run.segment_start + run.length)
        moved = engine.info.rotator.shift(run.segment.keys[0][:, :, segment_slice], run.shift)
        torch.testing.assert_close(moved, dense_k[:, :, run.prompt_start : run.prompt_end], atol=tol(1e-5), rtol=rtol())
        torch.testing.assert_close(
            run.segment.values[0][:, :, segment_slice], dense_v[:, :, run.prompt_start : run.prompt_end],
            atol=tol(1e-6), rtol=rtol(),
        )
        assert run.shift != 0


def _oracle_plan(model, tokenizer, ids, pieces, prefix_len=0):
    """Cut the prompt's own dense KV into pieces, store them in the canonical frame, and plan
    them as reused runs at their original positions."""
    _, cache = dense_cache(model, ids)
    slots = torch.arange(ids.numel())
    info = inspect_model(model, tokenizer, reuse=True, verify_rope=False)
    runs = []
    for start, end in pieces:
        segment = cut_segment(
            cache=cache, slot_positions=slots, rotator=info.rotator, start=start,
            token_ids=ids[start:end].tolist(), char_spans=[None] * (end - start), text="piece",
            kind=("user", None), model_fingerprint=info.fingerprint,
        )
        runs.append(ReusedRun(segment, start, 0, end - start))
    plan = CallPlan(ids, runs=runs)
    if prefix_len:
        store = SegmentStore(1 << 30)
        keys = [hf_cache.layer_kv(cache, i)[0][:, :, :prefix_len].clone() for i in range(model.config.num_hidden_layers)]
        values = [hf_cache.layer_kv(cache, i)[1][:, :, :prefix_len].clone() for i in range(model.config.num_hidden_layers)]
        store.put_prefix(ids[:prefix_len], keys, values, info.fingerprint)
        entry, n = store.longest_prefix(ids, info.fingerprint)
        plan.prefix = PrefixHit(entry, n)
    return plan, info


@pytest.mark.exact
@pytest.mark.parametrize("prefix_len", [0, 5])
def test_mask_oracle_reproduces_dense_logits(model, tokenizer, prefix_len):
    messages = solver_messages("You are solver three.", "the answer is 72", "I think it is 72 as well")
    ids = render_prompt(tokenizer, messages).ids
    n = ids.numel()
    pieces = [(8, 20), (26, 40), (45, n - 6)]  # computed text between and after reused pieces
    dense_logits, _ = dense_cache(model, ids)
    plan, info = _oracle_plan(model, tokenizer, ids, pieces, prefix_len)
    with torch.inference_mode():
        result = prefill(model, info.rotator, plan)
    torch.testing.assert_close(result.logits, dense_logits, atol=tol(1e-4), rtol=0)
    assert sorted(result.slot_positions.tolist()) == list(range(n))


@pytest.mark.exact
def test_mask_oracle_detects_a_missing_mask(model, tokenizer):
    """The same assembly without the position mask lets tokens see later reused KV: logits move."""
    messages = solver_messages("You are solver three.", "the answer is 72")
    ids = render_prompt(tokenizer, messages).ids
    dense_logits, _ = dense_cache(model, ids)
    plan, info = _oracle_plan(model, tokenizer, ids, [(10, 30)])
    from kvcomm_agents.cache import assembly

    layers = [assembly.assemble_layer(plan, info.rotator, i) for i in range(model.config.num_hidden_layers)]
    cache = hf_cache.cache_from_layers(model, layers)
    computed = plan.computed_positions()
    with torch.inference_mode():
        unmasked = hf_cache.run_forward(model, ids[computed][None].to(model.device), cache,
                                        position_ids=computed[None].to(model.device))
    assert (unmasked[0, -1].float() - dense_logits).abs().max() > max(1e-3, 2 * tol(1e-4))


def test_exact_prefix_reuse_gives_dense_logits(model, tokenizer, make_engine):
    engine = make_engine(model)
    history = solver_messages("You are solver one.")
    first = engine.chat(history, agent="s1", max_new_tokens=12)
    follow_up = history + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Check it again."}]
    layout = render_prompt(tokenizer, follow_up)
    plan = plan_call(layout, follow_up, store=engine.store, model=engine.fingerprint, config=engine.config)
    assert plan.prefix_length > len(render_prompt(tokenizer, history).ids) - 1
    with torch.inference_mode():
        reused = prefill(model, engine.info.rotator, plan)
    dense_logits, _ = dense_cache(model, layout.ids)
    torch.testing.assert_close(reused.logits, dense_logits, atol=1e-4, rtol=0)


def test_stacked_assembly_equals_the_per_layer_one(llama, tokenizer):
    """The whole-model assembly (one rotation, offset addition and concatenation per run) gives
    the per-layer assembly's KV, with a prefix, offsets, a position offset and recomputed tokens."""
    from kvcomm_agents.cache import assembly

    messages = solver_messages("You are solver three.", "the answer is 72", "I think it is 72 as well")
    ids = render_prompt(tokenizer, messages).ids
    plan, info = _oracle_plan(llama, tokenizer, ids, [(8, 20), (26, 40)], prefix_len=5)
    layers = llama.config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    for run in plan.runs:
        shape = (layers - 1, *run.segment.keys[0].shape[1:2], run.length, run.segment.keys[0].shape[3])
        run.key_offsets = torch.randn(shape, generator=generator).to(llama.device) * 0.1
        run.value_offsets = torch.randn(shape, generator=generator).to(llama.device) * 0.1
    plan.recompute = torch.tensor([9, 30, 31])
    stacked = assembly.assemble(plan, info.rotator, layers, position_offset=3)
    keep = (~torch.isin(torch.cat([torch.arange(5), torch.arange(8, 20), torch.arange(26, 40)]), plan.recompute))
    for layer in range(layers):
        k, v = assembly.assemble_layer(plan, info.rotator, layer, position_offset=3)
        index = keep.nonzero().flatten().to(k.device)
        torch.testing.assert_close(stacked[layer][0], k.index_select(2, index), atol=tol(1e-6), rtol=rtol())
        torch.testing.assert_close(stacked[layer][1], v.index_select(2, index), atol=tol(1e-6), rtol=rtol())
    assert plan.reused_positions().tolist() == [p for p in range(40) if (p < 5 or 8 <= p < 20 or p >= 26)
                                                and p not in (9, 30, 31)]
    assert plan.reused_tokens == 5 + 12 + 14 - 3
