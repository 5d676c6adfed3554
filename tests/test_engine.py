"""The engine on tiny real models: dense equivalence, reuse, visible fallbacks, decoding options."""

import pytest
import torch

from kvcomm_agents import (
    ChatResult, InvalidMessagesError, InvalidRequestError, KVCommConfig, KVCommEngine,
    KVCommError, ReuseSummary,
)
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.testing import tiny_llama

from .conftest import QUESTION, REPLY, first_logits, forced, replayed, solver_messages
from .conftest import mechanics


def generate_text(model, tokenizer, messages, max_new_tokens):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")
    out = model.generate(**ids.to(model.device), max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    return new.tolist(), tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.exact
@pytest.mark.parametrize("how", ["engine", "call"])
def test_reuse_off_is_plain_generate(model, tokenizer, make_engine, how):
    # one id per decode step, as generate: a drafted step's wider forward rounds otherwise in
    # bfloat16 (drafts against generate: tests/test_drafting.py)
    engine = make_engine(model, method="rerotate" if how == "call" else "dense", draft_tokens=0)
    engine.chat(solver_messages("You are solver one."), agent="s1", max_new_tokens=8)  # fills the store
    messages = solver_messages("You are solver two.", REPLY)
    result = engine.chat(messages, agent="s2", max_new_tokens=16, reuse=(False if how == "call" else None))
    ids, text = generate_text(model, tokenizer, messages, 16)
    assert result.token_ids == ids and result.text == text
    assert result.stats.reused_tokens == 0 and result.stats.mode == "dense"
    assert result.stats.dense_reason == "reuse_off"
    if how == "call":  # the question is found, and reported as not reused
        assert [d.reason for d in result.stats.decisions] == ["reuse_off"]
    else:
        assert result.segment is None and len(engine.store) == 0


def test_second_agent_reuses_question_and_reply(model, tokenizer, make_engine):
    engine = make_engine(model)
    first = replayed(engine, solver_messages("You are solver one."), "s1")
    assert first.segment is not None and first.segment.kind == ("s1", "assistant")
    messages = solver_messages("You are solver two.") + [
        {"role": "user", "content": first.text, "segment": first.segment.model_dump()}  # as JSON state gives it
    ]
    second = engine.chat(messages, agent="s2", max_new_tokens=8)
    stats = second.stats
    assert stats.reused_tokens + stats.computed_tokens == stats.prompt_tokens
    assert stats.mode == "reuse" and stats.reused_tokens > 0
    reasons = {d.segment.kind: (d.status, d.reason) for d in stats.decisions}
    assert reasons == {("user", None): ("reused", "content"), ("s1", "assistant"): ("reused", "reference")}
    assert sum(d.reused_tokens for d in stats.decisions) + stats.prefix_tokens >= stats.reused_tokens


def _dense_result(model, tokenizer, messages, max_new_tokens=12):
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    return dense.chat(messages, agent="x", max_new_tokens=max_new_tokens)


def _receiver(ref_or_dict, content=REPLY):
    return [
        {"role": "system", "content": "You are the judge."},
        {"role": "user", "content": content, "segment": ref_or_dict},
    ]


def test_missing_segment_falls_back_to_dense(model, tokenizer, make_engine):
    producer = make_engine(model)
    ref = replayed(producer, solver_messages("You are solver one."), "s1").segment
    fresh = make_engine(model)  # e.g. after a restart: the reference survives, the KV does not
    result = fresh.chat(_receiver(ref), agent="judge", max_new_tokens=12)
    assert [(d.status, d.reason) for d in result.stats.decisions] == [("prefilled", "not_found")]
    assert result.text == _dense_result(model, tokenizer, _receiver(ref)).text


@pytest.mark.parametrize("bad", [{"id": "x"}, {"id": "x", "kind": "user", "num_tokens": -1}, "not a ref"])
def test_malformed_reference_falls_back_to_dense(llama, tokenizer, make_engine, bad):
    engine = make_engine(llama)
    replayed(engine, solver_messages("You are solver one."), "s1")  # the reply is in the store
    result = engine.chat(_receiver(bad), agent="judge", max_new_tokens=12)
    assert [(d.status, d.reason, d.segment) for d in result.stats.decisions] == [("prefilled", "bad_reference", None)]
    assert result.stats.mode != "reuse"
    assert result.text == _dense_result(llama, tokenizer, _receiver(bad)).text


def test_evicted_segment_falls_back_to_dense(model, tokenizer, make_engine):
    engine = make_engine(model)
    ref = replayed(engine, solver_messages("You are solver one."), "s1").segment
    engine.store.resize(0)  # everything unpinned is evicted
    assert engine.store.stats().evictions > 0
    result = engine.chat(_receiver(ref), agent="judge", max_new_tokens=12)
    assert [(d.status, d.reason) for d in result.stats.decisions] == [("prefilled", "evicted")]
    assert result.stats.mode != "reuse"  # an exact prefix (the system header) may still be reused
    assert result.text == _dense_result(model, tokenizer, _receiver(ref)).text


def test_foreign_model_segment_is_never_used(tokenizer, llama):
    other = tiny_llama(tokenizer, seed=7)
    engine_a = KVCommEngine(llama, tokenizer, config=mechanics())
    engine_b = KVCommEngine(other, tokenizer, config=mechanics(), store=engine_a.store)  # one store, two models
    ref = replayed(engine_a, solver_messages("You are solver one."), "s1").segment
    result = engine_b.chat(_receiver(ref), agent="judge", max_new_tokens=12)
    assert [(d.status, d.reason) for d in result.stats.decisions] == [("prefilled", "foreign_model")]
    assert result.stats.mode != "reuse"  # an exact prefix (the system header) may still be reused
    assert result.text == _dense_result(other, tokenizer, _receiver(ref)).text


def test_message_edited_from_first_token_is_stale(model, tokenizer, make_engine):
    engine = make_engine(model)
    ref = replayed(engine, solver_messages("You are solver one."), "s1").segment
    edited = "Actually, " + REPLY.lower()
    result = engine.chat(_receiver(ref, edited), agent="judge", max_new_tokens=12)
    stale, *runs = result.stats.decisions
    assert (stale.status, stale.reason) == ("prefilled", "stale")
    assert runs and all(d.found_by == "tokens" for d in runs)  # its message's ids are left to token runs
    # served as the same message without a reference would be
    other = make_engine(model)
    replayed(other, solver_messages("You are solver one."), "s1")
    plain = other.chat(_receiver(None, edited)[:1] + [{"role": "user", "content": edited}], agent="judge",
                       max_new_tokens=12)
    assert (plain.text, plain.stats.reused_tokens) == (result.text, result.stats.reused_tokens)


def test_message_edited_at_the_end_reuses_only_the_unchanged_start(model, tokenizer, make_engine):
    engine = make_engine(model)
    ref = replayed(engine, solver_messages("You are solver one."), "s1").segment
    edited = REPLY.replace("equals 72.", "makes 73!")
    result = engine.chat(_receiver(ref, edited), agent="judge", max_new_tokens=4)
    (decision,) = result.stats.decisions
    assert decision.status == "reused" and decision.reason == "reference"
    segment = engine.store.get(ref.id)
    unchanged = len(REPLY) - len(" equals 72.")
    spans = [s for s in segment.char_spans[: decision.reused_tokens]]
    assert all(span is not None and span[1] <= unchanged + 1 for span in spans)


def test_stats_add_up_over_a_three_agent_chain(model, tokenizer, make_engine):
    engine = make_engine(model)
    replies = []
    for k in range(3):
        result = engine.chat(solver_messages(f"You are solver {k + 1}.", *replies), agent=f"s{k}", max_new_tokens=10)
        s = result.stats
        assert s.reused_tokens + s.computed_tokens == s.prompt_tokens
        assert sum(end - start for start, end in s.reused_spans) == s.reused_tokens
        assert all(a[1] < b[0] for a, b in zip(s.reused_spans, s.reused_spans[1:]))  # ascending, disjoint, merged
        assert all(0 <= start < end <= s.prompt_tokens for start, end in s.reused_spans)
        assert s.ttft_s > 0 and 0 <= s.align_s <= s.ttft_s
        if k:
            assert s.reused_tokens > 0
        replies.append(REPLY if k == 0 else result.text)


def test_stream_yields_the_text_then_the_result(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    items = list(engine.stream(solver_messages("You are solver one."), agent="s1", max_new_tokens=12))
    assert isinstance(items[-1], ChatResult)
    assert "".join(items[:-1]) == items[-1].text
    assert all(isinstance(piece, str) and piece for piece in items[:-1])


def test_stop_strings_cut_the_reply(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    full = engine.chat(solver_messages("You are solver one."), agent="s1", max_new_tokens=20, reuse=False)
    stop = full.text[5:8]
    assert stop
    cut = engine.chat(solver_messages("You are solver one."), agent="s1", max_new_tokens=20, stop=[stop], reuse=False)
    assert cut.finish_reason == "stop_string" and cut.text == full.text[: full.text.find(stop)]


def test_sampling_is_reproducible_with_a_seed(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    messages = solver_messages("You are solver one.")
    runs = [engine.chat(messages, agent="s", max_new_tokens=12, temperature=1.0, top_p=0.9, seed=s).token_ids for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_add_segment_is_reused_by_content(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    document = "The quick brown fox jumps over the lazy dog while the agents debate the answer."
    ref = engine.add_segment(document)
    assert ref.kind == ("document", None) and ref.num_tokens > 8
    assert engine.add_segment(document) == ref
    messages = [{"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"Document:\n{document}\n\nWho jumps?"}]
    result = engine.chat(messages, agent="reader", max_new_tokens=4)
    (decision,) = result.stats.decisions
    assert decision.segment_id == ref.id and decision.status == "reused" and decision.reason == "content"


def test_second_round_reuses_the_exact_prefix(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    history = solver_messages("You are solver one.")
    first = engine.chat(history, agent="s1", max_new_tokens=10)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now check your answer."}]
    second = engine.chat(history, agent="s1", max_new_tokens=10)
    assert second.stats.mode == "prefix" and second.stats.prefix_tokens > 30
    assert second.token_ids == _dense_result(llama, tokenizer, history, 10).token_ids


def test_bad_messages_get_clear_errors(llama, make_engine):
    engine = make_engine(llama)
    with pytest.raises(InvalidMessagesError):
        engine.chat("hello", agent="a")
    with pytest.raises(InvalidMessagesError):
        engine.chat([{"content": "no role"}], agent="a")
    with pytest.raises(InvalidMessagesError):
        engine.chat([{"role": "user", "content": "hi"}], agent="")


@pytest.mark.parametrize("option", [
    {"max_new_tokens": 0}, {"max_new_tokens": True}, {"temperature": -1.0}, {"temperature": float("nan")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1}, {"seed": "3"}, {"stop": 3}, {"stop": ["ok", 1]},
])
def test_bad_options_are_request_errors_before_any_compute(llama, make_engine, option):
    engine = make_engine(llama)
    with pytest.raises(InvalidRequestError) as error:
        engine.chat(solver_messages("You are solver one."), agent="a", **option)
    assert isinstance(error.value, ValueError) and isinstance(error.value, KVCommError)
    assert len(engine.store) == 0  # nothing was computed or kept
    assert issubclass(InvalidMessagesError, InvalidRequestError)


def test_add_segment_checks_its_arguments(llama, make_engine):
    engine = make_engine(llama)
    for kind in ("document", ("a", "b", "c"), 5, (1, 2), [None, None], ("", None)):
        with pytest.raises(InvalidRequestError, match="kind must be a"):
            engine.add_segment("some shared text for everyone to read", kind=kind)
    with pytest.raises(InvalidRequestError):
        engine.add_segment("")
    with pytest.raises(InvalidRequestError, match="no prompt holding it could be served"):
        engine.add_segment("clips " * llama.config.max_position_embeddings)
    assert len(engine.store) == 0
    assert engine.add_segment("some shared text for everyone to read", kind=["tool", "result"]).kind == ("tool", "result")


def test_add_segment_says_why_a_text_was_not_kept(llama, make_engine):
    """Too short, larger than the budget, or the budget held by a running call's pinned entries
    (retry once it finishes): each its own message, and the last works after the call ends."""
    text = "The river market opens at seven and sells green apples, stones and clouds to every buyer."
    with pytest.raises(InvalidRequestError, match="shorter than min_match_tokens"):
        make_engine(llama, min_match_tokens=500).add_segment(text)
    with pytest.raises(InvalidRequestError, match="larger than the store's byte budget"):
        make_engine(llama, store_max_bytes=1024).add_segment(text)
    engine = make_engine(llama, method="exact_prefix")
    history = [{"role": "user", "content": " ".join(f"fact {i}: the market sells {i} apples." for i in range(30))}]
    engine.chat(history, agent="a", max_new_tokens=2)  # keeps the prompt's exact prefix
    engine.store.resize(engine.store.stats().bytes + 1024)  # room for little more than that prefix
    stream = engine.stream(history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
                           agent="b", max_new_tokens=8)
    next(stream)  # a paused client: its call holds (pins) the prefix
    with pytest.raises(InvalidRequestError, match=r"held by entries running calls are using \(1 pinned\)"):
        engine.add_segment(text)
    stream.close()
    assert engine.add_segment(text).num_tokens > 8


def test_engine_calls_are_thread_safe(llama, tokenizer, make_engine):
    from concurrent.futures import ThreadPoolExecutor

    engine = make_engine(llama)
    serial = [engine.chat(solver_messages(f"You are solver {k}."), agent=f"s{k}", max_new_tokens=6, reuse=False).text for k in range(4)]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda k: engine.chat(solver_messages(f"You are solver {k}."), agent=f"s{k}", max_new_tokens=6, reuse=False).text, range(4)))
    assert parallel == serial


def test_tool_results_become_segments_that_other_agents_reuse(llama, tokenizer, make_engine):
    engine = make_engine(llama)
    tool_output = "def add(a, b):\n    return a + b\n# tests passed: 3 of 3, the answer is 72"
    caller = [{"role": "system", "content": "You are the tester."},
              {"role": "tool", "name": "run_tests", "content": tool_output}]
    engine.chat(caller, agent="tester", max_new_tokens=2)
    segment = engine.store.find_text(tool_output, engine.fingerprint)
    assert segment is not None and segment.ref.kind == ("run_tests", "tool")
    reader = [{"role": "system", "content": "You are the planner."},
              {"role": "user", "content": f"The tester reported:\n{tool_output}"}]
    result = engine.chat(reader, agent="planner", max_new_tokens=2)
    assert [(d.segment_id, d.status) for d in result.stats.decisions] == [(segment.id, "reused")]


def test_streamed_pieces_never_include_a_cut_stop_string():
    from kvcomm_agents.decoding import TextAccumulator

    tokenizer = __import__("kvcomm_agents.testing", fromlist=["tiny_tokenizer"]).tiny_tokenizer()
    ids = tokenizer("The answer is 72.\n用户：next", add_special_tokens=False)["input_ids"]
    for stop in (["用户："], ["\n用户："], "用户："):
        text = TextAccumulator(tokenizer, stop)
        pieces = []
        for token in ids:
            pieces.append(text.push(token))
            if text.stopped:
                break
        pieces.append(text.flush())
        assert "".join(pieces) == text.text and text.stopped and "用" not in text.text


def test_a_paused_stream_does_not_block_other_calls(llama, tokenizer, make_engine):
    import threading

    engine = make_engine(llama)
    stream = engine.stream(solver_messages("You are solver one."), agent="s1", max_new_tokens=8)
    next(stream)  # paused mid-reply
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.chat(solver_messages("You are solver two."), agent="s2", max_new_tokens=3)))
    worker.start()
    worker.join(timeout=60)
    assert done and done[0].stats.generated_tokens == 3
    result = [item for item in threading_resume(stream) if isinstance(item, ChatResult)]
    assert result and result[0].stats.generated_tokens <= 8


def threading_resume(generator):
    """Finish a generator from another thread (as LangChain's async streaming does)."""
    import threading

    items = []
    worker = threading.Thread(target=lambda: items.extend(generator))
    worker.start()
    worker.join(timeout=60)
    return items


def test_dense_agents_opt_out_and_are_counted_apart(llama, tokenizer, make_engine):
    engine = make_engine(llama, dense_agents=frozenset({"judge"}))
    first = replayed(engine, solver_messages("You are solver one."), "s1")
    second = engine.chat(solver_messages("You are solver two.", first.text), agent="s2", max_new_tokens=2)
    judge = engine.chat(solver_messages("You are the judge.", first.text), agent="judge", max_new_tokens=2)
    assert judge.stats.opted_out and judge.stats.reused_tokens == 0
    assert {d.reason for d in judge.stats.decisions} == {"reuse_off"}
    summary = ReuseSummary.of([first.stats, second.stats, judge.stats])
    assert (summary.calls, summary.eligible, summary.opted_out, summary.reuse_rate) == (3, 1, 1, 1.0)
    assert summary.token_share == pytest.approx(second.stats.reused_tokens / (first.stats.prompt_tokens + second.stats.prompt_tokens))


def test_audit_every_records_the_drift_of_reused_calls(llama, tokenizer, make_engine):
    engine = make_engine(llama, audit_every=2)
    first = replayed(engine, solver_messages("You are solver one."), "s1")
    assert first.stats.audit_kl is None  # nothing reused, nothing to audit
    audited = []
    for system in ("You are solver two.", "You are solver three."):
        messages = solver_messages(system, first.text)
        result = engine.replay(messages, agent=system, reply_ids=[tokenizer.eos_token_id])
        dense_logits = first_logits(KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense")), messages)
        audited.append((result.result, first_token_kl(dense_logits, result.first_token_logits)))
    (one, _), (two, kl) = audited
    assert one.stats.mode == "reuse" and one.stats.audit_kl is None  # 1st reused call: not sampled
    assert two.stats.audit_kl == pytest.approx(kl, abs=1e-6) and kl > 0


def test_shared_text_inside_a_new_message_is_found_by_token_runs(model, tokenizer, make_engine):
    """One-message prompts (the task and other agents' outputs embedded in one user message):
    the task text an earlier call computed inside its own message is reused by token runs."""
    engine = make_engine(model)
    first_prompt = [{"role": "system", "content": "You are solver one."},
                    {"role": "user", "content": f"Task: {QUESTION}\nThink step by step."}]
    first = replayed(engine, first_prompt, "s1")
    message = f"Check this problem. {QUESTION}\n\nSolver one wrote: {first.text}\nGive your answer."
    second = [{"role": "system", "content": "You are solver two, a careful checker."},
              {"role": "user", "content": message}]
    result = replayed(engine, second, "s2")
    layout = render_prompt(tokenizer, second)
    start = layout.text.index(QUESTION)
    question = set(layout.tokens_within(start, start + len(QUESTION)))
    by_tokens = [d for d in result.stats.decisions if d.found_by == "tokens" and d.status == "reused"]
    covered = {p for d in by_tokens for p in range(*d.span)} & question
    assert len(covered) >= 0.8 * len(question)
    assert all(d.message_index == 1 for d in by_tokens)
    dense = make_engine(model, method="dense").replay(second, agent="s2", reply_ids=forced(tokenizer)).result
    assert dense.stats.reused_tokens == 0 and result.stats.reused_tokens > len(covered)
    exact_only = make_engine(model, method="exact_prefix")
    replayed(exact_only, first_prompt, "s1")
    assert not [d for d in replayed(exact_only, second, "s2").stats.decisions if d.found_by == "tokens"]
