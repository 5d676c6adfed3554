"""Decode steps that check drafts looked up in the call's own ids, else in the engine's last
replies (kvcomm_agents/drafting.py,
kvcomm_agents/decode_loop.py): where the draft source proposes, the reply, its logits and the KV
kept are those of one id per step; only the number of forwards changes. The draft source is the
seam: an oracle (the reference reply's next ids) or a liar (wrong ids) stands in for the n-gram
lookup, whose picks on the tiny random models would rarely hold; the embedded model drafts for
real."""

import pytest
import torch

from kvcomm_agents import ChatResult, ExperimentalSettings, KVCommConfig, KVCommEngine
from kvcomm_agents.drafting import NgramDraft, RecentReplies
from kvcomm_agents.step_costs import StepCosts
from kvcomm_agents.kv.store import PrefixEntry

from .batching import at_once, branch, generate, greedy_together, greedy_with, longest
from .conftest import QUESTION, tol


# ---- the lookup -----------------------------------------------------------------------------
def test_a_draft_is_what_followed_the_tails_last_earlier_occurrence():
    drafts = NgramDraft([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], most=8, first=8)
    assert drafts.draft(room=8) == [7, 8, 5, 1, 2, 3]  # the later of two occurrences of (1, 2, 3)
    assert drafts.draft(room=2) == [7, 8]


def test_the_longest_ngram_that_occurred_decides_and_no_match_drafts_nothing():
    drafts = NgramDraft([4, 2, 6, 0, 5, 2, 6], most=4, first=4)
    assert drafts.draft(room=4) == [0, 5, 2, 6]  # (2, 6) occurred; (5, 2, 6) did not
    drafts.extend([3])
    assert drafts.draft(room=4) == []  # neither (2, 6, 3) nor (6, 3) occurred before
    assert NgramDraft([1, 2], most=4).draft(room=4) == []


def test_the_draft_length_doubles_after_a_whole_draft_and_shrinks_to_what_was_kept():
    drafts = NgramDraft([], most=8)
    assert drafts.length == 2
    drafts.settle(2, 2)
    drafts.settle(4, 4)
    assert drafts.length == 8
    drafts.settle(8, 8)
    assert drafts.length == 8  # capped at most
    drafts.settle(8, 3)
    assert drafts.length == 3
    drafts.settle(3, 0)
    assert drafts.length == 1  # never below one
    with pytest.raises(ValueError):
        NgramDraft([], most=0)


def test_recent_replies_draft_where_the_calls_own_ids_hold_no_match():
    recent = RecentReplies(keep=2)
    recent.add([1, 2, 3, 4, 5])
    recent.add([7, 2, 3, 6, 6])
    drafts = NgramDraft([9, 2, 3], most=4, recent=recent, first=4)
    assert drafts.draft(room=4) == [6, 6]  # (2, 3) last ended in the newest reply holding it
    drafts = NgramDraft([1, 2, 3, 8, 9, 2, 3], most=4, recent=recent, first=4)
    assert drafts.draft(room=4) == [8, 9, 2, 3]  # the call's own (2, 3) before the replies' (1, 2, 3)...
    drafts = NgramDraft([2, 3, 0, 1, 2, 3], most=4, recent=recent, first=4)
    assert drafts.draft(room=4) == [4, 5]  # ...but a reply's 3-gram before the call's 2-gram (2, 3)
    recent.add([8, 8, 8])
    assert len(recent) == 2  # the oldest went: (1, 2, 3) with it, (2, 3) is left
    assert NgramDraft([0, 1, 2, 3], most=4, recent=recent, first=4).draft(room=4) == [6, 6]
    none = RecentReplies(keep=0)
    none.add([1, 2, 3, 4])
    assert len(none) == 0 and NgramDraft([1, 2, 3], most=4, recent=none).draft(room=4) == []
    with pytest.raises(ValueError):
        NgramDraft([], most=4, recent=RecentReplies(keep=1, sizes=(4,)))



# ---- draft lengths from measured forward costs ----------------------------------------------
def measured(seconds: dict[int, float]) -> StepCosts:
    """Costs with three forwards of each size measured at ``seconds`` (ids -> s)."""
    costs = StepCosts()
    for _ in range(3):
        for ids, s in seconds.items():
            costs.record(ids, s)
    return costs


#: forwards of q ids as measured on 2 cores of an AMD EPYC (benchmarks.batched_steps): 3 ids dearest
EPYC = {1: 0.041, 2: 0.065, 3: 0.081, 4: 0.062, 5: 0.056, 9: 0.067}


