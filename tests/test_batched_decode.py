"""Calls answering at once step their decode in one forward (kvcomm_agents/batched_decode.py):
the same replies and logits as calls stepping alone, the same KV kept, paused and closed streams
leave the batch, and an error reaches every call of the batch."""

import threading

import pytest
import torch
from transformers import DynamicCache, Qwen2Config

from kvcomm_agents import ChatResult, KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.kv.store import PrefixEntry

from .conftest import tol

PAGE = ("The library opens at nine and closes at five on weekdays. On Saturdays it opens at ten and "
        "closes at two. It is closed on Sundays and on public holidays. Members may borrow six books.")
ROLES = ("Analyst", "Reviewer", "Tester", "Planner")


def branch(k: int) -> list[dict]:
    """Prompts that share no prefix beyond the chat template's first ids (the plans do not
    depend on which sibling runs first)."""
    return [{"role": "system", "content": f"{ROLES[k]} {k}: answer from the page."},
            {"role": "user", "content": f"Page:\n{PAGE}\n\nQuestion {k}: what {'and why ' * k}?"}]


def at_once(engine, calls: int, run) -> dict:
    """``run(engine, k)`` for each of ``calls`` branches in a thread of its own, started together."""
    out, errors = {}, {}
    start = threading.Barrier(calls)

    def go(k):
        start.wait()
        try:
            out[k] = run(engine, k)
        except Exception as error:  # noqa: BLE001 - collected for the test to inspect
            errors[k] = error

    threads = [threading.Thread(target=go, args=(k,)) for k in range(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors or out


def longest(engine):
    """Greedy, never an end-of-sequence id: replies run to ``max_new_tokens`` (the tiny random
    models often end after a token or two)."""
    ends = sorted(engine.info.eos_ids)

    def pick(logits):
        logits = logits[: len(engine.tokenizer)].clone()
        logits[ends] = float("-inf")
        return int(torch.argmax(logits))

    return pick


def generate(engine, k, pick=None, tokens: int = 24):
    """Branch ``k``'s call as :meth:`KVCommEngine.stream` runs it, with the token picker given."""
    return engine._generate(branch(k), f"a{k}", tokens, pick or longest(engine), None, None, None)


def greedy(engine, k):
    return next(i for i in generate(engine, k) if isinstance(i, ChatResult))


def waiting(prefilled: threading.Barrier, engine):
    """:func:`longest`'s picker that waits at ``prefilled`` before the first token (every call
    prefilled before any steps, so they decode at once whatever the thread scheduler does: a
    tiny model's steps are shorter than a thread's time slice); ``pick.rows``: the logits seen."""
    choose, rows = longest(engine), []

    def pick(logits):
        if not rows:
            prefilled.wait()
        rows.append(logits.detach().float().cpu())
        return choose(logits)

    pick.rows = rows
    return pick


def greedy_together(calls: int):
    """Greedy calls decoding at once (:func:`waiting`): ``(ChatResult, [n, vocab] logits)`` each."""
    prefilled = threading.Barrier(calls)

    def run(engine, k):
        pick = waiting(prefilled, engine)
        return next(i for i in generate(engine, k, pick) if isinstance(i, ChatResult)), torch.stack(pick.rows)

    return run


@pytest.mark.parametrize("calls", [2, 4])
def test_calls_decoding_at_once_step_in_one_forward_and_answer_as_each_alone(model, tokenizer, calls):
    batched = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    got, want = at_once(batched, calls, greedy_together(calls)), at_once(alone, calls, greedy_together(calls))
    batcher = batched._calls.batcher
    assert batcher.batched_steps > 0 and batcher.rows >= 2 * batcher.batched_steps  # forwards of several calls ran
    assert alone._calls.batcher is None
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
    config = KVCommConfig(method="exact_prefix", audit_every=0)
    batched = KVCommEngine(llama, tokenizer, config=config)
    alone = KVCommEngine(llama, tokenizer, config=config.model_copy(update={"batched_decode": False}))
    at_once(batched, 3, greedy_together(3)), at_once(alone, 3, greedy_together(3))
    assert batched._calls.batcher.batched_steps > 0
    got, want = kept(batched), kept(alone)
    assert got.keys() == want.keys() and len(got) == 3  # each prompt plus its reply
    for ids, entry in got.items():
        for (k, v), (k2, v2) in zip(entry.kv.layers(), want[ids].kv.layers()):
            torch.testing.assert_close(k, k2, atol=tol(1e-4), rtol=1e-4)
            torch.testing.assert_close(v, v2, atol=tol(1e-4), rtol=1e-4)


def test_a_paused_stream_holds_nobody_back_and_answers_as_alone(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    stepped, resume, out = threading.Event(), threading.Event(), {}

    def paused():  # steps, then its consumer stops pulling until told
        stream = generate(batched, 0)
        pieces = [next(stream)]
        while not batched._calls.batcher._active:
            pieces.append(next(stream))
        stepped.set()
        resume.wait(60)
        out[0] = list(stream)[-1]

    thread = threading.Thread(target=paused)
    thread.start()
    stepped.wait(60)
    other = greedy(batched, 1)  # waits one window for the paused call, then steps alone
    assert batched._calls.batcher.missed_windows == 1  # not waited for again
    resume.set()
    thread.join(60)
    assert other.token_ids == greedy(alone, 1).token_ids
    assert out[0].token_ids == greedy(alone, 0).token_ids and len(out[0].token_ids) == 24


def test_one_thread_interleaving_two_streams_never_waits_for_itself(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    first, second = generate(batched, 0), generate(batched, 1)
    ends = {}
    for a, b in zip(first, second):  # the other stream can only move when this thread pulls it
        for k, item in ((0, a), (1, b)):
            if isinstance(item, ChatResult):
                ends[k] = item
    assert batched._calls.batcher.missed_windows == 0
    assert all(ends[k].token_ids == greedy(alone, k).token_ids for k in ends)


def test_more_calls_than_rows_all_answer_as_alone(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    batched._calls.batcher.max_rows = 2
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    got = at_once(batched, 4, greedy_together(4))
    assert all(isinstance(got[k], tuple) for k in range(4))  # no call failed
    for k in range(4):
        assert got[k][0].token_ids == greedy(alone, k).token_ids
    assert batched._calls.batcher.rows <= 2 * batched._calls.batcher.batched_steps


def test_a_call_made_under_the_engine_lock_steps_alone_while_another_leads(llama, tokenizer):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    started, locked, out = threading.Event(), threading.Event(), {}
    choose = longest(engine)

    def pick(logits):  # after its prefill: waits until the main thread holds the engine lock
        if not started.is_set():
            started.set()
            locked.wait(20)
        return choose(logits)

    thread = threading.Thread(target=lambda: out.setdefault(0, greedy_with(engine, 0, pick)))
    thread.start()
    assert started.wait(20)
    with engine._lock:  # as a plan hook calling the engine would; the other call now leads and waits for it
        locked.set()
        nested = engine.chat(branch(1), agent="nested", max_new_tokens=6)
    thread.join(20)
    assert not thread.is_alive() and nested.stats.generated_tokens >= 1 and out[0].stats.generated_tokens == 24


def greedy_with(engine, k, pick, tokens: int = 24):
    return next(i for i in generate(engine, k, pick, tokens) if isinstance(i, ChatResult))


def test_a_stream_closed_mid_reply_leaves_the_batch(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    prefilled = threading.Barrier(3)

    def run(engine, k):
        stream = generate(engine, k, waiting(prefilled, engine))
        if k == 0:  # reads a few pieces, then drops the stream
            for _ in range(4):
                next(stream)
            stream.close()
            return None
        return next(i for i in stream if isinstance(i, ChatResult))

    got = at_once(batched, 3, run)
    assert batched._calls.batcher.batched_steps > 0
    for k in (1, 2):
        assert got[k].token_ids == greedy(alone, k).token_ids
    assert batched._calls.batcher._batch is None and not batched._calls.batcher._active


def test_a_batched_forward_that_fails_is_stepped_alone(llama, tokenizer, monkeypatch, caplog):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    forward, failed = hf.run_forward, []

    def failing(model, input_ids, *args, **kwargs):
        if input_ids.shape[0] > 1 and len(failed) < 2:
            failed.append(input_ids.shape[0])
            raise RuntimeError("out of memory")
        return forward(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(hf, "run_forward", failing)
    got = at_once(engine, 3, greedy_together(3))
    assert failed and "step alone" in caplog.text
    for k in range(3):
        assert got[k][0].token_ids == greedy(alone, k).token_ids
    assert engine._calls.batcher._batch is None and not engine._calls.batcher._active


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


def test_calls_joining_pausing_and_leaving_at_random_all_answer_as_alone(llama, tokenizer):
    """Six calls of random lengths, started at random moments, some pausing between pieces and
    one dropped mid-reply: none hangs, every finished reply is a lone call's."""
    import random
    import time

    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    plans = random.Random(0)
    shapes = [(k % 4, plans.randint(4, 24), plans.random() * 0.02, plans.random() < 0.3) for k in range(6)]
    results, errors = {}, []

    def run(k, branch_k, tokens, delay, pauses):
        try:
            time.sleep(delay)
            stream = batched._generate(branch(branch_k), f"a{k}", tokens, longest(batched), None, None, None)
            for i, item in enumerate(stream):
                if isinstance(item, ChatResult):
                    results[k] = item
                elif pauses:
                    time.sleep(0.015)  # longer than the window: the others step on without it
                if k == 5 and i == 3:
                    stream.close()
                    return
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k, *shape)) for k, shape in enumerate(shapes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors
    for k, (branch_k, tokens, _, _) in enumerate(shapes):
        if k == 5:
            continue
        want = next(i for i in generate(alone, branch_k, tokens=tokens) if isinstance(i, ChatResult))
        assert results[k].token_ids == want.token_ids
    assert batched._calls.batcher.batched_steps > 0
    assert batched._calls.batcher._batch is None and not batched._calls.batcher._active


def test_a_failed_write_back_or_pack_never_leaves_a_call_on_a_stale_cache(llama, tokenizer, monkeypatch):
    """A pack that fails: every call steps alone and answers as alone. A write-back that fails:
    the batch stays whole, so a call either answers as alone or raises, never a wrong reply."""
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    want = {k: greedy(alone, k).token_ids for k in range(3)}
    for helper in ("left_padded", "take_row"):
        engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
        real, failed = getattr(hf, helper), []

        def once(*args, real=real, failed=failed):
            if not failed:
                failed.append(True)
                raise RuntimeError("out of memory")
            return real(*args)

        monkeypatch.setattr(hf, helper, once)
        together, results = greedy_together(3), {}

        def run(engine, k, results=results, together=together):
            try:
                results[k] = together(engine, k)[0].token_ids
            except RuntimeError:
                results[k] = "raised"

        at_once(engine, 3, run)
        monkeypatch.setattr(hf, helper, real)
        assert failed, helper
        if helper == "left_padded":
            assert results == want
        else:
            assert all(results[k] in (want[k], "raised") for k in range(3))
        assert engine._calls.batcher._batch is None


def test_a_thread_interleaving_two_streams_is_not_waited_for_by_another_leader(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False))
    prefilled, ends = threading.Barrier(2), {}

    def zipped():  # one thread pulling two streams in turn
        first, second = generate(batched, 0, waiting(prefilled, batched)), generate(batched, 1)
        for a, b in zip(first, second):
            for k, item in ((0, a), (1, b)):
                if isinstance(item, ChatResult):
                    ends[k] = item

    thread = threading.Thread(target=zipped)
    thread.start()
    other = next(i for i in generate(batched, 2, waiting(prefilled, batched), tokens=48) if isinstance(i, ChatResult))
    thread.join(60)
    assert batched._calls.batcher.missed_windows <= 2  # the leader does not wait for the stream its thread cannot pull
    assert other.token_ids == greedy_with(alone, 2, longest(alone), tokens=48).token_ids
    assert all(ends[k].token_ids == greedy(alone, k).token_ids for k in ends)


def test_a_batch_of_calls_that_left_gives_its_memory_back_at_the_next_keep(llama, tokenizer):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    prefilled, arrived, abort = threading.Barrier(2), threading.Barrier(3), threading.Event()

    def dropped(k):
        choose, seen = waiting(prefilled, engine), []

        def pick(logits):  # both consumers give up right after the third batched step (of both)
            if engine._calls.batcher.batched_steps >= 3 and not seen:
                seen.append(True)
                arrived.wait(20)
                abort.wait(20)
                raise RuntimeError("consumer gone")
            return choose(logits)

        try:
            greedy_with(engine, k, pick)
        except RuntimeError:
            pass

    threads = [threading.Thread(target=dropped, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    arrived.wait(20)
    batcher = engine._calls.batcher
    assert batcher._batch is not None and len(batcher._batch.calls) == 2
    with engine._lock:  # their leave cannot take the lock: the rows stay in the batch
        abort.set()
        for t in threads:
            t.join(20)
    assert batcher._batch is not None and not batcher._active
    engine.chat(branch(3), agent="later", max_new_tokens=1)  # no decode step: only its keep
    assert batcher._batch is None
