"""Replies computed by their sender in their readers' framing (kvcomm_agents.framing): the rule
learned from ids, the version recorded after the sender's reply, and the first reader reusing it
exactly where its text before the reply is the sender's, on both tiny model families."""

import dataclasses

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.anchors.kvcomm import offsets
from kvcomm_agents.versions.match import framed_receiver
from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.framing import ALIGN_IDS, FramingRule
from kvcomm_agents.framing.replies import ReaderFraming, learn_rule
from kvcomm_agents.plan import CallPlan, Observation
from kvcomm_agents.prompt import render_prompt

from .anchors.synthetic import KIND, segment
from .conftest import first_logits, tol
from .conftest import mechanics

SENDER = tuple(range(100, 140))  # 40 ids of the sender's prompt
HEADER = (7, 8, 9)  # its generation header, at the end


def test_a_debate_framing_drops_the_generation_header_and_keeps_the_lead_in():
    """The reader repeats the sender's prompt without its header, then adds its own lead-in."""
    lead_in = (50, 51, 52, 53)
    reader = (1, 2) + SENDER + lead_in
    assert learn_rule(reader, SENDER + HEADER) == FramingRule(drop=3, lead_in=lead_in)


def test_a_framing_inside_one_message_drops_the_closing_ids_too():
    """(e)'s shape: the reader pastes the reply after the last text the sender read, inside the
    same user message, so the sender's message end and header are both dropped."""
    closing = (5, 6)  # end of message
    reader = SENDER[:30] + (60, 61)  # '\n\nSolver 2: '
    assert learn_rule(reader, SENDER[:30] + closing + HEADER) == FramingRule(drop=5, lead_in=(60, 61))


def test_no_rule_where_the_base_fits_or_the_reader_does_not_repeat_the_sender():
    assert learn_rule((1,) + SENDER + HEADER, SENDER + HEADER) is None  # the base version already fits
    assert learn_rule(tuple(range(500, 560)), SENDER + HEADER) is None  # other text before the reply
    far = (1,) + SENDER + tuple(range(300, 380))  # 80 ids between: not a framing
    assert learn_rule(far, SENDER + HEADER) is None
    assert learn_rule(SENDER, SENDER[: ALIGN_IDS - 1]) is None  # too little known of the sender


FRAMED = mechanics(audit_every=0)  # copies on (tests/conftest.py, MECHANICS)
QUESTION = "Sam has twelve apples and eats three of them. How many apples are left now, after lunch?"
REPLIES = ["Twelve minus three is nine, so Sam has nine apples left. The final number is 9.",
           "Three eaten of twelve leaves nine apples on the table. The final number is nine."]


def _reader(system: str, question: str, reply: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question},
            {"role": "user", "content": f"Solver one said:\n{reply}"}]


def _debate(engine, tokenizer, reader_system: str, rounds: int = 2):
    """``rounds`` requests of a sender (s1) and a reader (s2); returns the last of each."""
    for r in range(rounds):
        # the questions differ at their end, so that no run after them has a version that fits
        question = f"{QUESTION} Say it for basket {'XYZ'[r]}."
        reply_ids = tokenizer(REPLIES[r % 2], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sent = engine.replay([{"role": "system", "content": "You are a solver."}, {"role": "user", "content": question}],
                             agent="s1", reply_ids=reply_ids).result
        messages = _reader(reader_system, question, REPLIES[r % 2])
        read = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id])
    return sent, read, messages