def test_a_draft_is_made_longer_where_a_forward_of_more_ids_was_measured_cheaper():
    costs = measured(EPYC)
    assert costs.draft_length(wanted=2, available=8) == 4  # 5 ids (56 ms) against 3 (81 ms)
    assert costs.draft_length(wanted=1, available=8) == 4  # against 2 ids (65 ms)
    assert costs.draft_length(wanted=4, available=8) == 4  # 9 ids (67 ms) dearer than 5: never shorter either
    assert costs.draft_length(wanted=8, available=8) == 8
    assert costs.draft_length(wanted=2, available=3) == 3  # 4 ids (62 ms) the cheapest of 3..4
    assert costs.draft_length(wanted=6, available=5) == 5  # fewer found than wanted
    assert costs.draft_length(wanted=5, available=8) == 5  # 6 ids never measured: nothing to weigh
    assert StepCosts().draft_length(wanted=2, available=8) == 2  # nothing measured: the adapted length
    assert measured({3: 0.060, 5: 0.057}).draft_length(wanted=2, available=8) == 2  # within the margin: noise
    twice = StepCosts()
    for _ in range(2):
        twice.record(3, 0.080), twice.record(5, 0.050)
    assert twice.cost(5) is None and twice.draft_length(wanted=2, available=8) == 2  # too few samples
    assert measured(EPYC).table() == EPYC


def test_measured_costs_lengthen_a_draft_and_its_next_length_follows_what_was_fed():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    drafts = NgramDraft(ids, most=8, costs=measured(EPYC))
    assert NgramDraft(ids, most=8).draft(room=8) == [4, 5]  # the adapted first length: 2
    assert drafts.draft(room=8) == [4, 5, 6, 7]
    assert drafts.draft(room=3) == [4, 5, 6]  # never past the room the reply has left
    drafts.settle(4, 4)
    assert drafts.length == 8  # doubled from what was fed and kept
    drafts.settle(4, 1)
    assert drafts.length == 1


def test_longer_drafts_from_measured_costs_give_the_one_forward_replays_logits(model, tokenizer, monkeypatch):
    """With every longer forward measured cheaper, the first drafted step feeds more than the
    adapted two ids; the logits and the accounting stay those of a replay in one forward."""
    ids = tokenizer(f"{QUESTION} {QUESTION}")["input_ids"]  # its second half repeats its first
    fed: dict[int, list[int]] = {}
    record = StepCosts.record

    def spy(self, n, seconds):
        fed.setdefault(id(self), []).append(n)
        record(self, n, seconds)

    monkeypatch.setattr(StepCosts, "record", spy)
    monkeypatch.setattr(StepCosts, "cost", lambda self, n: 1.0 / n)  # more ids always cheaper
    fixed = KVCommEngine(model, tokenizer, config=KVCommConfig(
        method="dense", experimental=ExperimentalSettings(measured_draft_lengths=False)))
    longer = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    want = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    want_logits = want.replay(branch(0), agent="a", reply_ids=ids).logits
    for engine in (fixed, longer):
        got = engine.replay(branch(0), agent="a", reply_ids=ids, stepwise=True)
        torch.testing.assert_close(got.logits, want_logits, atol=tol(1e-4), rtol=1e-4)
        stats = got.result.stats
        assert stats.accepted_tokens > 0
        assert stats.forwarded.decode == len(ids) - 1 + stats.drafted_tokens - stats.accepted_tokens
    drafted = {name: [n for n in fed[id(e._calls.decoding.costs)] if n > 1] for name, e in (("fixed", fixed), ("longer", longer))}
    assert drafted["fixed"][0] == 3 and drafted["longer"][0] > 3

# ---- the decode loop, with the draft source replaced ----------------------------------------
def engines(model, tokenizer, **config):
    on = KVCommEngine(model, tokenizer, config=KVCommConfig(audit_every=0, **config))
    off = KVCommEngine(model, tokenizer, config=KVCommConfig(audit_every=0, draft_tokens=0, **config))
    return on, off


def proposing(monkeypatch, reference: list[int], wrong: bool = False, vocab: int = 256):
    """Make every draft the reference reply's next ids (or, ``wrong``, ids one off them)."""
    def draft(self, room):
        k = min(room, self.length)
        done = len(self.ids) - self.prompt_length
        ids = reference[done:done + k]
        return [(i + 1) % vocab for i in ids] if wrong else ids

    original = NgramDraft.__init__

    def init(self, ids, most, **kw):
        original(self, ids, most, **kw)
        self.prompt_length = len(ids) - 1  # the prompt, then the first id

    monkeypatch.setattr(NgramDraft, "__init__", init)
    monkeypatch.setattr(NgramDraft, "draft", draft)


