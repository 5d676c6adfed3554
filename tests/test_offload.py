"""A model accelerate offloads (``device_map`` with CPU or disk offload, ``cpu_offload``) keeps
its weights on the meta device between forwards: it is served as the same model held in memory
would be (its replies, its reuse), and the weights it offloaded are its identity."""

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from accelerate import cpu_offload
from transformers import AutoModelForCausalLM

from kvcomm_agents.identity import weights_digest
from kvcomm_agents.testing import tiny_llama

pytestmark = pytest.mark.model

DOCUMENT = "The report says the river rose two meters overnight and the bridge closed at dawn. " * 4


def _exchange(engine) -> tuple[list[list[int]], int]:
    """A reader, then a critic whose prompt repeats the document and the reader's reply: both
    replies' ids and what the critic reused."""
    task = DOCUMENT + "Summarise the report in one line."
    read = engine.chat([{"role": "system", "content": "You are the reader."}, {"role": "user", "content": task}],
                       agent="reader", max_new_tokens=12)
    check = engine.chat([{"role": "system", "content": "You are the critic, be brief."}, {"role": "user", "content": task},
                         {"role": "assistant", "content": read.text}, {"role": "user", "content": "Check it."}],
                        agent="critic", max_new_tokens=12)
    return [read.token_ids, check.token_ids], check.stats.reused_tokens


def test_a_model_offloaded_to_cpu_and_disk_is_served_as_in_memory(tokenizer, make_engine, tmp_path):
    in_memory = tiny_llama(tokenizer, seed=0)
    in_memory.save_pretrained(tmp_path / "model")
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
                 "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=placement, offload_folder=tmp_path / "offload",
                                                     attn_implementation="sdpa", dtype=torch.float32)
    assert offloaded.model.layers[1].mlp.up_proj.weight.device.type == "meta"  # kept on disk between forwards
    replies, reused = _exchange(make_engine(offloaded))
    assert (replies, reused) == _exchange(make_engine(in_memory)) and reused > 0
    assert weights_digest(offloaded) == weights_digest(in_memory)  # read where accelerate keeps them


def test_a_change_to_offloaded_weights_is_noticed_before_the_next_call(tokenizer, make_engine):
    model = tiny_llama(tokenizer, seed=0)
    changed = copy.deepcopy(model)
    cpu_offload(model, execution_device=torch.device("cpu"))
    engine = make_engine(model)
    _exchange(engine)
    before = engine.fingerprint
    with torch.no_grad():  # a fine-tune step written into the offloaded copy, and the same one in memory
        model.model.layers[1].mlp.down_proj._hf_hook.weights_map["weight"][3, 5] += 1e-2
        changed.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-2
    assert engine.fingerprint != before
    assert weights_digest(model) == weights_digest(changed)


def test_weights_offloaded_below_the_top_module_are_read_by_their_hooks_keys(tokenizer):
    """``cpu_offload(model.model)`` keys its map from the decoder, not the whole model: two
    models differing only there must not share a digest."""
    first, second = tiny_llama(tokenizer, seed=0), tiny_llama(tokenizer, seed=1)
    second.lm_head.load_state_dict(first.lm_head.state_dict())
    for model in (first, second):
        cpu_offload(model.model, execution_device=torch.device("cpu"))
    assert weights_digest(first) != weights_digest(second)


def test_engines_sharing_an_offloaded_model_take_turns(tokenizer, make_engine):
    """accelerate loads offloaded weights into the modules for each forward: two engines' calls
    at once would find each other's weights half moved, so they share one lock."""
    model = tiny_llama(tokenizer, seed=0)
    expected = _exchange(make_engine(copy.deepcopy(model)))
    cpu_offload(model, execution_device=torch.device("cpu"))
    engines = [make_engine(model) for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda engine: [_exchange(engine) for _ in range(3)], engines))
    assert all(result[0] == expected for result in results)
