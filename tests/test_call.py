"""``kvcomm_agents.call``: the steps of one agent call, run one by one on an engine's parts
(plan, prefill, decode or teacher forcing, keep, stats), with every forward charged to the call's
tally under its purpose."""

import time

import pytest
import torch

from kvcomm_agents.call import CallSteps
from kvcomm_agents.decoding import TextAccumulator
from kvcomm_agents.engines import hf
from kvcomm_agents.plan import CallPlan
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.results import ForwardedTokens

from .conftest import REPLY, forced, replayed, solver_messages

RECEIVER = solver_messages("You are solver two.", REPLY)  # the question and s1's reply, both stored


def steps_of(engine) -> CallSteps:
    """The engine's own call steps (``KVCommEngine._calls``, a private name: how the steps are
    built from an engine's parts is the engine's business)."""
    steps = engine._calls
    assert isinstance(steps, CallSteps)
    return steps


def with_reply(engine):
    """``engine`` once s1 answered the question with ``REPLY`` (both now stored)."""
    replayed(engine, solver_messages("You are solver one."), "s1")
    return engine


class Forwards:
    """Counts the model's forward calls."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


@pytest.fixture
def forwards(llama):
    meter = Forwards(llama)
    yield meter
    meter.handle.remove()


def tokens(prompt=0, decode=0, copies=0, audit=0) -> dict:
    return {"prompt": prompt, "decode": decode, "copies": copies, "audit": audit}


def drain(generator):
    """Run a generator to its end: ``(items yielded, value returned)``."""
    items = []
    while True:
        try:
            items.append(next(generator))
        except StopIteration as stop:
            return items, stop.value


def test_plan_says_why_a_call_is_dense(llama, tokenizer, make_engine):
    steps = steps_of(with_reply(make_engine(llama, dense_agents=frozenset({"judge"}))))
    layout = render_prompt(tokenizer, RECEIVER)
    n = layout.ids.numel()
    assert steps.plan(layout, "s2", None, 4).runs
    for agent, reuse in (("s2", False), ("judge", None)):  # the call or the agent opted out
        plan = steps.plan(layout, agent, reuse, 4)
        assert plan.dense_reason == "reuse_off" and not plan.runs
    steps.info.sliding_window = n + 4  # reuse while prompt and reply fit the window, not beyond
    assert steps.plan(layout, "s2", None, 4).runs
    too_long = steps.plan(layout, "s2", None, 5)
    assert too_long.dense_reason == "sliding_window" and not too_long.runs
    dense = steps_of(make_engine(llama, method="dense")).plan(layout, "s2", None, 4)
    assert dense.dense_reason == "reuse_off" and not dense.runs


def test_a_prepared_call_charges_its_computed_prompt_tokens_and_runs_the_hook_on_reuse(llama, tokenizer,
                                                                                       make_engine):
    engine = with_reply(make_engine(llama))
    steps = steps_of(engine)
    layout = render_prompt(tokenizer, RECEIVER)
    n = layout.ids.numel()
    with steps.prepared(layout, RECEIVER, "s2", None, 1, time.perf_counter()) as call:
        reused = call.plan.reused_tokens
        assert call.plan.runs and 0 < reused < n
        assert call.tally.tokens == tokens(prompt=n - reused)  # the reused KV is not forwarded
        assert call.hook_s == 0.0 and min(call.plan_s, call.align_s, call.prefill_s) >= 0.0
        assert hf.num_cached(call.pre.cache) == n and sorted(call.pre.slot_positions.tolist()) == list(range(n))
    hooked = []

    def dense_instead(engine_, plan):
        hooked.append(plan)
        return CallPlan(plan.prompt_ids, dense_reason="hooked")

    engine.plan_hook = dense_instead  # read per call
    with steps.prepared(layout, RECEIVER, "s2", None, 1, time.perf_counter()) as call:
        assert len(hooked) == 1 and hooked[0].runs
        assert call.plan.dense_reason == "hooked" and call.tally.tokens == tokens(prompt=n)  # the hook's plan ran
        assert call.hook_s > 0.0
    with steps.prepared(layout, RECEIVER, "s2", False, 1, time.perf_counter()) as call:  # nothing reused: no hook
        assert len(hooked) == 1 and call.plan.dense_reason == "reuse_off"


def test_force_and_force_stepwise_give_the_teacher_forced_logits(llama, tokenizer, make_engine, forwards):
    """``force``: the reply in one forward; ``force_stepwise``: one decode step per reply token
    (as a generated reply costs). Both give the logits a dense pass over prompt and reply gives
    for each reply token, and charge the reply's fed tokens as decode."""
    steps = steps_of(make_engine(llama, draft_tokens=0))  # drafted steps: tests/test_drafting.py
    layout = render_prompt(tokenizer, RECEIVER)
    n, ids = layout.ids.numel(), forced(tokenizer)
    with torch.inference_mode():
        whole = torch.cat([layout.ids, torch.tensor(ids[:-1])])[None]
        expected = llama(whole).logits[0, n - 1:].float()
    for force, calls in ((steps.decoding.force, 1), (steps.decoding.force_stepwise, len(ids) - 1)):
        with steps.prepared(layout, RECEIVER, "s2", False, len(ids), time.perf_counter()) as call:
            before = forwards.calls
            logits = force(call, ids)
            assert forwards.calls - before == calls
            assert call.tally.tokens == tokens(prompt=n, decode=len(ids) - 1)
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_decode_feeds_every_token_but_the_last_and_says_why_it_stopped(llama, tokenizer, make_engine):
    steps = steps_of(with_reply(make_engine(llama)))
    eos = tokenizer.eos_token_id
    assert eos in steps.info.eos_ids
    layout = render_prompt(tokenizer, RECEIVER)
    seen = []

    def greedy_no_eos(logits):
        seen.append(logits.clone())
        logits = logits.clone()
        logits[list(steps.info.eos_ids)] = float("-inf")
        return int(logits.argmax())

    with steps.prepared(layout, RECEIVER, "s2", None, 6, time.perf_counter()) as call:
        text = TextAccumulator(tokenizer)
        pieces, finish = drain(steps.decoding.decode(call, greedy_no_eos(call.pre.logits), greedy_no_eos, text, 6))
        assert finish == "length" and len(text.ids) == 6
        assert call.tally.tokens["decode"] == 5  # the last id is never fed
    assert "".join(pieces) + text.flush() == tokenizer.decode(text.ids)
    with steps.prepared(layout, RECEIVER, "s2", None, 6, time.perf_counter()) as call:  # each id fed at its position
        torch.testing.assert_close(steps.decoding.force(call, text.ids), torch.stack(seen), atol=1e-4, rtol=1e-4)
    picks = iter([5, 6, eos, 7])
    with steps.prepared(layout, RECEIVER, "s2", None, 6, time.perf_counter()) as call:
        text = TextAccumulator(tokenizer)
        _, finish = drain(steps.decoding.decode(call, next(picks), lambda logits: next(picks), text, 6))
        assert (finish, text.ids, call.tally.tokens["decode"]) == ("stop", [5, 6, eos], 2)
    stopped = TextAccumulator(tokenizer, stop=["answer"])
    for token in tokenizer("The answer is", add_special_tokens=False)["input_ids"]:
        stopped.push(token)
    assert stopped.stopped and steps.decoding.finish_reason(stopped.ids[-1], stopped, 100) == "stop_string"
    assert steps.decoding.finish_reason(eos, stopped, 100) == "stop"  # an end-of-sequence id comes first
    assert steps.decoding.finish_reason(5, TextAccumulator(tokenizer), 1) is None