def greedy_rows(engine, messages, agent="a", tokens=24):
    """(result, [n, vocab] logits picked from) of a greedy call that never ends early."""
    rows, choose = [], longest(engine)

    def pick(logits):
        rows.append(logits.detach().float().cpu())
        return choose(logits)

    result = next(i for i in engine._generate(messages, agent, tokens, pick, None, None, None)
                  if isinstance(i, ChatResult))
    return result, torch.stack(rows)


def kept(engine) -> dict:
    return {tuple(e.token_ids.tolist()): e for e in engine.store._entries.values() if isinstance(e, PrefixEntry)}


@pytest.mark.parametrize("wrong", [False, True], ids=["accepted", "refused"])
def test_drafted_steps_give_the_reply_logits_and_kept_kv_of_one_id_per_step(model, tokenizer, monkeypatch, wrong):
    on, off = engines(model, tokenizer, method="exact_prefix")
    want, want_rows = greedy_rows(off, branch(0))
    proposing(monkeypatch, want.token_ids, wrong, len(tokenizer))
    got, got_rows = greedy_rows(on, branch(0))
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got_rows, want_rows, atol=tol(1e-4), rtol=1e-4)
    n = len(want.token_ids)
    assert want.stats.forwarded.decode == n - 1 and want.stats.drafted_tokens == 0
    if wrong:  # every draft refused: one id per step, plus the refused ids
        assert got.stats.accepted_tokens == 0 and got.stats.drafted_tokens > 0
    else:  # 2, 4, 8, 8, ... ids a step: the reply in a handful of forwards
        assert got.stats.accepted_tokens == got.stats.drafted_tokens >= n - 6
    assert got.stats.forwarded.decode == n - 1 + got.stats.drafted_tokens - got.stats.accepted_tokens
    assert_same_kv_kept(on, off)


def assert_same_kv_kept(on, off):
    """The engines' stores hold one prefix each, the same ids (the prompt and the reply, its
    last id never fed) and the same KV."""
    a, b = kept(on), kept(off)
    assert a.keys() == b.keys() and len(a) == 1
    for (k, v), (k2, v2) in zip(a[next(iter(a))].kv.layers(), b[next(iter(b))].kv.layers()):
        torch.testing.assert_close(k, k2, atol=tol(1e-4), rtol=1e-4)
        torch.testing.assert_close(v, v2, atol=tol(1e-4), rtol=1e-4)


