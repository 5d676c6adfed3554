"""Batched decode under concurrency and failure (kvcomm_agents/batched_decode.py): paused,
interleaved, closed and abandoned streams, more calls than rows, calls under the engine lock,
random joins and leaves, and forwards, packs or write-backs that fail: nothing hangs, every
finished reply is a lone call's, nothing decodes on a stale cache."""

import threading
import time

import torch

from kvcomm_agents import ChatResult, KVCommConfig, KVCommEngine
from kvcomm_agents.batched_decode import DecodeBatcher
from kvcomm_agents.engines import hf

from .batching import at_once, branch, generate, greedy, greedy_together, greedy_with, longest, waiting


def test_a_paused_stream_holds_nobody_back_and_answers_as_alone(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
    stepped, resume, out = threading.Event(), threading.Event(), {}

    def paused():  # steps, then its consumer stops pulling until told
        stream = generate(batched, 0)
        pieces = [next(stream)]
        while not batched._calls.decoding.batcher._active:
            pieces.append(next(stream))
        stepped.set()
        resume.wait(60)
        out[0] = list(stream)[-1]

    thread = threading.Thread(target=paused)
    thread.start()
    stepped.wait(60)
    other = greedy(batched, 1)  # waits one window for the paused call, then steps alone
    assert batched._calls.decoding.batcher.missed_windows == 1  # not waited for again
    resume.set()
    thread.join(60)
    assert other.token_ids == greedy(alone, 1).token_ids
    assert out[0].token_ids == greedy(alone, 0).token_ids and len(out[0].token_ids) == 24


def test_one_thread_interleaving_two_streams_never_waits_for_itself(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
    first, second = generate(batched, 0), generate(batched, 1)
    ends = {}
    for a, b in zip(first, second):  # the other stream can only move when this thread pulls it
        for k, item in ((0, a), (1, b)):
            if isinstance(item, ChatResult):
                ends[k] = item
    assert batched._calls.decoding.batcher.missed_windows == 0
    assert all(ends[k].token_ids == greedy(alone, k).token_ids for k in ends)


def test_more_calls_than_rows_all_answer_as_alone(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    batched._calls.decoding.batcher.max_rows = 2
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
    got = at_once(batched, 4, greedy_together(4))
    assert all(isinstance(got[k], tuple) for k in range(4))  # no call failed
    for k in range(4):
        assert got[k][0].token_ids == greedy(alone, k).token_ids
    assert batched._calls.decoding.batcher.rows <= 2 * batched._calls.decoding.batcher.batched_steps


def test_a_call_made_under_the_engine_lock_steps_alone_while_another_leads(llama, tokenizer):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
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


def test_a_stream_closed_mid_reply_leaves_the_batch(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
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
    assert batched._calls.decoding.batcher.batched_steps > 0
    for k in (1, 2):
        assert got[k].token_ids == greedy(alone, k).token_ids
    assert batched._calls.decoding.batcher._batch is None and not batched._calls.decoding.batcher._active


def test_a_batched_forward_that_fails_is_stepped_alone(llama, tokenizer, monkeypatch, caplog):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
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
    assert engine._calls.decoding.batcher._batch is None and not engine._calls.decoding.batcher._active


def test_calls_joining_pausing_and_leaving_at_random_all_answer_as_alone(llama, tokenizer):
    """Six calls of random lengths, started at random moments, some pausing between pieces and
    one dropped mid-reply: none hangs, every finished reply is a lone call's."""
    import random
    import time

    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
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
    assert batched._calls.decoding.batcher.batched_steps > 0
    assert batched._calls.decoding.batcher._batch is None and not batched._calls.decoding.batcher._active


def test_a_failed_write_back_or_pack_never_leaves_a_call_on_a_stale_cache(llama, tokenizer, monkeypatch):
    """A pack that fails: every call steps alone and answers as alone. A write-back that fails:
    the batch stays whole, so a call either answers as alone or raises, never a wrong reply."""
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
    want = {k: greedy(alone, k).token_ids for k in range(3)}
    for helper in ("left_padded", "take_row"):
        engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
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
        assert engine._calls.decoding.batcher._batch is None


def test_a_thread_interleaving_two_streams_is_not_waited_for_by_another_leader(llama, tokenizer):
    batched = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    alone = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
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
    assert batched._calls.decoding.batcher.missed_windows <= 2  # the leader does not wait for the stream its thread cannot pull
    assert other.token_ids == greedy_with(alone, 2, longest(alone), tokens=48).token_ids
    assert all(ends[k].token_ids == greedy(alone, k).token_ids for k in ends)


def test_a_batch_of_calls_that_left_gives_its_memory_back_at_the_next_keep(llama, tokenizer):
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    prefilled, arrived, abort = threading.Barrier(2), threading.Barrier(3), threading.Event()

    def dropped(k):
        choose, seen = waiting(prefilled, engine), []

        def pick(logits):  # both consumers give up right after the third batched step (of both)
            if engine._calls.decoding.batcher.batched_steps >= 3 and not seen:
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
    batcher = engine._calls.decoding.batcher
    assert batcher._batch is not None and len(batcher._batch.calls) == 2
    with engine._lock:  # their leave cannot take the lock: the rows stay in the batch
        abort.set()
        for t in threads:
            t.join(20)
    assert batcher._batch is not None and not batcher._active
    engine.chat(branch(3), agent="later", max_new_tokens=1)  # no decode step: only its keep
    assert batcher._batch is None


def test_a_leader_does_not_wait_for_a_call_whose_thread_waits_for_its_lock():
    """A refused draft's cut takes the engine lock outside a step (``DecodeLoop._cut``): a
    sibling's leader holding that lock does not spend its window waiting for the cutting call's
    next step, which cannot come before the leader lets the lock go."""
    lock = threading.RLock()
    batcher = DecodeBatcher(None, lock, single=lambda call, token, position: torch.zeros(4), window_s=60.0)
    drafting, stepping = object(), object()
    assert batcher.if_alone(drafting, lambda: "alone") == "alone"  # decoding alone, still active
    out = {}
    leader = threading.Thread(target=lambda: out.setdefault("logits", batcher.step(stepping, 1, 0)), daemon=True)
    leader.start()

    def held_by_the_leader():
        if lock.acquire(blocking=False):
            lock.release()
            return False
        return True

    for _ in range(2000):  # the leader holds the lock and gathers, the drafting call missing
        if held_by_the_leader():
            break
        time.sleep(0.005)
    assert held_by_the_leader()
    with batcher.awaiting_lock(drafting):  # the drafting call's cut (60 s later without it)
        lock.acquire()
    lock.release()
    leader.join(20)
    assert not leader.is_alive() and out["logits"].shape == (4,) and batcher.missed_windows == 0


def test_a_drafts_cut_waits_for_the_lock_as_its_call(llama, tokenizer):
    """``DecodeLoop._cut`` registers the call with the batcher while it waits for the lock, and
    only while it waits."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    loop = engine._calls.decoding
    real, seen = loop.batcher.awaiting_lock, []

    @contextmanager
    def spy(call):
        with real(call):
            seen.append((call, dict(loop.batcher._awaiting)))
            yield
        seen.append(("after", dict(loop.batcher._awaiting), engine._lock._is_owned()))

    loop.batcher.awaiting_lock = spy
    cache = hf.new_cache(llama)
    with torch.inference_mode():
        hf.run_forward(llama, torch.tensor([[1, 2, 3, 4]], device=hf.input_device(llama)), cache)
    call = SimpleNamespace(pre=SimpleNamespace(cache=cache))
    loop._cut(call, 2)
    assert hf.num_cached(cache) == 2
    assert seen == [(call, {id(call): 1}), ("after", {}, True)]  # unregistered once the lock is held
    assert not engine._lock._is_owned()