def test_the_first_reader_reuses_the_reply_its_sender_computed_in_its_framing_exactly(model, tokenizer):
    """Request 1 teaches the framing (the reader computes the reply); in request 2 the sender
    computes its reply after that framing once, and the reader reuses it instead of computing it.
    The reader's text before the reply is the sender's here, so the reuse is exact: its first
    token's logits are dense's."""
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    unframed = KVCommEngine(model, tokenizer, config=mechanics(
        audit_every=0, reply_copies=False, text_copies=False))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    sent, read, messages = _debate(engine, tokenizer, "You are a solver.")
    assert sent.stats.framed_versions == 1 and sent.stats.framed_s > 0
    gates = {d.segment.kind: d.gate for d in read.result.stats.shared_decisions}
    assert gates[("s1", "assistant")].offsets == "framed", read.result.stats.shared_decisions
    _, read_unframed, _ = _debate(unframed, tokenizer, "You are a solver.")
    assert read.result.stats.reused_tokens > read_unframed.result.stats.reused_tokens
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="s2"),
                               atol=tol(1e-4), rtol=0)


def test_the_default_feeds_no_copies_and_a_user_may_switch_them_on(model, tokenizer):
    """Copies move a reader's prefill into its sender's turn (the graph ends later on one
    device), so the default feeds none: the same debate with ``reply_copies=True`` does."""
    default = KVCommEngine(model, tokenizer)
    sent, read, _ = _debate(default, tokenizer, "You are a solver.")
    assert sent.stats.framed_versions == 0 and sent.stats.forwarded.copies == 0
    assert all(d.gate is None or d.gate.offsets != "framed" for d in read.result.stats.shared_decisions)
    assert not KVCommConfig().reply_copies and not KVCommConfig().text_copies
    switched_on = KVCommEngine(model, tokenizer, config=KVCommConfig(reply_copies=True))
    sent_on, _, _ = _debate(switched_on, tokenizer, "You are a solver.")
    assert sent_on.stats.framed_versions >= 1 and sent_on.stats.forwarded.copies > 0


def test_no_reply_copy_for_a_reader_served_re_rotated(model, tokenizer):
    """A framing's readers are remembered with it; once re-rotation is measured within the KL
    budget for every one of them, the sender feeds no copy of its reply for that framing (the
    reader would reuse the reply re-rotated and never read it). A reader that is not trusted
    keeps its copy."""
    trusting = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=0.05))
    _debate(trusting, tokenizer, "You are a solver.")
    (rule,) = trusting._framer.reply_framing.rules("s1")
    assert trusting._framer.reply_framing.readers("s1", rule) == ("s2",)
    for kl in (0.001, 0.002):  # two samples within the budget: the pool trusts re-rotation for s2
        trusting.anchors.tracker.record_rerotated("s2", kl)
    sent, read, _ = _debate(trusting, tokenizer, "You are a solver.", rounds=1)
    assert sent.stats.framed_versions == 0 and sent.stats.forwarded.copies == 0
    # the same debate again: the reader finds its whole prompt as an exact prefix, copy or not
    assert read.result.stats.mode == "prefix"
    over = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=0.05))
    _debate(over, tokenizer, "You are a solver.")
    for kl in (0.2, 0.3):  # measured over the budget: the copy stays
        over.anchors.tracker.record_rerotated("s2", kl)
    sent_over, _, _ = _debate(over, tokenizer, "You are a solver.", rounds=1)
    assert sent_over.stats.framed_versions >= 1 and sent_over.stats.forwarded.copies > 0


def test_a_reader_with_another_system_text_still_gains_on_re_rotation(model, tokenizer):
    """Where the reader's system text differs from the sender's, the framed version is the
    nearest one there is (same lead-in, same question): it is reused, and the reader's first
    token drifts from dense less than under re-rotation only."""
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    rerotate = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate", audit_every=0))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    _, read, messages = _debate(engine, tokenizer, "You are the second solver of the team.")
    gates = {d.segment.kind: d.gate for d in read.result.stats.shared_decisions}
    assert gates[("s1", "assistant")].offsets == "framed"
    _, _, _ = _debate(rerotate, tokenizer, "You are the second solver of the team.")
    reference = first_logits(dense, messages, agent="s2")
    assert first_token_kl(reference, read.first_token_logits) < first_token_kl(
        reference, first_logits(rerotate, messages, agent="s2"))


