"""Exactness of the assembly: re-rotated layer-0 KV, exact prefixes, and the mask oracle."""

import dataclasses

import pytest
import torch

from kvcomm_agents.alignment import assemble
from kvcomm_agents.capture import CallCapture
from kvcomm_agents.config import KVCommConfig
from kvcomm_agents.engines import hf
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.plan import CallPlan, PrefixHit, ReusedRun
from kvcomm_agents.planner import plan_call
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.support import inspect_model

from ..conftest import forced, rtol, run_plan, solver_messages, tol
from ..conftest import mechanics


@torch.inference_mode()
def dense_cache(model, ids):
    cache = hf.new_cache(model)
    logits = hf.run_forward(model, ids[None].to(model.device), cache)
    return logits[0, -1].float(), cache


@pytest.mark.exact
def test_layer0_of_rerotated_segment_equals_dense(model, make_engine, tokenizer):
    """A shared question and a reply reused at new positions: layer 0 is exact after re-rotation."""
    engine = make_engine(model)
    first = engine.replay(solver_messages("You are solver one."), agent="s1", reply_ids=forced(tokenizer)).result
    assert first.text == "The answer is 72 because 48 plus 24 equals 72."
    receiver = solver_messages("You are solver two, and you check the work of others.", first.text)
    layout = render_prompt(tokenizer, receiver)
    plan = plan_call(layout, store=engine.store, fingerprint=engine.fingerprint, config=engine.config)
    assert {d.reason for d in plan.decisions} == {"content"} and len(plan.runs) == 2
    _, cache = dense_cache(model, layout.ids)
    dense_k, dense_v = hf.layer_kv(cache, 0)
    for run in plan.runs:
        segment_slice = slice(run.segment_start, run.segment_start + run.length)
        keys, values = run.segment.kv.layer(0)
        moved = engine.info.rotator.shift(keys[:, :, segment_slice], run.shift)
        torch.testing.assert_close(moved, dense_k[:, :, run.prompt_start : run.prompt_end], atol=tol(1e-5), rtol=rtol())
        torch.testing.assert_close(
            values[:, :, segment_slice], dense_v[:, :, run.prompt_start : run.prompt_end],
            atol=tol(1e-6), rtol=rtol(),
        )
        assert run.shift != 0


def _oracle_plan(model, tokenizer, ids, pieces, prefix_len=0):
    """Cut the prompt's own dense KV into pieces, store them in the canonical frame, and plan
    them as reused runs at their original positions."""
    _, cache = dense_cache(model, ids)
    slots = torch.arange(ids.numel())
    info = inspect_model(model, tokenizer, reuse=True, verify_rope=False)
    store = SegmentStore(1 << 30)
    capture = CallCapture(store, tokenizer, info.rotator, info.fingerprint, mechanics())

    def kv_at(positions):
        return hf.kv_at_positions(cache, slots, positions)

    runs = []
    for start, end in pieces:
        segment = capture.cut(kv_at, start, ids[start:end].tolist(), [None] * (end - start), "piece", ("user", None))
        runs.append(ReusedRun(segment, start, 0, end - start))
    prefix = None
    if prefix_len:
        store.put_prefix(ids[:prefix_len], kv_at(torch.arange(prefix_len)), info.fingerprint)
        entry, n = store.longest_prefix(ids, info.fingerprint)
        prefix = PrefixHit(entry, n)
    return CallPlan(ids, prefix=prefix, runs=tuple(runs)), info


@pytest.mark.exact
@pytest.mark.parametrize("prefix_len", [0, 5])
def test_mask_oracle_reproduces_dense_logits(model, tokenizer, prefix_len):
    messages = solver_messages("You are solver three.", "the answer is 72", "I think it is 72 as well")
    ids = render_prompt(tokenizer, messages).ids
    n = ids.numel()
    pieces = [(8, 20), (26, 40), (45, n - 6)]  # computed text between and after reused pieces
    dense_logits, _ = dense_cache(model, ids)
    plan, info = _oracle_plan(model, tokenizer, ids, pieces, prefix_len)
    result = run_plan(model, info.rotator, plan)
    torch.testing.assert_close(result.logits, dense_logits, atol=tol(1e-4), rtol=0)
    assert sorted(result.slot_positions.tolist()) == list(range(n))