def test_a_reply_ending_inside_a_draft_keeps_the_kv_up_to_its_end(llama, tokenizer, monkeypatch):
    on, off = engines(llama, tokenizer, method="exact_prefix")

    def run(engine, stop):
        return next(i for i in engine._generate(branch(0), "a", 24, longest(engine), stop, None, None)
                    if isinstance(i, ChatResult))

    long = run(off, None)
    off.store.clear()
    stop = long.text[len(long.text) // 2:][:3]  # ends the reply inside a drafted run
    want = run(off, [stop])
    proposing(monkeypatch, long.token_ids)
    got = run(on, [stop])
    assert got.text == want.text and got.token_ids == want.token_ids and got.finish_reason == "stop_string"
    assert 0 < got.stats.accepted_tokens < len(got.token_ids)  # the draft ids after the end not counted
    assert_same_kv_kept(on, off)


def test_an_end_of_sequence_id_inside_a_draft_ends_the_picks(llama, tokenizer, monkeypatch):
    """A reply quoting text that an end-of-sequence id follows in the prompt drafts that id: the
    picker is called once per reply id (no row beyond the end), the KV kept as without drafts."""
    on, off = engines(llama, tokenizer, method="exact_prefix")
    reference = greedy_with(off, 0, longest(off), tokens=12).token_ids + [tokenizer.eos_token_id]
    off.store.clear()

    def scripted(engine):
        rows = []

        def pick(logits):
            rows.append(logits)
            return reference[len(rows) - 1]

        result = next(i for i in engine._generate(branch(0), "a", 24, pick, None, None, None)
                      if isinstance(i, ChatResult))
        return result, rows

    want, _ = scripted(off)
    proposing(monkeypatch, reference + [5, 6, 7])  # the draft runs on past the end
    got, rows = scripted(on)
    assert got.token_ids == want.token_ids == reference and got.finish_reason == "stop"
    assert len(rows) == len(reference) and got.stats.accepted_tokens > 0
    assert_same_kv_kept(on, off)


def test_sampled_replies_draw_the_same_ids_with_drafts(llama, tokenizer, monkeypatch):
    on, off = engines(llama, tokenizer, method="dense")
    want = off.chat(branch(1), agent="a", max_new_tokens=20, temperature=0.8, seed=7)
    proposing(monkeypatch, want.token_ids)
    got = on.chat(branch(1), agent="a", max_new_tokens=20, temperature=0.8, seed=7)
    assert got.token_ids == want.token_ids  # one draw per chosen id, from the same rows
    assert got.stats.accepted_tokens > 0


def test_a_stepwise_replay_drafts_and_gives_the_one_forward_replays_logits(model, tokenizer):
    on, off = engines(model, tokenizer, method="dense")
    ids = tokenizer(f"{QUESTION} {QUESTION}")["input_ids"]  # its second half repeats its first
    got = on.replay(branch(0), agent="a", reply_ids=ids, stepwise=True)
    want = off.replay(branch(0), agent="a", reply_ids=ids)
    torch.testing.assert_close(got.logits, want.logits, atol=tol(1e-4), rtol=1e-4)
    stats = got.result.stats
    assert stats.accepted_tokens > len(ids) // 3  # the repeat is drafted from the first half
    assert stats.forwarded.decode == len(ids) - 1 + stats.drafted_tokens - stats.accepted_tokens


def test_calls_decoding_at_once_answer_as_alone_with_drafts_on(llama, tokenizer, monkeypatch):
    on = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    off = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0, batched_decode=False))
    want = {k: greedy_with(off, k, longest(off)) for k in range(3)}
    got = at_once(on, 3, greedy_together(3))
    for k in range(3):
        assert got[k][0].token_ids == want[k].token_ids
    assert on._calls.decoding.batcher.batched_steps > 0


def test_a_sibling_reusing_an_earlier_reply_drafts_from_it(model, tokenizer):
    """A reply that is not in the call's prompt but was an earlier call's reply is drafted from
    it (``draft_recent_replies``); the logits are the one-forward replay's."""
    ids = tokenizer(f"{QUESTION} The answer is 72 clips.")["input_ids"]
    stats, logits = {}, {}
    for keep in (6, 0):
        engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense", draft_recent_replies=keep))
        engine.replay(branch(0), agent="a", reply_ids=ids, stepwise=True)  # the sibling before
        replayed = engine.replay(branch(1), agent="b", reply_ids=ids, stepwise=True)
        stats[keep], logits[keep] = replayed.result.stats, replayed.logits
    want = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    torch.testing.assert_close(logits[6], want.replay(branch(1), agent="b", reply_ids=ids).logits,
                               atol=tol(1e-4), rtol=1e-4)
    assert stats[6].accepted_tokens >= len(ids) - 8  # the whole reply drafted after its first ids
    assert stats[6].accepted_tokens > stats[0].accepted_tokens  # its own ids hold less of it
    assert stats[6].forwarded.decode == len(ids) - 1 + stats[6].drafted_tokens - stats[6].accepted_tokens


def test_draft_tokens_0_feeds_one_id_per_step(llama, tokenizer):
    ids = tokenizer(f"{QUESTION} {QUESTION}")["input_ids"]  # drafted where drafts are on (the test above)
    off = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", draft_tokens=0))
    stats = off.replay(branch(0), agent="a", reply_ids=ids, stepwise=True).result.stats
    assert stats.drafted_tokens == stats.accepted_tokens == 0 and stats.forwarded.decode == len(ids) - 1


@pytest.mark.embedded
def test_the_embedded_model_drafts_from_a_solution_it_checks_and_answers_as_without():
    from kvcomm_agents.models import load_model

    model, tok = load_model(None, device="cpu")
    messages = [{"role": "system", "content": "You are a careful judge."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "In April she sold 48 clips. In May she sold 48 / 2 = 24 clips. "
                                                 "Altogether 48 + 24 = 72 clips."},
                {"role": "user", "content": "Check the solution above step by step and give the final answer."}]
    on, off = engines(model, tok, method="dense")
    got, want = on.chat(messages, agent="judge", max_new_tokens=64), off.chat(messages, agent="judge", max_new_tokens=64)
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_tokens > 0
    assert got.stats.forwarded.decode < want.stats.forwarded.decode + got.stats.drafted_tokens
