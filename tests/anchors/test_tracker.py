"""The offset tracker: its on/off rule on paired samples, and, on both tiny model families, an
engine whose anchors hold harmful offsets turning them off for that receiver and kind after its
audits, so that it serves exactly what re-rotation only serves."""

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.anchors.tracker import OffsetTracker
from kvcomm_agents.fidelity import first_token_kl

from ..conftest import first_logits
from ..conftest import mechanics

USER, REPLY_KIND = ("user", None), ("s1", "assistant")


def test_offsets_stay_on_until_enough_samples_say_they_hurt():
    tracker = OffsetTracker(window=4, min_samples=2)
    assert tracker.offsets_on("s2", USER)
    tracker.record("s2", USER, kl_on=0.5, kl_off=0.1)
    assert tracker.offsets_on("s2", USER)  # one sample is not enough
    tracker.record("s2", USER, kl_on=0.4, kl_off=0.1)
    assert not tracker.offsets_on("s2", USER)
    assert tracker.offsets_on("s3", USER) and tracker.offsets_on("s2", REPLY_KIND)  # per receiver and kind
    for _ in range(4):  # the window forgets the old samples: offsets come back when they help
        tracker.record("s2", USER, kl_on=0.05, kl_off=0.2)
    assert tracker.offsets_on("s2", USER)
    (record,) = tracker.records()
    assert (record.samples, record.offsets_on) == (4, True)
    assert record.mean_kl_on == pytest.approx(0.05) and record.mean_kl_off == pytest.approx(0.2)


def test_audits_go_first_to_the_kinds_with_fewest_samples():
    tracker = OffsetTracker(min_samples=2)
    kinds = [USER, REPLY_KIND]
    assert tracker.wants_audit("s2", kinds) and tracker.kind_to_flip("s2", kinds) == USER
    tracker.record("s2", USER, 0.1, 0.2)
    assert tracker.kind_to_flip("s2", kinds) == REPLY_KIND
    tracker.record("s2", REPLY_KIND, 0.1, 0.2)
    tracker.record("s2", USER, 0.1, 0.2)
    assert tracker.wants_audit("s2", kinds)  # the reply kind has one sample
    tracker.record("s2", REPLY_KIND, 0.1, 0.2)
    assert not tracker.wants_audit("s2", kinds) and tracker.kind_to_flip("s2", []) is None


def test_warmup_audits_come_at_most_once_every_gap_calls():
    tracker = OffsetTracker(min_samples=1, warmup_gap=3)
    assert [tracker.warmup_audit_due("s2", [USER]) for _ in range(3)] == [False, False, True]
    tracker.audited("s2")
    assert [tracker.warmup_audit_due("s2", [USER]) for _ in range(3)] == [False, False, True]
    tracker.audited("s2")
    tracker.record("s2", USER, 0.1, 0.2)  # enough samples: no more warm-up audits
    assert not any(tracker.warmup_audit_due("s2", [USER]) for _ in range(5))


def test_a_kind_over_the_kl_budget_is_held_back_but_for_probes_which_are_audited():
    tracker = OffsetTracker(min_samples=2, probe_every=3)
    # not measured yet: held back but for the probes (faithful until measured)
    assert [tracker.within_budget("s2", USER, 0.01) for _ in range(3)] == [False, False, True]
    assert tracker.within_budget("s2", USER, None)
    tracker.record("s2", USER, kl_on=0.05, kl_off=0.2)
    tracker.record("s2", USER, kl_on=0.03, kl_off=0.2)
    assert tracker.served_kl("s2", USER) == pytest.approx(0.04)  # offsets on: their KL is served
    assert tracker.within_budget("s2", USER, None) and tracker.within_budget("s2", USER, 0.05)
    assert not tracker.wants_audit("s2", [USER])
    assert [tracker.within_budget("s2", USER, 0.01) for _ in range(6)] == [False, False, True] * 2
    assert tracker.wants_audit("s2", [USER])  # the probes are what keeps the measure current
    tracker.record("s2", REPLY_KIND, kl_on=0.001, kl_off=0.2)
    tracker.record("s2", REPLY_KIND, kl_on=0.003, kl_off=0.2)
    assert tracker.within_budget("s2", REPLY_KIND, 0.01)  # per kind
    for _ in range(8):  # probes measured low: back within the budget, no more forced audits
        tracker.record("s2", USER, kl_on=0.001, kl_off=0.2)
    assert tracker.within_budget("s2", USER, 0.01) and not tracker.wants_audit("s2", [USER])


def _prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": "You are solver two."}, {"role": "user", "content": question}]


