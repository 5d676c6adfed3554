"""``engine.replay``: teacher forcing a known reply, for evaluation (KL, greedy agreement)."""

import pytest
import torch

from kvcomm_agents import InvalidRequestError, Replay
from kvcomm_agents.evaluation import greedy_prefix, trim_at_eos

from .conftest import solver_messages


def test_trim_at_eos_keeps_the_first_end_of_sequence():
    assert trim_at_eos([5, 6, 0, 7, 0], {0}) == [5, 6, 0]
    assert trim_at_eos([5, 6], {0}) == [5, 6]
    assert trim_at_eos([0], {0, 9}) == [0]


def test_greedy_prefix_counts_leading_agreement():
    logits = torch.zeros(4, 10)
    logits[torch.arange(4), torch.tensor([3, 1, 4, 1])] = 1.0  # greedy would say 3 1 4 1
    assert greedy_prefix(logits, [3, 1, 4, 1]) == 4
    assert greedy_prefix(logits, [3, 1, 5, 1]) == 2  # agreement after a miss does not count
    assert greedy_prefix(logits, [0, 1, 4, 1]) == 0


def test_replay_reports_greedy_agreement_and_the_logits_of_a_plain_forward(llama, tokenizer, make_engine):
    engine = make_engine(llama, method="dense")
    messages = solver_messages("You are solver one.")
    free = engine.chat(messages, agent="s1", max_new_tokens=10)
    assert free.finish_reason == "length"
    same = engine.replay(messages, agent="s1", reply_ids=free.token_ids)
    assert isinstance(same, Replay) and same.result.finish_reason == "forced"
    assert same.result.token_ids == free.token_ids and same.result.text == free.text and same.greedy_prefix == 10
    assert same.logits.shape == (10, len(tokenizer)) and same.logits.device.type == "cpu"
    torch.testing.assert_close(same.first_token_logits, same.logits[0], atol=0, rtol=0)
    # oracle: one plain forward over prompt + reply
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    ids = torch.tensor([list(prompt) + free.token_ids[:-1]], device=llama.device)
    with torch.inference_mode():
        expected = llama(input_ids=ids).logits[0, len(prompt) - 1 :].float().cpu()
    torch.testing.assert_close(same.logits, expected, atol=1e-4, rtol=0)
    altered = free.token_ids[:4] + [(free.token_ids[4] + 1) % 300] + free.token_ids[5:]
    assert engine.replay(messages, agent="s1", reply_ids=altered).greedy_prefix == 4
    stats = same.result.stats
    assert stats.generated_tokens == 10 and stats.reused_tokens + stats.computed_tokens == stats.prompt_tokens


def test_replay_stops_at_the_first_end_of_sequence(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    ids = tokenizer("The answer is 72.")["input_ids"]
    out = engine.replay(solver_messages("You are solver one."), agent="s1",
                        reply_ids=ids + [tokenizer.eos_token_id] + ids)
    assert out.result.token_ids == ids + [tokenizer.eos_token_id] and out.logits.shape[0] == len(ids) + 1
    assert out.result.text == "The answer is 72."


@pytest.mark.parametrize("reply_ids", [[], "abc", [1, -1], [10**6], [1.0], [True]])
def test_bad_reply_ids_are_request_errors(llama, make_engine, reply_ids):
    engine = make_engine(llama)
    with pytest.raises(InvalidRequestError, match="reply_ids"):
        engine.replay(solver_messages("You are solver one."), agent="s1", reply_ids=reply_ids)
    assert len(engine.store) == 0


def test_replayed_reply_is_cached_as_decoding_would_cache_it(llama, tokenizer, make_engine):
    """Replayed ids are processed in one forward: the reply segment's KV matches free decoding's."""
    messages = solver_messages("You are solver one.")
    free_engine, forced_engine = make_engine(llama), make_engine(llama)
    free = free_engine.chat(messages, agent="s1", max_new_tokens=12)
    again = forced_engine.replay(messages, agent="s1", reply_ids=free.token_ids).result
    a, b = free_engine.store.get(free.segment.id), forced_engine.store.get(again.segment.id)
    assert a.token_ids == b.token_ids and again.text == free.text
    for layer in range(a.kv.num_layers):
        (ka, va), (kb, vb) = a.kv.layer(layer), b.kv.layer(layer)
        torch.testing.assert_close(ka, kb, atol=1e-5, rtol=0)
        torch.testing.assert_close(va, vb, atol=1e-5, rtol=0)
    assert free_engine.store.stats().prefixes == forced_engine.store.stats().prefixes == 1
