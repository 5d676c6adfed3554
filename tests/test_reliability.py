"""Service-grade guards: context length checked before compute, no duplicate KV, freeze blocks
that nest and interleave, engines that copy by reference and refuse to pickle clearly."""

import copy
import pickle
import threading

import pytest
import torch

from kvcomm_agents import BudgetWarning, InvalidRequestError, KVCommConfig, KVCommEngine
from kvcomm_agents.testing import tiny_llama

from .conftest import REPLY, replayed, solver_messages

pytestmark = pytest.mark.model


def test_prompt_plus_reply_beyond_the_positions_is_refused_before_compute(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    messages = solver_messages("You are solver one.")
    n = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    limit = llama.config.max_position_embeddings
    with pytest.raises(InvalidRequestError, match="max_new_tokens") as error:
        engine.chat(messages, agent="a", max_new_tokens=limit - n + 1)
    assert f"at most {limit - n}" in str(error.value)
    with pytest.raises(InvalidRequestError, match="reply_ids"):
        engine.replay(messages, agent="a", reply_ids=[5] * (limit - n + 1))
    assert len(engine.store) == 0  # nothing was computed or kept
    assert engine.chat(messages, agent="a", max_new_tokens=2).stats.prompt_tokens == n  # the edge fits
    long = [{"role": "user", "content": "x " * limit}]  # the prompt alone fills the positions
    with pytest.raises(InvalidRequestError, match="the prompt alone .* shorten the messages") as error:
        engine.chat(long, agent="a", max_new_tokens=1)
    assert "at most" not in str(error.value)  # no max_new_tokens would fit: none is suggested


def test_a_call_naming_no_reply_budget_generates_to_the_end_of_a_short_context(tokenizer, make_engine):
    """An unset ``max_new_tokens`` means 256 or fewer where the model's positions end first (as
    an OpenAI-style server reads an unset ``max_tokens``); a budget the call names that does
    not fit is still refused."""
    messages = solver_messages("You are solver one.")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")["input_ids"]
    n, room = prompt.shape[1], 12
    model = tiny_llama(tokenizer, seed=0, max_position_embeddings=prompt.shape[1] + room).to(dtype=torch.float32)
    engine = make_engine(model)
    result = engine.chat(messages, agent="a")
    plain = model.generate(prompt, max_new_tokens=room, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, n:]
    assert result.token_ids == plain.tolist()  # token for token what transformers generates up to the limit
    assert result.finish_reason == ("stop" if plain[-1] == tokenizer.eos_token_id else "length")
    assert len(result.token_ids) <= room
    with pytest.raises(InvalidRequestError, match=f"lower max_new_tokens to at most {room}"):
        engine.chat(messages, agent="a", max_new_tokens=256)


@pytest.mark.parametrize("reuse", [0, "false", "no"])
def test_reuse_that_is_not_a_bool_is_refused(llama, make_engine, reuse):
    """``reuse="false"`` is truthy: taken as given it would keep reuse on."""
    with pytest.raises(InvalidRequestError, match="reuse must be True, False or None"):
        make_engine(llama).chat(solver_messages("You are a judge."), agent="judge", reuse=reuse, max_new_tokens=1)


def test_identical_calls_store_each_text_once(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    refs = {replayed(engine, solver_messages("You are solver one."), "s1").segment for _ in range(5)}
    assert len(refs) == 1  # the same reply, same ids: one segment
    texts = [segment.text for segment in engine.store._entries.values() if hasattr(segment, "text")]
    assert sorted(texts) == sorted(set(texts)) and len(texts) == 2  # the question and the reply


def test_the_same_reply_of_another_agent_is_its_own_segment(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    first = replayed(engine, solver_messages("You are solver one."), "s1").segment
    second = replayed(engine, solver_messages("You are solver one."), "s2").segment
    assert first.id != second.id and first.kind != second.kind and first.text_hash == second.text_hash


def test_interleaved_freeze_blocks_never_leave_the_pools_frozen(llama, tokenizer):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(experimental={"min_anchors": 1}))
    first, second = engine.freeze_anchors(), engine.freeze_anchors()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # ends before the block it encloses
    assert engine.anchors.frozen and engine.own_texts.frozen
    second.__exit__(None, None, None)
    assert not engine.anchors.frozen and not engine.own_texts.frozen
    barrier = threading.Barrier(4)

    def hold():
        with engine.freeze_anchors():
            barrier.wait()

    threads = [threading.Thread(target=hold) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not engine.anchors.frozen
    replayed(engine, solver_messages("You are solver one."), "s1")
    replayed(engine, solver_messages("You are solver two.", REPLY), "s2")
    assert engine.anchors.nbytes() > 0  # learning resumed


def test_an_engine_copies_by_reference_and_refuses_to_pickle(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    holder = {"engine": engine, "options": [1, 2]}
    copied = copy.deepcopy(holder)
    assert copied["engine"] is engine and copied["options"] is not holder["options"]
    assert copy.copy(engine) is engine
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(engine)
    assert engine.chat(solver_messages("You are solver one."), agent="a", max_new_tokens=2).token_ids


def test_default_budgets_follow_the_documented_rule(monkeypatch):
    from kvcomm_agents import budgets

    monkeypatch.setattr(budgets, "available_bytes", lambda device: 10 * 1024**3)
    assert budgets.default_budgets(torch.device("cpu")) == (2 * 1024**3, 1024**3)
    monkeypatch.setattr(budgets, "available_bytes", lambda device: 1024)
    assert budgets.default_budgets(torch.device("cpu")) == (budgets.FLOOR, budgets.FLOOR)
    monkeypatch.setattr(budgets, "available_bytes", lambda device: None)
    assert budgets.default_budgets(torch.device("cpu")) == budgets.FALLBACK


def test_engine_budgets_default_to_the_devices_free_memory(llama, tokenizer):
    from kvcomm_agents.budgets import available_bytes

    engine = KVCommEngine(llama, tokenizer)
    free = available_bytes(torch.device("cpu"))
    assert 0.1 * free < engine.store.max_bytes <= 0.3 * free  # read twice: free memory moves a little
    assert engine.store.max_bytes > engine.anchors.max_bytes > 0


def test_a_budget_too_small_for_one_entry_warns_instead_of_failing_silently(llama, tokenizer):
    small_store = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="rerotate", store_max_bytes=1000))
    with pytest.warns(BudgetWarning, match="store_max_bytes"):
        replayed(small_store, solver_messages("You are solver one."), "s1")
    small_pools = KVCommEngine(llama, tokenizer, config=KVCommConfig(anchor_max_bytes=1000,
                                                                      experimental={"min_anchors": 1}))
    replayed(small_pools, solver_messages("You are solver one."), "s1")
    with pytest.warns(BudgetWarning, match="anchor_max_bytes"):
        replayed(small_pools, solver_messages("You are solver two.", REPLY), "s2")
