"""Decode KV written in place (kvcomm_agents.engines.growing_cache): a layer holds what a
concatenating one holds through steps and cuts, never writes into KV it was handed, and engines
decode the same replies with it on or off (alone, drafted, batched)."""

import pytest
import torch
from transformers import Qwen2Config
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.engines.growing_cache import MIN_ROOM, GrowingLayer, make_growing

from ..batching import at_once, greedy, greedy_together

pytestmark = pytest.mark.model


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 8, generator=generator), torch.randn(2, 3, n, 8, generator=generator)


def test_a_growing_layer_holds_what_a_concatenating_one_holds_through_steps_and_cuts():
    plain, growing = DynamicLayer(), make_growing(DynamicCache(config=Qwen2Config(num_hidden_layers=1))).layers[0]
    assert type(growing) is GrowingLayer
    buffers = set()
    for seed, (n, cut) in enumerate([(40, 0), (1, 0), (3, 2), (1, 0), (5, 4), (1, 0)] + [(1, 0)] * 90):
        keys, values = _kv(n, seed)
        expected, got = plain.update(keys, values), growing.update(keys, values)
        assert all(torch.equal(e, g) for e, g in zip(expected, got))
        buffers.add(growing._key_buffer.data_ptr())
        if cut:  # a refused draft: the next step writes over the dropped slots
            for layer in (plain, growing):
                layer.keys, layer.values = layer.keys[:, :, :-cut], layer.values[:, :, :-cut]
    assert growing.keys.shape == plain.keys.shape and torch.equal(growing.values, plain.values)
    assert growing.keys.data_ptr() == growing._key_buffer.data_ptr()  # a view, not a copy
    assert len(buffers) == 2  # 40 ids + 64 of room, then one reallocation over 104 slots


def test_kv_it_was_handed_is_copied_once_and_never_written():
    keys, values = _kv(20, 0)
    stored_keys, stored_values = keys.clone(), values.clone()
    cache = make_growing(DynamicCache(config=Qwen2Config(num_hidden_layers=1)))
    layer = cache.layers[0]
    layer.update(*_kv(4, 2))
    layer.keys, layer.values = keys[:, :, :15], values[:, :, :15]  # handed views (a stored block's), cut
    out_keys, _ = layer.update(*_kv(1, 1))
    assert torch.equal(keys, stored_keys) and torch.equal(values, stored_values)
    assert torch.equal(out_keys[:, :, :15], stored_keys[:, :, :15]) and out_keys.shape[-2] == 16
    assert layer._key_buffer.shape[-2] == 16 + MIN_ROOM


def test_kv_held_from_outside_lets_the_buffers_go():
    batch = make_growing(DynamicCache(config=Qwen2Config(num_hidden_layers=1)))
    batch.layers[0].update(*_kv(6, 0))
    own = make_growing(DynamicCache(config=Qwen2Config(num_hidden_layers=1)))
    own.layers[0].update(*_kv(6, 1))
    assert own.layers[0]._key_buffer is not None
    hf.take_row(batch, 1, 2, own)  # a row back from a batch: a copy the layer does not own
    layer = own.layers[0]
    assert layer._key_buffer is None and layer._value_buffer is None
    assert torch.equal(layer.keys, batch.layers[0].keys[1:2, :, 2:])
    hf.keep_slots(batch, torch.tensor([0, 3]))
    assert batch.layers[0]._key_buffer is None and batch.layers[0].keys.shape[-2] == 2
    grown = own.layers[0]
    grown.update(*(t[1:2, :, :1].clone() for t in _kv(1, 2)))  # a step: a buffer of its own again
    assert grown._key_buffer is not None
    grown.offload()  # to the CPU: the buffer the held KV was a view of is let go
    assert grown._key_buffer is None and grown._value_buffer is None and grown.keys.shape[-2] == 5


def test_kv_of_other_rows_or_dtype_is_refused_as_a_concatenation_refuses_it():
    layer = make_growing(DynamicCache(config=Qwen2Config(num_hidden_layers=1))).layers[0]
    keys, values = _kv(5, 0)
    layer.update(keys, values)
    one_row = (keys[:1, :, :1].clone(), values[:1, :, :1].clone())
    with pytest.raises(RuntimeError):  # torch.cat's error, never one row broadcast over two
        layer.update(*one_row)
    assert torch.equal(layer.keys, keys)
    out_keys, _ = layer.update(*(t[:, :, :1].double() for t in _kv(1, 1)))  # what cat gives: promoted
    assert out_keys.dtype == torch.float64 and out_keys.shape[-2] == 6 and layer._key_buffer is None


def test_only_plain_full_attention_layers_grow():
    config = Qwen2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                         use_sliding_window=True, sliding_window=4, max_window_layers=0)
    sliding = make_growing(DynamicCache(config=config))
    assert all(type(layer) is not GrowingLayer for layer in sliding.layers)
    plain = make_growing(DynamicCache(config=Qwen2Config(num_hidden_layers=2)))
    for layer in range(2):
        plain.update(*(t[:1] for t in _kv(3, layer)), layer)  # one sequence
    assert hf.batchable(plain)  # a growing cache still steps in a batch


def _engines(model, tokenizer, **settings):
    return [KVCommEngine(model, tokenizer, config=KVCommConfig(kv_in_place=in_place, **settings))
            for in_place in (False, True)]


def test_engines_decode_the_same_replies_with_kv_in_place_or_concatenated(model, tokenizer):
    # steps alone, then drafted: draft lengths fixed (lengths from measured forward times would
    # differ between the two engines with the machine's load, and with them the ids kept)
    for settings in ({"draft_tokens": 0, "method": "dense"},
                     {"draft_tokens": 8, "experimental": {"measured_draft_lengths": False}}):
        concatenated, in_place = _engines(model, tokenizer, **settings)
        drafted = accepted = 0
        for k in range(4):
            a, b = greedy(concatenated, k), greedy(in_place, k)
            assert a.token_ids == b.token_ids and len(b.token_ids) == 24
            assert a.stats.accepted_tokens == b.stats.accepted_tokens
            drafted, accepted = drafted + b.stats.drafted_tokens, accepted + b.stats.accepted_tokens
    assert drafted > accepted > 0  # drafts were kept, and refused ones cut back
    assert KVCommConfig().kv_in_place and not KVCommConfig.plain_transformers().kv_in_place


def test_batched_steps_with_kv_in_place_answer_as_concatenated(llama, tokenizer):
    concatenated, in_place = _engines(llama, tokenizer, method="dense", draft_tokens=0)
    expected = {k: greedy(concatenated, k).token_ids for k in range(3)}
    out = at_once(in_place, 3, greedy_together(3))
    assert in_place._calls.decoding.batcher.batched_steps > 0  # the steps did run together
    assert {k: result.token_ids for k, (result, _) in out.items()} == expected
