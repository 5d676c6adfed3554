"""Shared prompt text computed by its first reader in each later reader's framing
(kvcomm_agents.framing.texts): the rule learned from ids, the copy fed in the sender's forwards
after the reader's exact prefix, and the later reader's first token equal to dense's."""

from __future__ import annotations

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.framing import framer as framer_module

from .conftest import first_logits, tol
from .conftest import mechanics

FRAMED = mechanics(audit_every=0)  # copies on (tests/conftest.py, MECHANICS)
OFF = mechanics(audit_every=0, text_copies=False)
SENDER_SYSTEM = "You are the planner of a small team. Read the task and write a short plan."
READER_SYSTEM = "You are the reviewer of the team. Read the task, then check the plan line by line."
TASK = ("{} Write a function that returns the sum of the even numbers in a list of integers, "
        "ignoring negative values and keeping the original order of the list.")
PLAN = "First filter the list, then add the even values, then return the total as an integer."


def _pipeline(engine, tokenizer, requests: int = 2, reader_reads_plan: bool = False, first: int = 0):
    """``requests`` hand-offs (tasks ``first``, ``first + 1``, ...) of a planner (sender) and a reviewer (reader) that both read the
    task after their own system text; returns the last planner result and reviewer replay."""
    plan_ids = tokenizer(PLAN, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for r in range(requests):
        task = TASK.format(("Zebra", "Quail", "Otter", "Moose")[first + r])
        sent = engine.replay([{"role": "system", "content": SENDER_SYSTEM}, {"role": "user", "content": task}],
                             agent="planner", reply_ids=plan_ids).result
        messages = [{"role": "system", "content": READER_SYSTEM}, {"role": "user", "content": task}]
        if reader_reads_plan:
            messages.append({"role": "user", "content": f"The plan:\n{PLAN}"})
        read = engine.replay(messages, agent="reviewer", reply_ids=[tokenizer.eos_token_id])
    return sent, read, messages


def _user_gate(read):
    return [d.gate.offsets for d in read.result.stats.shared_decisions if d.segment.kind == ("user", None) and d.gate]


def test_the_later_reader_reuses_the_task_its_first_reader_computed_after_its_prefix_exactly(model, tokenizer):
    """Request 1 teaches the rule (the reviewer reads the planner's task after its own system
    text); in request 2 the planner feeds a copy of the new task after the reviewer's prefix with
    its replay, and the reviewer reuses it: its first token's logits are dense's."""
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    sent, read, messages = _pipeline(engine, tokenizer)
    assert sent.stats.framed_versions == 1 and sent.stats.framed_s > 0
    assert _user_gate(read) == ["framed"], read.result.stats.shared_decisions
    off = KVCommEngine(model, tokenizer, config=OFF)
    _, read_off, _ = _pipeline(off, tokenizer)
    assert read.result.stats.reused_tokens > read_off.result.stats.reused_tokens
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="reviewer"),
                               atol=tol(1e-4), rtol=0)


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "riding"])
@pytest.mark.parametrize("budget", [None, 3000])
def test_the_sender_is_unchanged_and_a_decoded_senders_copy_matches_dense(model, tokenizer, budget, alone,
                                                                          monkeypatch):
    """Computed alone after the reply (a CPU) or riding on the sender's forwards in the same
    cache, masked apart (CUDA): the sender's greedy decode is that of an engine without copies;
    the reviewer, whose prompt also holds the plan (a framed reply copy fed beside the sender),
    reads the task exactly as dense computes it. With a small mask budget a riding copy's rest
    is fed after the reply in several forwards."""
    if budget is not None:
        monkeypatch.setattr(hf, "MASK_BUDGET", budget)
    monkeypatch.setattr(framer_module, "texts_alone", lambda device: alone)
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    off = KVCommEngine(model, tokenizer, config=OFF)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    for e in (engine, off):
        _pipeline(e, tokenizer, requests=1, reader_reads_plan=True)
    task = TASK.format("Heron")
    sender = [{"role": "system", "content": SENDER_SYSTEM}, {"role": "user", "content": task}]
    with_copies = engine.chat(sender, agent="planner", max_new_tokens=12)
    without = off.chat(sender, agent="planner", max_new_tokens=12)
    assert with_copies.text == without.text
    assert with_copies.stats.framed_versions >= 1
    messages = [{"role": "system", "content": READER_SYSTEM}, {"role": "user", "content": task}]
    read = engine.replay(messages, agent="reviewer", reply_ids=[tokenizer.eos_token_id])
    assert _user_gate(read) == ["framed"]
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="reviewer"),
                               atol=tol(1e-4), rtol=0)