def test_nothing_is_framed_when_switched_off_or_inside_frozen_anchors(model, tokenizer):
    off = KVCommEngine(model, tokenizer, config=mechanics(
        audit_every=0, reply_copies=False, text_copies=False))
    sent, read, _ = _debate(off, tokenizer, "You are a solver.")
    assert sent.stats.framed_versions == 0
    on = KVCommEngine(model, tokenizer, config=FRAMED)  # on, but a call opted out of reuse stays dense's
    _debate(on, tokenizer, "You are a solver.", rounds=1)
    reply_ids = tokenizer(REPLIES[1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    opted = on.replay([{"role": "system", "content": "You are a solver."}, {"role": "user", "content": QUESTION}],
                      agent="s1", reply_ids=reply_ids, reuse=False).result
    assert opted.stats.framed_versions == 0
    assert "framed" not in [d.gate.offsets for d in read.result.stats.shared_decisions if d.gate]
    frozen = KVCommEngine(model, tokenizer, config=FRAMED)
    _debate(frozen, tokenizer, "You are a solver.", rounds=1)
    with frozen.freeze_anchors():
        sent, _, _ = _debate(frozen, tokenizer, "You are a solver.", rounds=1)
    assert sent.stats.framed_versions == 0


@pytest.mark.parametrize("when_cheaper", [True, False])
def test_reply_copies_measured_dearer_than_the_prefill_they_spare_are_not_fed(model, tokenizer, when_cheaper):
    """A reply copy's measured seconds per copy id are weighed against the engine's prefill per
    id (kvcomm_agents.framing.cost): once they cost more, the sender feeds none and the reader
    computes the reply itself, its first token still dense's; with ``copies_when_cheaper=False``
    they are fed whatever they cost. The rates are set at the ledger (this test's prompts are
    too short to be measured)."""
    engine = KVCommEngine(model, tokenizer, config=mechanics(audit_every=0, copies_when_cheaper=when_cheaper))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    _debate(engine, tokenizer, "You are a solver.", rounds=1)  # the framing learned
    cost = engine._framer.copy_cost
    assert cost.pays("reply")  # not measured yet: copies fed (test_the_first_reader_reuses_...)
    for _ in range(cost.min_samples):
        cost.record_prefill(1000, 1.0)
        cost.record_copies("reply", 1000, 1.5)
    assert not cost.pays("reply") and cost.pays("text")
    sent, read, messages = _debate(engine, tokenizer, "You are a solver.", rounds=2)  # round 2: a new question
    gates = {d.segment.kind: d.gate for d in read.result.stats.shared_decisions}
    if when_cheaper:
        assert sent.stats.framed_versions == 0 and sent.stats.forwarded.copies == 0
        assert gates.get(("s1", "assistant")) is None or gates[("s1", "assistant")].offsets != "framed"
    else:
        assert sent.stats.framed_versions == 1 and gates[("s1", "assistant")].offsets == "framed"
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="s2"),
                               atol=tol(1e-4), rtol=0)


def test_reply_copies_riding_on_generated_steps_are_measured_against_plain_steps(model, tokenizer):
    """A generated reply's steps are timed: a call without copies gives plain steps, a call
    feeding reply copies one sample of (copy ids, seconds beyond as many plain steps), weighed
    when plain steps are first seen if it came before them; a replay's one-forward pass gives
    none (its cost is not a decode's)."""
    engine = KVCommEngine(model, tokenizer, config=FRAMED.model_copy(update={"draft_tokens": 0}))  # a drafted forward is no plain step
    cost = engine._framer.copy_cost
    _debate(engine, tokenizer, "You are a solver.", rounds=1)  # replays: no steps timed
    assert not cost._steps and not cost._copies["reply"]
    def sender(basket):
        return [{"role": "system", "content": "You are a solver."},
                {"role": "user", "content": f"{QUESTION} Say it for basket {basket}."}]

    early = engine.chat(sender("P"), agent="s1", max_new_tokens=24)  # before any plain step
    assert early.stats.forwarded.copies > 0 and not cost._copies["reply"]  # kept until a baseline
    plain = engine.chat([{"role": "system", "content": "You are a judge."}, {"role": "user", "content": "Hello there."}],
                        agent="judge", max_new_tokens=6)
    assert len(cost._steps) == plain.stats.generated_tokens - 1  # the first token comes from the prefill
    assert [n for n, _ in cost._copies["reply"]] == [early.stats.forwarded.copies]  # weighed now
    framed = engine.chat(sender("Q"), agent="s1", max_new_tokens=24)
    assert framed.stats.framed_versions >= 1 and framed.stats.forwarded.copies > 0
    (_, _), (copy_ids, seconds) = cost._copies["reply"]
    assert copy_ids == framed.stats.forwarded.copies and seconds >= 0