@pytest.mark.exact
def test_mask_oracle_detects_a_missing_mask(model, tokenizer):
    """The same assembly without the position mask lets tokens see later reused KV: logits move."""
    messages = solver_messages("You are solver three.", "the answer is 72")
    ids = render_prompt(tokenizer, messages).ids
    dense_logits, _ = dense_cache(model, ids)
    plan, info = _oracle_plan(model, tokenizer, ids, [(10, 30)])
    with torch.inference_mode():
        block = assemble(plan, info.rotator)
        unmasked = hf.prefill(model, ids, plan.computed_positions(), block, plan.reused_positions(), masked=False)
        masked = hf.prefill(model, ids, plan.computed_positions(), block, plan.reused_positions(), masked=True)
    assert (unmasked.logits - dense_logits).abs().max() > max(1e-3, 2 * tol(1e-4))
    torch.testing.assert_close(masked.logits, dense_logits, atol=tol(1e-4), rtol=0)


@pytest.mark.exact
@pytest.mark.parametrize("budget, min_window", [(40, 1), (400, 1), (2000, 1), (40, 8)])
def test_windowed_prefill_equals_dense_and_keeps_decoding(model, tokenizer, budget, min_window):
    """Long-prompt mode: a small mask budget cuts the prefill into windows (some with reused KV
    between their queries, some plain); logits and the next decode step equal dense."""
    messages = solver_messages("You are solver three.", "the answer is 72", "I think it is 72 as well")
    ids = render_prompt(tokenizer, messages).ids
    n = ids.numel()
    plan, info = _oracle_plan(model, tokenizer, ids, [(8, 20), (26, 40), (45, n - 6)], prefix_len=5)
    computed, reused_at = plan.computed_positions(), plan.reused_positions()
    windows = hf._windows(computed, reused_at, budget, min_window)
    assert len(windows) > 1
    reused_before = torch.searchsorted(reused_at, computed)
    for start, end in windows:  # no reused KV before it (no mask), or within budget, or min_window
        fits = (end - start) * (int(reused_before[end - 1]) + end) <= budget
        assert int(reused_before[end - 1]) == 0 or fits or end - start <= min_window
    assert [w[0] for w in windows[1:]] == [w[1] for w in windows[:-1]] and windows[-1][1] == computed.numel()
    dense_logits, dense = dense_cache(model, ids)
    with torch.inference_mode():
        block = assemble(plan, info.rotator)
        result = hf.prefill(model, ids, computed, block, reused_at, masked=True, mask_budget=budget,
                            min_window=min_window)
        torch.testing.assert_close(result.logits, dense_logits, atol=tol(1e-4), rtol=0)
        assert sorted(result.slot_positions.tolist()) == list(range(n))
        step = torch.tensor([[int(dense_logits.argmax())]], device=model.device)
        position = torch.tensor([[n]], device=model.device)
        after_dense = hf.run_forward(model, step, dense, position_ids=position)[0, -1].float()
        after = hf.run_forward(model, step, result.cache, position_ids=position)[0, -1].float()
    torch.testing.assert_close(after, after_dense, atol=tol(1e-4), rtol=0)


def test_exact_prefix_reuse_gives_dense_logits(model, tokenizer, make_engine):
    engine = make_engine(model)
    history = solver_messages("You are solver one.")
    first = engine.chat(history, agent="s1", max_new_tokens=12)
    follow_up = history + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Check it again."}]
    layout = render_prompt(tokenizer, follow_up)
    plan = plan_call(layout, store=engine.store, fingerprint=engine.fingerprint, config=engine.config)
    assert plan.prefix_length > len(render_prompt(tokenizer, history).ids) - 1
    reused = run_plan(model, engine.info.rotator, plan)
    dense_logits, _ = dense_cache(model, layout.ids)
    torch.testing.assert_close(reused.logits, dense_logits, atol=1e-4, rtol=0)