def test_no_copy_without_the_readers_prefix_or_when_switched_off(model, tokenizer):
    """A reader's prefix evicted from the exact-prefix store costs the copy (speed), never
    correctness; switched off, nothing is copied."""
    off = KVCommEngine(model, tokenizer, config=OFF)
    sent, read, _ = _pipeline(off, tokenizer)
    assert sent.stats.framed_versions == 0 and "framed" not in _user_gate(read)
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    _pipeline(engine, tokenizer, requests=1)
    engine.store.clear()
    sent, read, _ = _pipeline(engine, tokenizer, requests=1)
    assert sent.stats.framed_versions == 0


@pytest.mark.parametrize("when_cheaper", [True, False])
@pytest.mark.parametrize("alone", [True, False], ids=["alone", "riding"])
def test_copies_measured_dearer_than_the_prefill_they_spare_are_not_fed(model, tokenizer, when_cheaper, alone,
                                                                        monkeypatch):
    """Computed alone (a CPU) or riding on the sender's steps (CUDA), the copies' measured
    seconds per text id are weighed against the engine's prefill per id
    (kvcomm_agents.framing.cost): once they cost more, the planner feeds none and the reviewer
    computes the task itself, its first token still dense's; with ``copies_when_cheaper=False``
    they are fed whatever they cost. The rates are set at the ledger (this test's prompts are
    too short to be measured)."""
    monkeypatch.setattr(framer_module, "texts_alone", lambda device: alone)
    engine = KVCommEngine(model, tokenizer, config=mechanics(audit_every=0, copies_when_cheaper=when_cheaper))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    _pipeline(engine, tokenizer, requests=1)  # the rule learned
    cost = engine._framer.copy_cost
    assert cost.pays("text")  # not measured yet: copies fed (test_the_later_reader_reuses_...)
    for _ in range(cost.min_samples):
        cost.record_prefill(1000, 1.0)
        cost.record_copies("text", 1000, 1.5)
    assert not cost.pays("text")
    sent, read, messages = _pipeline(engine, tokenizer, requests=1, first=1)
    if when_cheaper:
        assert sent.stats.framed_versions == 0 and "framed" not in _user_gate(read), read.result.stats.shared_decisions
    else:
        assert sent.stats.framed_versions == 1 and _user_gate(read) == ["framed"]
    torch.testing.assert_close(read.first_token_logits, first_logits(dense, messages, agent="reviewer"),
                               atol=tol(1e-4), rtol=0)


def test_copies_computed_alone_are_measured_on_the_engines_own_calls(model, tokenizer, monkeypatch):
    """A call that feeds text copies alone records what they cost per text id; prefills of at
    least MIN_PREFILL_IDS ids record the engine's rate (here: lowered to this test's prompts)."""
    from kvcomm_agents.framing import cost as cost_module

    monkeypatch.setattr(framer_module, "texts_alone", lambda device: True)
    monkeypatch.setattr(cost_module, "MIN_PREFILL_IDS", 1)
    engine = KVCommEngine(model, tokenizer, config=FRAMED)
    sent, _, _ = _pipeline(engine, tokenizer, requests=2)
    cost = engine._framer.copy_cost
    assert sent.stats.framed_versions == 1 and len(cost._copies["text"]) == 1  # request 2's copy
    (text_ids, seconds), = cost._copies["text"]
    assert 0 < text_ids < sent.stats.prompt_tokens and seconds > 0
    assert [n > 0 and s > 0 for n, s in cost._prefills] == [True] * 4  # every call's prefill


def test_copies_riding_on_generated_steps_are_measured_against_plain_steps(model, tokenizer, monkeypatch):
    """Text copies riding on the sender's decode steps (CUDA) are measured as reply copies are:
    a call without copies gives plain steps; the planner's generated call feeding the task's
    copy gives one sample of (its text ids, seconds beyond as many plain steps)."""
    monkeypatch.setattr(framer_module, "texts_alone", lambda device: False)
    engine = KVCommEngine(model, tokenizer, config=FRAMED.model_copy(update={"draft_tokens": 0}))  # a drafted forward is no plain step
    cost = engine._framer.copy_cost
    _pipeline(engine, tokenizer, requests=1)  # replays: the rule learned, no steps timed
    assert not cost._steps and not cost._copies["text"]
    plain = engine.chat([{"role": "user", "content": "Hello there."}], agent="greeter", max_new_tokens=6)
    assert len(cost._steps) == plain.stats.generated_tokens - 1 >= cost.min_samples
    task = TASK.format("Quail")
    sent = engine.chat([{"role": "system", "content": SENDER_SYSTEM}, {"role": "user", "content": task}],
                       agent="planner", max_new_tokens=8)
    assert sent.stats.framed_versions == 1 and not cost._copies["reply"]
    (text_ids, seconds), = cost._copies["text"]
    assert 0 < text_ids < sent.stats.prompt_tokens and seconds >= 0