@pytest.mark.parametrize("chunk, budget", [(1, None), (16, None), (16, 4000)],
                         ids=["every-step", "chunks", "replay-windows"])
def test_the_sender_decodes_as_without_framing_and_its_decoded_reply_is_copied_exactly(model, tokenizer, chunk,
                                                                                     budget, monkeypatch):
    """The framed copies share the sender's forwards and cache, masked apart: the sender's
    replayed logits and its greedy decode are those of an engine without framing, and the copy
    of a reply decoded with ``chat`` (one copy token per decode step) holds the offsets a dense
    pass over its framing gives. Copies fed with every decode step (CUDA) or 16 tokens at a
    time, the rest after the reply (CPU): the 24-token decode takes both paths. With a small
    mask budget a replay's teacher-forced pass goes in windows."""
    monkeypatch.setattr("kvcomm_agents.framing.framer.copy_chunk", lambda device: chunk)
    if budget is not None:
        monkeypatch.setattr(hf, "MASK_BUDGET", budget)
    framed = KVCommEngine(model, tokenizer, config=FRAMED)
    plain = KVCommEngine(model, tokenizer, config=mechanics(
        audit_every=0, reply_copies=False, text_copies=False))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    for engine in (framed, plain):
        _debate(engine, tokenizer, "You are a solver.", rounds=1)
    question = f"{QUESTION} Say it for basket Q."
    sender = [{"role": "system", "content": "You are a solver."}, {"role": "user", "content": question}]
    reply_ids = tokenizer(REPLIES[1], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    with_copies = framed.replay(sender, agent="s1", reply_ids=reply_ids)
    assert with_copies.result.stats.framed_versions == 1
    torch.testing.assert_close(with_copies.logits, plain.replay(sender, agent="s1", reply_ids=reply_ids).logits,
                               atol=tol(1e-4), rtol=0)
    decoded = framed.chat(sender + [{"role": "user", "content": "Again, in other words."}], agent="s1",
                          max_new_tokens=24)
    reference = plain.chat(sender + [{"role": "user", "content": "Again, in other words."}], agent="s1",
                           max_new_tokens=24)
    assert decoded.token_ids == reference.token_ids and decoded.stats.framed_versions == 1
    # the decoded reply's framed copy is what a dense pass over its framing computes
    segment = framed.store.get(decoded.segment.id)
    (rule,) = framed._framer.reply_framing.rules("s1")
    prompt = render_prompt(tokenizer, sender + [{"role": "user", "content": "Again, in other words."}]).ids
    keep = prompt.numel() - rule.drop
    ids = torch.cat([prompt[:keep], torch.tensor(rule.lead_in), torch.tensor(segment.token_ids)])
    start = keep + len(rule.lead_in)
    with torch.inference_mode():
        pre = hf.prefill(model, ids, torch.arange(ids.numel()))
        real = hf.kv_at_positions(pre.cache, pre.slot_positions, torch.arange(start, ids.numel()))
        keys, values = offsets(real, segment.kv, start, 0, framed.info.rotator)
    pool = framed.anchors.pool(("s1", "assistant"))
    slot = pool.slot_of(segment.id)
    stack = pool.placeholder[framed_receiver(0)]
    n = segment.num_tokens
    torch.testing.assert_close(stack.slot(slot)[0][:, :, :n], keys, atol=tol(2e-4), rtol=0)
    torch.testing.assert_close(stack.slot(slot)[1][:, :, :n], values, atol=tol(2e-4), rtol=0)


def test_a_reply_found_twice_teaches_the_framing_of_its_last_occurrence():
    """Solvers that copy each other: a reply equal to an earlier one is found at the earlier
    one's place too. The framing is learned where the prompt holds it last (the reader pastes
    the newest reply last), not before the earlier copy."""
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=SENDER + HEADER)
    early, late = (60, 61, 62), (70, 71, 72)
    ids = (1,) + SENDER + early + tuple(range(6)) + SENDER[-ALIGN_IDS:] + late + tuple(range(6))
    first = 1 + len(SENDER) + len(early)
    second = first + 6 + ALIGN_IDS + len(late)
    plan = CallPlan(torch.tensor(ids), observations=(Observation(seg, first, 0, 6), Observation(seg, second, 0, 6)))
    book = ReaderFraming()
    assert book.learn(plan) == 1
    assert book.rules(KIND[0]) == [FramingRule(drop=len(HEADER), lead_in=late)]


