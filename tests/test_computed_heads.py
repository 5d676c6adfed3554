"""What of a reused run is computed in context: its first ``recompute_head`` ids, its last
``recompute_tail`` ids, a run of at most ``recompute_short_runs`` ids whole, and what a gate
refusal of such a run costs (the engine on tiny real models)."""

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine

from .conftest import QUESTION, REPLY, first_logits, replayed, solver_messages


def test_recompute_head_computes_the_first_tokens_of_each_reused_run(llama, tokenizer, make_engine):
    """``recompute_head=4``: every reused run gives up its first 4 tokens to the
    prefill; a head as long as the runs leaves nothing reused and the call equals dense."""
    def second_call(head: int):
        engine = make_engine(llama, prefix_cache=False, recompute_head=head)
        first = replayed(engine, solver_messages("You are solver one."), "s1")
        messages = solver_messages("You are solver two.", first.text)
        return engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]), messages

    plain, messages = second_call(0)
    headed, _ = second_call(4)
    runs = [d for d in plain.result.stats.shared_decisions if d.status == "reused"]
    assert runs and headed.result.stats.reused_tokens == plain.result.stats.reused_tokens - 4 * len(runs)
    covered = lambda stats: {p for a, b in stats.reused_spans for p in range(a, b)}  # noqa: E731
    heads = covered(plain.result.stats) - covered(headed.result.stats)
    assert len(heads) == 4 * len(runs) and covered(headed.result.stats) <= covered(plain.result.stats)
    whole, _ = second_call(10_000)
    assert whole.result.stats.reused_tokens == 0
    dense = first_logits(KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense")), messages, agent="s2")
    torch.testing.assert_close(whole.first_token_logits, dense, atol=1e-4, rtol=0)


def test_recompute_tail_computes_the_last_tokens_of_each_reused_run(llama, tokenizer, make_engine):
    """``recompute_tail=3``: a reused run ending at most ``TAIL_REACH`` ids before the prompt's end
    gives up its last 3 tokens (beside its head) to the prefill, the positions right before the
    reader's own text; one further from the end keeps them. Head and tail as long as the runs
    leave nothing reused, reason ``short_run``, and the call equals dense."""
    from kvcomm_agents.repairs import TAIL_REACH

    def second_call(tail: int, head: int = 4, after: str = ""):
        engine = make_engine(llama, prefix_cache=False, recompute_head=head, recompute_tail=tail,
                             dense_when_cheaper=False)
        first = replayed(engine, solver_messages("You are solver one."), "s1")
        messages = solver_messages("You are solver two.", first.text)
        if after:
            messages.append({"role": "user", "content": after})
        return engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]), messages

    plain, messages = second_call(0)
    tailed, _ = second_call(3)
    spans, n = plain.result.stats.reused_spans, plain.result.stats.prompt_tokens
    assert spans and tailed.result.stats.reused_spans == [(a, b - 3) if n - b <= TAIL_REACH else (a, b)
                                                          for a, b in spans]
    assert any(n - b <= TAIL_REACH for _, b in spans)
    far = "Think it over carefully before you answer, and check every step twice. " * 8
    far_plain, _ = second_call(0, after=far)
    far_tailed, _ = second_call(3, after=far)
    far_spans, far_n = far_plain.result.stats.reused_spans, far_plain.result.stats.prompt_tokens
    assert far_spans and all(far_n - b > TAIL_REACH for _, b in far_spans)
    assert far_tailed.result.stats.reused_spans == far_spans
    longest = max(b - a for a, b in spans) + 4
    whole, _ = second_call(longest - 4)
    assert whole.result.stats.reused_tokens == 0
    assert {d.reason for d in whole.result.stats.shared_decisions} == {"short_run"}
    dense = first_logits(KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense")), messages, agent="s2")
    torch.testing.assert_close(whole.first_token_logits, dense, atol=1e-4, rtol=0)


def test_a_last_run_that_moved_past_text_it_never_saw_is_computed_whole_up_to_recompute_last_run(
        llama, tokenizer, make_engine):
    """``recompute_last_run=N``: the question, computed near the start of solver one's prompt,
    pasted last in a reader's prompt after a long text it never saw (over 64 more ids before it)
    is computed whole where it is at most N ids; at its old place, or with N shorter than it,
    it keeps all but its head."""
    from kvcomm_agents.repairs import TAIL_REACH

    filler = "Think it over carefully before you answer, and check every step twice. " * 8

    def second_call(last: int, moved: bool):
        engine = make_engine(llama, prefix_cache=False, recompute_head=4, recompute_last_run=last,
                             dense_when_cheaper=False)
        replayed(engine, solver_messages("You are solver one."), "s1")
        messages = solver_messages("You are solver two.")
        if moved:
            messages.insert(1, {"role": "user", "content": filler})
        return engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]).result.stats

    plain = second_call(0, moved=True)
    assert len(plain.reused_spans) == 1 and plain.prompt_tokens - plain.reused_spans[0][1] <= TAIL_REACH
    a, b = plain.reused_spans[0]
    assert a > 64 + 4  # after the filler
    computed = second_call(b - a + 4, moved=True)  # the question with its head
    assert computed.reused_tokens == 0 and {d.reason for d in computed.shared_decisions} == {"short_run"}
    assert second_call(b - a + 3, moved=True).reused_spans == plain.reused_spans
    assert second_call(b - a + 4, moved=False).reused_spans == second_call(0, moved=False).reused_spans != []


