"""Calls answering at once step their decode in one forward (kvcomm_agents/batched_decode.py):
the same replies, logits and kept KV as calls stepping alone; which caches batch; left padding
round-trips (drafts off: they are tests/test_drafting.py's). Concurrency and failures: tests/test_batched_decode_concurrency.py."""

import threading

import pytest
import torch
from transformers import DynamicCache, Qwen2Config

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.kv.store import PrefixEntry

from .batching import at_once, greedy_together
from .conftest import tol


@pytest.mark.parametrize("calls", [2, 4])
def test_calls_decoding_at_once_step_in_one_forward_and_answer_as_each_alone(model, tokenizer, calls):
    batched = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
    got, want = at_once(batched, calls, greedy_together(calls)), at_once(alone, calls, greedy_together(calls))
    batcher = batched._calls.decoding.batcher
    assert batcher.batched_steps > 0 and batcher.rows >= 2 * batcher.batched_steps  # forwards of several calls ran
    assert alone._calls.decoding.batcher is None
    for k in range(calls):
        (result, logits), (alone_result, alone_logits) = got[k], want[k]
        assert result.token_ids == alone_result.token_ids
        torch.testing.assert_close(logits, alone_logits, atol=tol(1e-4), rtol=1e-4)
        assert result.stats.forwarded.decode == alone_result.stats.forwarded.decode
        assert alone_result.stats.batched_steps == 0
    assert sum(got[k][0].stats.batched_steps for k in range(calls)) == batcher.rows
    assert batcher._batch is None and not batcher._active  # every call left, its KV back home


def kept(engine) -> dict:
    return {tuple(e.token_ids.tolist()): e for e in engine.store._entries.values() if isinstance(e, PrefixEntry)}


def test_a_batched_call_keeps_the_kv_a_call_stepping_alone_keeps(llama, tokenizer):
    config = KVCommConfig(method="exact_prefix", audit_every=0, draft_tokens=0)
    batched = KVCommEngine(llama, tokenizer, config=config)
    alone = KVCommEngine(llama, tokenizer, config=config.model_copy(update={"batched_decode": False}))
    at_once(batched, 3, greedy_together(3)), at_once(alone, 3, greedy_together(3))
    assert batched._calls.decoding.batcher.batched_steps > 0
    got, want = kept(batched), kept(alone)
    assert got.keys() == want.keys() and len(got) == 3  # each prompt plus its reply
    for ids, entry in got.items():
        for (k, v), (k2, v2) in zip(entry.kv.layers(), want[ids].kv.layers()):
            torch.testing.assert_close(k, k2, atol=tol(1e-4), rtol=1e-4)
            torch.testing.assert_close(v, v2, atol=tol(1e-4), rtol=1e-4)


def test_one_long_call_among_short_ones_steps_alone(tokenizer):
    from types import SimpleNamespace

    from kvcomm_agents.batched_decode import DecodeBatcher, _Step

    config = Qwen2Config(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16)

    def call(length):
        cache = DynamicCache(config=config)
        cache.update(torch.zeros(1, 1, length, 8), torch.zeros(1, 1, length, 8), 0)
        return SimpleNamespace(pre=SimpleNamespace(cache=cache))

    batcher = DecodeBatcher(SimpleNamespace(config=config), threading.RLock(), single=None)
    steps = [_Step(call(n), 0, n) for n in (400, 20, 30, 25)]
    assert [s.position for s in batcher._within_padding(steps)] == [20, 25, 30]
    assert batcher._within_padding(steps[:1]) == []  # one call: nothing to batch
    assert len(batcher._within_padding([_Step(call(n), 0, n) for n in (100, 60)])) == 2


def test_only_full_attention_caches_of_one_sequence_are_batched():
    plain = DynamicCache(config=Qwen2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16))
    assert not hf.batchable(plain)  # no KV yet
    for layer in range(2):
        plain.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), layer)
    assert hf.batchable(plain)
    sliding = DynamicCache(config=Qwen2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                              hidden_size=16, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=0))
    for layer in range(2):
        sliding.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), layer)
    assert not hf.batchable(sliding)


def test_left_padded_rows_come_back_as_they_went_in():
    config = Qwen2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16)
    caches = []
    for length in (3, 5):
        cache = DynamicCache(config=config)
        for layer in range(2):
            cache.update(torch.randn(1, 1, length, 8), torch.randn(1, 1, length, 8), layer)
        caches.append(cache)
    model = type("M", (), {"config": config})()
    batch, pads = hf.left_padded(model, caches)
    assert pads == [2, 0] and hf.layer_kv(batch, 0)[0].shape == (2, 1, 5, 8)
    assert bool((hf.layer_kv(batch, 1)[0][0, :, :2] == 0).all())
    for row, (cache, pad) in enumerate(zip(caches, pads)):
        before = [layer.keys.clone() for layer in cache.layers]
        hf.take_row(batch, row, pad, cache)
        for layer, want in zip(cache.layers, before):
            assert torch.equal(layer.keys, want)