def test_two_senders_with_the_same_reply_each_serve_their_own_place(model, tokenizer):
    """Two solvers reply alike (same text, same ids): text is matched to one segment per text,
    the most recent, so the first solver's place in the reader's prompt is found as the second
    solver's reply, whose framed version does not fit there. The planner takes the twin whose
    version fits: both places are reused from their own sender's framed copy."""
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    reply_ids = tokenizer(REPLIES[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for r in range(2):
        question = f"{QUESTION} Say it for basket {'XY'[r]}."
        first = [{"role": "system", "content": "You are a solver."}, {"role": "user", "content": question}]
        engine.replay(first, agent="s1", reply_ids=reply_ids)
        second = first + [{"role": "user", "content": f"Solver one said:\n{REPLIES[0]}"}]
        engine.replay(second, agent="s2", reply_ids=reply_ids)
        reader = second + [{"role": "user", "content": f"Solver two said:\n{REPLIES[0]}"}]
        read = engine.replay(reader, agent="s3", reply_ids=[tokenizer.eos_token_id])
    decisions = [d for d in read.result.stats.shared_decisions if d.segment.kind[1] == "assistant"]
    assert [d.segment.kind[0] for d in decisions] == ["s1", "s2"], decisions
    assert [d.gate.offsets for d in decisions] == ["framed", "framed"], decisions


@pytest.mark.embedded
def test_a_reply_the_model_split_into_other_ids_is_still_reused_from_its_framed_version(merging):
    """A sender generates a word in ids the tokenizer would not make (``'ta', 'ble'``); the
    reader pastes the reply's text, read back as ``'table'``: its reused runs leave a gap there
    (computed). The text before every run is still the sender's copy's, so the framed version
    serves all of them (runs compared through the gap as text, kvcomm_agents.versions.token_texts), the
    first token stays closer to dense than re-rotation only's, and with ids compared the reply is
    judged new (mutation check)."""
    model, tokenizer = merging
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    rerotate = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate", audit_every=0))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    text = f"{REPLIES[1]} {REPLIES[0]}"  # runs of at least min_match_tokens on both sides
    cut = text.index("table") + 2
    split = ids(text[:cut]) + ids(text[cut:])
    assert split != ids(text) and tokenizer.decode(split) == text  # the premise
    for r, reply_ids in enumerate([ids(REPLIES[0]), split]):
        question = f"{QUESTION} Say it for basket {'XY'[r]}."
        sender = [{"role": "system", "content": "You are a solver."}, {"role": "user", "content": question}]
        messages = _reader("You are a solver.", question, tokenizer.decode(reply_ids))
        reads = []
        for each in (engine, rerotate):
            each.replay(sender, agent="s1", reply_ids=reply_ids + [tokenizer.eos_token_id])
            reads.append(each.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]))
        read, rerotated = reads
    decision = next(d for d in read.result.stats.shared_decisions if d.segment.kind == ("s1", "assistant"))
    assert decision.status == "reused" and decision.gate.offsets == "framed", decision
    spans = [s for s in read.result.stats.reused_spans if decision.span[0] <= s[0] < decision.span[1]]
    assert len(spans) >= 2, spans  # runs on both sides of the gap
    reference = first_logits(dense, messages, agent="s2")
    kl = first_token_kl(reference, read.first_token_logits)
    assert kl < first_token_kl(reference, rerotated.first_token_logits), kl
    engine.versions.token_texts = None  # mutation check: compared as ids, the runs are not one text
    again = engine.replay(messages, agent="s3", reply_ids=[tokenizer.eos_token_id]).result.stats
    after = next(d for d in again.shared_decisions if d.segment.kind == ("s1", "assistant"))
    assert after.gate is None or after.gate.offsets != "framed", after