def test_keep_stores_the_reply_charges_the_audit_and_the_result_reports_the_tally(llama, tokenizer, make_engine):
    engine = with_reply(make_engine(llama, audit_every=1))
    steps = steps_of(engine)
    layout = render_prompt(tokenizer, RECEIVER)
    n, ids = layout.ids.numel(), forced(tokenizer)
    results = {}
    for reuse in (None, False):
        with steps.prepared(layout, RECEIVER, "s2", reuse, len(ids), time.perf_counter()) as call:
            steps.decoding.force(call, ids)
            text = TextAccumulator(tokenizer)
            for token in ids:
                text.push(token)
            text.flush()
            segment, kl = steps.keep(call, RECEIVER, "s2", text)
        results[reuse] = steps.result(call, "s2", reuse, text, "forced", segment, 0.0, kl), call
    reused, call = results[None]
    stats = reused.stats
    assert reused.segment.kind == ("s2", "assistant")
    assert engine.store.get(reused.segment.id).token_ids == tuple(ids[:-1])  # eos has no KV
    assert stats.mode == "reuse" and stats.audit_kl is not None and stats.audit_kl > 0.0
    assert call.tally.tokens == tokens(prompt=n - stats.reused_tokens, decode=len(ids) - 1, audit=n)
    assert stats.forwarded == ForwardedTokens(**call.tally.tokens)
    assert (stats.prompt_tokens, stats.computed_tokens, stats.generated_tokens) == (
        n, n - stats.reused_tokens, len(ids))
    dense, call = results[False]  # opted out: nothing reused, nothing audited
    assert dense.stats.mode == "dense" and dense.stats.opted_out and dense.stats.audit_kl is None
    assert call.tally.tokens == tokens(prompt=n, decode=len(ids) - 1)
    assert dense.segment == reused.segment  # the same reply of the same agent: stored once


def test_capture_call_keeps_nothing_when_the_cache_lacks_the_reply_kv(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    steps = steps_of(engine)
    messages = solver_messages("You are solver one.")
    layout = render_prompt(tokenizer, messages)
    ids = forced(tokenizer)
    with steps.prepared(layout, messages, "s1", None, len(ids), time.perf_counter()) as call:
        assert steps.capture_call(call, messages, "s1", ids, REPLY) is None  # the reply was never fed
        assert engine.store.stats().segments == 0
        steps.decoding.force(call, ids)
        ref = steps.capture_call(call, messages, "s1", ids, REPLY)
    assert ref.kind == ("s1", "assistant") and ref.num_tokens == len(ids) - 1
    assert {s.ref.kind for s in (engine.store.get(ref.id), engine.store.find_text(messages[1]["content"],
                                                                                    engine.fingerprint))} == {
        ("s1", "assistant"), ("user", None)}