def test_harmful_offsets_are_turned_off_after_paired_audits(model, tokenizer):
    """Anchors whose offsets were made harmful (scaled 30x) are used at first; the warm-up audits
    measure them against re-rotation only on the same prompts, the tracker turns them off for
    this receiver and kind, and the next call is served exactly as re-rotation only serves it,
    its drift from dense no larger."""
    config = mechanics(gamma=1.0, audit_every=1000, prefix_cache=False, kl_budget=None)  # only warm-up audits
    engine = KVCommEngine(model, tokenizer, config=config)
    engine.anchors.tracker.warmup_gap = 1  # every reused call may be a warm-up audit (default: one in 4)
    rerotate = KVCommEngine(model, tokenizer, config=config.model_copy(update={"method": "rerotate"}))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    # each question shorter than the last, so earlier anchors are long enough to be consulted
    questions = [f"How many apples are left if Sam has {'very ' * (8 - i)}many and eats {i}?" for i in range(7)]

    def ask(question: str):
        for each in (engine, rerotate):
            each.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)  # the sender
        return engine.replay(_prompt(question), agent="s2", reply_ids=[tokenizer.eos_token_id])

    for question in questions[:2]:  # two new anchors for s2
        assert ask(question).result.stats.shared_decisions[0].gate.decision == "new_anchor"
    pool = engine.anchors.pool(USER)
    with torch.inference_mode():
        for keys, values in pool.placeholder["s2"].parts.values():
            keys.mul_(30.0)
            values.mul_(30.0)
    audited = [ask(question).result.stats for question in questions[2:4]]
    for stats in audited:  # reused with the (harmful) estimated offsets, and audited
        (decision,) = stats.shared_decisions
        assert decision.gate.decision == "reuse" and decision.gate.offsets == "estimated"
        assert stats.audit_kl is not None
    # (the questions share their opening words, so s1 reuses token runs of earlier questions too)
    (record,) = [r for r in engine.anchors.tracker.records() if r.receiver == "s2"]
    assert (record.kind, record.samples) == (USER, 2)
    assert record.mean_kl_on > record.mean_kl_off and not record.offsets_on

    replay = ask(questions[4])
    (decision,) = replay.result.stats.shared_decisions
    assert decision.status == "reused" and decision.gate.offsets == "off"
    assert replay.result.stats.audit_kl is None  # enough samples: back to the audit period
    served = replay.first_token_logits
    torch.testing.assert_close(served, first_logits(rerotate, _prompt(questions[4]), agent="s2"), atol=1e-4, rtol=0)
    reference = first_logits(dense, _prompt(questions[4]), agent="s2")
    assert first_token_kl(reference, served) <= record.mean_kl_on


def test_under_a_kl_budget_estimates_wait_for_audits_and_held_back_calls_match_dense(model, tokenizer):
    """With a budget no estimate meets, a receiver's user-kind segments are prefilled (reason
    over_kl_budget, logits equal to dense prefill's) but for one probe in 4, which is reused
    and audited; the probes' samples keep the kind over the budget."""
    config = mechanics(gamma=1.0, audit_every=1000, prefix_cache=False, kl_budget=1e-9)
    engine = KVCommEngine(model, tokenizer, config=config)
    engine.anchors.tracker.warmup_gap = 1
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    questions = [f"How many apples are left if Sam has {'very ' * (12 - i)}many and eats {i}?" for i in range(10)]

    def ask(question: str):
        engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)
        return engine.replay(_prompt(question), agent="s2", reply_ids=[tokenizer.eos_token_id])

    replays = [ask(question) for question in questions]
    reasons = [r.result.stats.shared_decisions[0].reason for r in replays]
    assert reasons[:2] == ["new_anchor"] * 2
    assert reasons[2:] == ["over_kl_budget"] * 3 + ["content"] + ["over_kl_budget"] * 3 + ["content"]
    assert [r.result.stats.audit_kl is not None for r in replays[5::4]] == [True, True]  # the probes
    # the first probe, nothing measured yet: served re-rotated only, its offsets measured by the audit
    assert replays[5].result.stats.shared_decisions[0].gate.offsets == "off"
    rerotate = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate", prefix_cache=False))
    for question in questions[:6]:
        rerotate.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)
    torch.testing.assert_close(replays[5].first_token_logits, first_logits(rerotate, _prompt(questions[5]), agent="s2"),
                               atol=1e-4, rtol=0)
    assert engine.anchors.tracker.served_kl("s2", USER) > 1e-9
    reference = first_logits(dense, _prompt(questions[8]), agent="s2")
    torch.testing.assert_close(replays[8].first_token_logits, reference, atol=1e-4, rtol=0)


def test_probes_are_always_audited_and_the_budget_needs_audits(model, tokenizer):
    tracker = OffsetTracker(min_samples=2, warmup_gap=4, probe_every=2)
    assert not tracker.within_budget("s2", USER, 0.01)  # held back (not measured yet)
    assert tracker.within_budget("s2", USER, 0.01)  # the probe
    assert tracker.unmeasured_probe("s2", USER)  # nothing measured yet: served re-rotated only
    assert tracker.warmup_audit_due("s2", [USER])  # audited on the receiver's first call, whatever the gap
    # without audits nothing would measure the budget: the engine leaves it off
    off = KVCommEngine(model, tokenizer, config=mechanics(audit_every=0))
    assert off.anchors.kl_budget is None
    assert KVCommEngine(model, tokenizer, config=mechanics()).anchors.kl_budget == KVCommConfig().kl_budget == 0.015


def test_own_offsets_recorded_after_other_text_wait_for_the_budget_like_any_estimate(model, tokenizer):
    """A receiver's own offsets of a segment are exact only where they were recorded: after the
    same text, they are a version and always reused; after other text (no version fits) they are
    an estimate, held back by the KL budget until audits measure them (here nothing probes)."""
    engine = KVCommEngine(model, tokenizer, config=mechanics(gamma=1.0, audit_every=1000, prefix_cache=False))
    engine.anchors.tracker.probe_every = 0
    question = "How many apples are left if Sam has very many apples and eats three of them?"
    engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)  # the sender

    def read(system: str):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        (decision,) = engine.replay(messages, agent="s2", reply_ids=[tokenizer.eos_token_id]).result.stats.shared_decisions
        return decision

    assert read("You are solver two.").reason == "new_anchor"  # s2 records its own offsets
    again = read("You are solver two.")  # the same text before it: a version
    assert again.status == "reused" and again.gate.offsets == "own"
    elsewhere = read("Check the arithmetic of every step with great care, then answer.")
    assert elsewhere.status == "prefilled" and elsewhere.reason == "over_kl_budget"
