"""A checkpoint's output matrix may have more rows than its tokenizer has tokens (Qwen2.5 pads
151,665 tokens to 152,064 rows; the benchmark's random full-size models pair a 128,256-row Llama
with the 400-token test tokenizer). Generation must never pick a padding row: its id would not
decode, and a later replay of the reply would be refused. The logits the engine returns keep
every row, so that KL stays over the model's whole output."""

from __future__ import annotations

import pytest
import torch

from kvcomm_agents import KVCommEngine
from kvcomm_agents.errors import InvalidRequestError
from kvcomm_agents.decoding import TokenSampler
from kvcomm_agents.testing import tiny_llama, tiny_qwen2

from .conftest import DEVICE, DTYPE

PADDING = 24


@pytest.fixture(scope="module", params=[tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def padded(request, tokenizer):
    """A tiny model of each family with ``PADDING`` rows past the tokenizer, made to win every argmax."""
    model = request.param(tokenizer, seed=0, vocab_size=len(tokenizer) + PADDING).to(device=DEVICE, dtype=DTYPE)
    size = len(tokenizer)

    def favour_padding(module, inputs, output):
        output[..., size:] += 1e4
        return output

    handle = model.lm_head.register_forward_hook(favour_padding)
    yield model
    handle.remove()


def test_a_sampler_never_picks_an_id_at_or_past_the_vocabulary():
    logits = torch.zeros(10)
    logits[8] = 5.0
    assert TokenSampler(vocab_size=8)(logits) < 8
    sampler = TokenSampler(temperature=1.0, seed=0, vocab_size=8)
    assert all(sampler(logits) < 8 for _ in range(50))
    assert TokenSampler()(logits) == 8  # no limit: every row
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InvalidRequestError):
            TokenSampler(vocab_size=bad)


@pytest.mark.parametrize("reuse", [False, True])
def test_generation_on_a_padded_output_matrix_stays_inside_the_tokenizer(padded, tokenizer, reuse):
    engine = KVCommEngine(padded, tokenizer)
    messages = [{"role": "user", "content": "Count the apples in the basket."}]
    chat = engine.chat(messages, agent="solver", max_new_tokens=6, reuse=reuse)
    greedy = engine.greedy(messages, agent="solver", max_new_tokens=6, reuse=reuse)
    assert chat.token_ids and max(chat.token_ids) < len(tokenizer)
    assert greedy.result.token_ids == chat.token_ids
    assert greedy.logits.shape[-1] == len(tokenizer) + PADDING  # the model's whole output
    # the reply replays: every id is one the tokenizer knows
    replay = engine.replay(messages, agent="solver", reply_ids=chat.token_ids, reuse=reuse)
    assert replay.result.token_ids == chat.token_ids
    assert replay.greedy_prefix == len(chat.token_ids)