def test_a_last_run_computed_after_a_full_window_is_counted_from_where_it_was_computed(llama, tokenizer, make_engine):
    """The question, computed after a system text of over 64 ids (a full window of context),
    pasted last after a text longer still: moved by over 64 ids from where capture cut it, it is
    computed whole under ``recompute_last_run``; at about its old place it keeps all but its head."""
    from kvcomm_agents.repairs import TAIL_REACH

    filler = "Think it over carefully before you answer, and check every step twice. " * 8

    def second_call(moved: bool, last: int = 256):
        engine = make_engine(llama, prefix_cache=False, recompute_head=4, recompute_last_run=last,
                             dense_when_cheaper=False)
        replayed(engine, solver_messages("You are solver one. " + filler), "s1")
        question = engine.store.find_text(QUESTION, engine.fingerprint)
        assert len(question.context_ids) == 64 and question.computed_at > 64
        messages = solver_messages("You are solver two. " + filler)
        if moved:
            messages.insert(1, {"role": "user", "content": filler})
        return engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]).result.stats

    kept = second_call(moved=False)
    assert len(kept.reused_spans) == 1 and kept.prompt_tokens - kept.reused_spans[0][1] <= TAIL_REACH
    assert kept.reused_spans == second_call(moved=False, last=0).reused_spans  # all but its head, as without the rule
    computed = second_call(moved=True)
    assert computed.reused_tokens == 0 and {d.reason for d in computed.shared_decisions} == {"short_run"}


def test_short_runs_are_computed_whole_and_long_ones_keep_their_head(model, tokenizer, make_engine):
    """``recompute_short_runs=N``: a re-rotated run of at most N tokens is computed in context,
    a longer one loses only its head (both tiny families)."""
    def second_call(short: int):
        engine = make_engine(model, prefix_cache=False, recompute_head=4, recompute_short_runs=short)
        first = replayed(engine, solver_messages("You are solver one."), "s1")
        messages = solver_messages("You are solver two.", first.text)
        return engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]).result.stats

    plain = second_call(0)
    lengths = sorted(b - a + 4 for a, b in plain.reused_spans)  # each run with its 4-token head
    assert len(lengths) >= 2 and lengths[0] < lengths[-1]
    cut = lengths[0]  # the shortest run is computed whole, the others keep theirs
    shorter = second_call(cut)
    assert shorter.reused_tokens == plain.reused_tokens - (cut - 4)
    whole = second_call(lengths[-1])
    assert whole.reused_tokens == 0 and {d.reason for d in whole.shared_decisions} == {"short_run"}


@pytest.mark.parametrize("short", [0, 32])
def test_a_refused_segment_computed_whole_does_not_compute_the_text_after_it(model, tokenizer, make_engine, short):
    """Under KVCOMM a segment the gate judges new is computed and so, to be observed in exact
    context, is everything after it. Where the segment is computed whole anyway (the question,
    at most ``recompute_short_runs`` ids) its refusal costs only itself: the long reply after it
    goes to the gate in its own right (judged new too, in a fresh engine) instead of being
    computed as ``after_new_anchor``."""
    engine = make_engine(model, method="kvcomm", prefix_cache=False, recompute_head=4, recompute_short_runs=short)
    first = replayed(engine, solver_messages("You are solver one."), "s1", text=" ".join([REPLY] * 4))
    stats = engine.replay(solver_messages("You are solver two.", first.text), agent="s2",
                          reply_ids=[tokenizer.eos_token_id]).result.stats
    reasons = {d.segment.kind[1] == "assistant": d.reason for d in stats.shared_decisions}  # the reply, the question
    assert reasons == {False: "new_anchor", True: "after_new_anchor" if short == 0 else "new_anchor"}, reasons


#: a question long enough (in the tiny tokenizer's ids) that a reply pasted after it has 64 ids of it before
LONG_QUESTION = ("Natalia sold 48 clips to her friends in April, and then she sold half as many clips in May. "
                 "Her brother sold a third as many clips as she did in both months together, and her cousin "
                 "sold twice as many as her brother in June. How many clips did the three of them sell in all?")