@pytest.mark.parametrize("mask_budget", [None, 4096], ids=["one-forward", "windows"])
def test_a_reply_generated_over_estimated_prompt_kv_is_copied_over_the_audits_dense_prefill(model, tokenizer,
                                                                                            monkeypatch, mask_budget):
    """A sender whose prompt reuses a document with estimated offsets feeds no copies while it
    decodes (they would carry the estimate); its audit's dense prefill of the same ids is exact,
    so the copies are fed there after the call (Framer.after_audit) and the reader finds the
    reply computed in its framing: it reuses it, its first token near dense's. Without that step
    the reader finds no version of the reply and computes it (mutation check). With a small mask
    budget the copies are fed in several forwards, with the same outcome."""
    from kvcomm_agents.framing.framer import Framer

    if mask_budget is not None:
        monkeypatch.setattr(hf, "MASK_BUDGET", mask_budget)

    doc = ("Notes: apples are counted in whole numbers; eating an apple removes it from the basket "
           "for good, and nothing else changes the count.")

    replies = REPLIES + ["Nine apples are left once three of the twelve are eaten. The final number is 9."]

    def run(engine):
        for r, text in enumerate(replies):  # three requests, each reply new
            question = f"{QUESTION} Say it for basket {'XYZ'[r]}."
            reply_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            shared = [{"role": "system", "content": "You are a solver."}, {"role": "user", "content": question},
                      {"role": "user", "content": doc}]
            sent = engine.replay(shared, agent="s1", reply_ids=reply_ids).result
            messages = shared + [{"role": "user", "content": f"Solver one said:\n{text}"}]
            read = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id])
        return sent, read, messages

    config = mechanics(audit_every=1, kl_budget=None)
    sent, read, messages = run(KVCommEngine(model, tokenizer, config=config))
    doc_decision = sent.stats.shared_decisions[0]
    assert doc_decision.status == "reused" and doc_decision.gate.offsets not in ("base", "recorded", "framed")
    assert sent.stats.audit_kl is not None and sent.stats.framed_versions >= 1
    reply = next(d for d in read.result.stats.shared_decisions if d.segment.kind == ("s1", "assistant"))
    assert reply.status == "reused" and reply.gate.offsets == "framed", reply
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    assert first_token_kl(first_logits(dense, messages, agent="s2"), read.first_token_logits) < 1e-4
    reused = read.result.stats.reused_tokens
    monkeypatch.setattr(Framer, "after_audit", lambda self, *args, **kwargs: (0, 0.0))
    _, read, _ = run(KVCommEngine(model, tokenizer, config=config))
    reply = next(d for d in read.result.stats.shared_decisions if d.segment.kind == ("s1", "assistant"))
    assert reply.gate is None or reply.gate.offsets != "framed", reply
    assert read.result.stats.reused_tokens < reused