def test_assembly_equals_a_per_layer_loop(llama, tokenizer):
    """The whole-model assembly (one rotation, offset addition and concatenation per run) gives
    what a per-layer loop written here gives, with a prefix, offsets, a position offset and
    recomputed tokens."""
    messages = solver_messages("You are solver three.", "the answer is 72", "I think it is 72 as well")
    ids = render_prompt(tokenizer, messages).ids
    plan, info = _oracle_plan(llama, tokenizer, ids, [(8, 20), (26, 40)], prefix_len=5)
    layers = llama.config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    runs = []
    for run in plan.runs:
        heads, dim = run.segment.kv.keys[0].shape[1], run.segment.kv.keys[0].shape[3]
        shape = (layers - 1, heads, run.length, dim)
        runs.append(dataclasses.replace(
            run, key_offsets=torch.randn(shape, generator=generator).to(llama.device) * 0.1,
            value_offsets=torch.randn(shape, generator=generator).to(llama.device) * 0.1))
    plan = dataclasses.replace(plan, runs=tuple(runs), recompute=torch.tensor([9, 30, 31]))
    block = assemble(plan, info.rotator, position_offset=3)
    positions = [p for p in range(40) if (p < 5 or 8 <= p < 20 or p >= 26)]
    keep = torch.tensor([i for i, p in enumerate(positions) if p not in (9, 30, 31)])
    for layer in range(layers):
        prefix_k, prefix_v = plan.prefix.entry.kv.layer(layer)
        keys, values = [info.rotator.shift(prefix_k[:, :, :5], 3)], [prefix_v[:, :, :5]]
        for run in plan.runs:
            k, v = run.segment.kv.layer(layer)
            k, v = k[:, :, run.segment_start : run.segment_start + run.length], v[:, :, run.segment_start : run.segment_start + run.length]
            if layer:
                k = (k.float() + run.key_offsets[layer - 1 : layer]).to(k.dtype)
                v = (v.float() + run.value_offsets[layer - 1 : layer]).to(v.dtype)
            keys.append(info.rotator.shift(k, run.prompt_start + 3))  # canonical frame: segment_start 0
            values.append(v)
        k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        index = keep.to(k.device)
        got_k, got_v = block.layer(layer)
        torch.testing.assert_close(got_k, k.index_select(2, index), atol=tol(1e-6), rtol=rtol())
        torch.testing.assert_close(got_v, v.index_select(2, index), atol=tol(1e-6), rtol=rtol())
    assert plan.reused_positions().tolist() == [p for p in positions if p not in (9, 30, 31)]
    assert plan.reused_tokens == 5 + 12 + 14 - 3
    assert sorted(plan.computed_positions().tolist() + plan.reused_positions().tolist()) == list(range(ids.numel()))


@pytest.mark.exact
def test_kv_at_positions_reads_a_cache_in_any_slot_order(model, tokenizer):
    """``kv_at_positions`` on a cache in storage order (reused slots first) gives the KV of the
    prompt positions asked, as the dense cache holds them."""
    messages = solver_messages("You are solver three.", "the answer is 72")
    ids = render_prompt(tokenizer, messages).ids
    _, dense = dense_cache(model, ids)
    plan, info = _oracle_plan(model, tokenizer, ids, [(10, 30)])
    result = run_plan(model, info.rotator, plan)
    assert result.slot_positions[:20].tolist() == list(range(10, 30))
    wanted = torch.tensor([35, 3, 12, 29])
    block = hf.kv_at_positions(result.cache, result.slot_positions, wanted)
    assert block.num_tokens == 4 and block.num_layers == model.config.num_hidden_layers
    for layer in range(block.num_layers):
        k, v = hf.layer_kv(dense, layer)
        got_k, got_v = block.layer(layer)
        torch.testing.assert_close(got_k, k[:, :, wanted.to(k.device)], atol=tol(1e-5), rtol=rtol())
        torch.testing.assert_close(got_v, v[:, :, wanted.to(v.device)], atol=tol(1e-5), rtol=rtol())
    with pytest.raises(ValueError):
        hf.kv_at_positions(result.cache, result.slot_positions[:20], torch.tensor([3]))