def test_a_short_reply_an_earlier_reader_read_after_the_same_text_is_reused_from_its_prompt(llama, tokenizer, make_engine):
    """Short runs computed whole (``recompute_short_runs=64``): the first reader of a reply pasted
    after a question computes both (its prompt is then stored exact); the next reader, pasting
    both alike after its own system text, reuses that prompt for them (``shared_runs="spans"``:
    one decision of kind ``("prompt", None)``, the reply's ids reused). Texts matched alone, it
    computes the reply."""
    def third_call(shared_runs: str):
        engine = make_engine(llama, recompute_head=4, recompute_short_runs=64, shared_runs=shared_runs,
                             reply_copies=False, text_copies=False)
        first = replayed(engine, [{"role": "system", "content": "You are solver one."},
                                  {"role": "user", "content": "Name a number."}], "s1")
        pasted = f"{LONG_QUESTION}\n\nSolver 1 said: {first.text}"
        replayed(engine, [{"role": "system", "content": "You are solver two."},
                          {"role": "user", "content": f"{pasted}\n\nNow check it."}], "s2", text="I agree with it.")
        messages = [{"role": "system", "content": "You are the judge of this debate."},
                    {"role": "user", "content": f"{pasted}\n\nSolver 2 agreed."}]
        stats = engine.replay(messages, agent="judge", reply_ids=[tokenizer.eos_token_id]).result.stats
        # the judge's message holds found texts: not stored again as a new user message
        assert engine.store.find_text(messages[1]["content"], engine.fingerprint) is None
        return stats

    spans, alone = third_call("spans"), third_call("anywhere")
    reply = next(d.span for d in alone.decisions if d.segment is not None and d.segment.kind == ("s1", "assistant"))
    assert [(d.status, d.reason) for d in alone.decisions if d.span == reply] == [("prefilled", "short_run")]
    (span,) = [d for d in spans.decisions if d.status == "reused"]
    assert span.segment.kind == ("prompt", None) and span.span[0] <= reply[0] - 64 and span.span[1] >= reply[1]
    covered = {p for a, b in spans.reused_spans for p in range(a, b)}
    assert set(range(*reply)) <= covered and spans.reused_tokens > alone.reused_tokens


def test_a_run_cut_a_whole_window_inside_its_text_gives_up_a_longer_head(llama, tokenizer, make_engine):
    """``recompute_cut_head=N``: a page one agent read whole, pasted by another from its
    middle (over 64 ids in: its KV followed the page's first lines, which that prompt does not
    hold), gives up its first N ids instead of ``recompute_head``'s 4; pasted whole, from the
    page's start, it keeps the plain head."""
    lines = [f"Day {i}: Natalia sold {i + 3} clips to friend number {i} and kept the rest." for i in range(24)]
    page, cut = "\n".join(lines), "\n".join(lines[12:])

    def reader_runs(text: str, cut_head: int) -> list[tuple[int, int]]:
        engine = make_engine(llama, prefix_cache=False, dense_when_cheaper=False, recompute_cut_head=cut_head)
        replayed(engine, [{"role": "system", "content": "You are the indexer."},
                          {"role": "user", "content": f"{page}\n\nList the days."}], "indexer")
        messages = [{"role": "system", "content": "You are the reader, who counts clips."},
                    {"role": "user", "content": f"{QUESTION}\n\nPassage:\n{text}\n\nHow many clips?"}]
        return engine.replay(messages, agent="reader", reply_ids=[tokenizer.eos_token_id]).result.stats.reused_spans

    plain, headed = reader_runs(cut, 0), reader_runs(cut, 24)
    assert len(plain) == 1 and plain[0][1] - plain[0][0] > 64
    assert headed == [(plain[0][0] + 20, plain[0][1])]  # 24 ids of head instead of 4
    assert reader_runs(page, 24) == reader_runs(page, 0) != []


def test_a_later_run_deep_inside_its_text_keeps_the_plain_head(llama, tokenizer, make_engine):
    """``recompute_cut_head`` is for a first run cut inside its text: a reply pasted whole, split in
    two where the reader's tokenizer reads a word the model generated byte by byte as one id, gives
    its later run (over 64 ids in) ``recompute_head``'s 16 ids: that run's KV followed the earlier
    run's text, which the prompt holds right before it."""
    from kvcomm_agents.kv.segments import CONTEXT_TOKENS

    text = "\n".join(f"Day {i}: Natalia sold {i + 3} clips to friend number {i} and kept the rest." for i in range(12))
    ids = tokenizer(text)["input_ids"]
    k = next(i for i in range(80, len(ids)) if len(tokenizer.convert_ids_to_tokens(ids[i])) > 1)
    split = ids[:k] + tokenizer.convert_tokens_to_ids(list(tokenizer.convert_ids_to_tokens(ids[k]))) + ids[k + 1:]
    plans = []
    engine = make_engine(llama, prefix_cache=False, dense_when_cheaper=False, recompute_head=16, recompute_cut_head=64,
                         plan_hook=lambda engine, plan: plans.append(plan) or plan)
    reply = engine.replay(solver_messages("You are solver one."), agent="s1",
                          reply_ids=split + [tokenizer.eos_token_id]).result
    assert reply.text == text
    engine.replay(solver_messages("You are the reader.", text), agent="reader", reply_ids=[tokenizer.eos_token_id])
    first, later = [run for run in plans[-1].runs if run.segment.id == reply.segment.id]
    # the later run follows the first across the ids read otherwise, from over 64 ids into the reply
    assert first.segment_start - first.head < CONTEXT_TOKENS <= later.segment_start - later.head
    assert later.segment_start - later.head > first.segment_start + first.length and later.length > CONTEXT_TOKENS
    assert (first.head, later.head) == (16, 16)  # not recompute_cut_head's 64
