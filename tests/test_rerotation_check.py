"""Re-rotation measured on calls without estimates (kvcomm_agents.rerotation_check), and what the
gate and the text copies do once it is within the KL budget (kvcomm_agents.anchors.tracker)."""

from __future__ import annotations

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.anchors.tracker import OffsetTracker
from kvcomm_agents.fidelity import first_token_kl

from .conftest import first_logits
from .test_text_framing import PLAN, READER_SYSTEM, SENDER_SYSTEM, TASK
from .conftest import mechanics


def test_the_tracker_trusts_re_rotation_only_with_enough_samples_within_a_budget():
    tracker = OffsetTracker(min_samples=2, window=3, clear_margin=0.25)  # rerotation_trust="clear_sample"
    assert tracker.wants_rerotation_sample("r") and tracker.rerotation_samples("r") == []
    tracker.record_rerotated("r", 0.01)
    assert not tracker.rerotation_within_budget("r", 0.02)  # one sample is not enough within the budget,
    assert tracker.rerotation_within_budget("r", 0.04)  # but is at a quarter of it or less (clear_margin)
    tracker.record_rerotated("r", 0.03)
    assert not tracker.wants_rerotation_sample("r") and tracker.rerotation_samples("r") == [0.01, 0.03]
    assert tracker.rerotation_within_budget("r", 0.02) and not tracker.rerotation_within_budget("r", 0.019)
    assert not tracker.rerotation_within_budget("r", None)  # no budget: the gate alone decides
    assert tracker.rerotation_within_budget("other", 1.0)  # none of its own: the pool speaks for it
    for _ in range(3):
        tracker.record_rerotated("r", 0.5)  # the window keeps the most recent: trust is lost
    assert not tracker.rerotation_within_budget("r", 0.1)
    tracker.clear()
    assert tracker.rerotation_samples("r") == []


def test_re_rotation_is_trusted_on_every_receivers_samples_unless_the_receivers_own_disagree():
    tracker = OffsetTracker(min_samples=2, clear_margin=0.25)
    tracker.record_rerotated("a", 0.02)
    assert not tracker.rerotation_within_budget("a", 0.05)  # one sample in all, not far under the budget
    tracker.record_rerotated("b", 0.02)
    assert tracker.rerotation_within_budget("a", 0.05) and tracker.rerotation_within_budget("b", 0.05)
    assert tracker.rerotation_within_budget("c", 0.05)  # none of its own: the pool speaks for it
    tracker.record_rerotated("c", 0.2)
    assert not tracker.rerotation_within_budget("c", 0.05)  # its own sample is over the budget
    assert not tracker.rerotation_within_budget("a", 0.05)  # and pulls the pool's mean over it (0.08)
    assert tracker.rerotation_within_budget("a", 0.1)


def _task(r: int) -> str:
    return TASK.format(("Zebra", "Quail", "Otter", "Moose", "Heron", "Ibis")[r])


def _sender(task: str) -> list[dict]:
    return [{"role": "system", "content": SENDER_SYSTEM}, {"role": "user", "content": task}]


def _reader(task: str) -> list[dict]:
    return [{"role": "system", "content": READER_SYSTEM}, {"role": "user", "content": task},
            {"role": "user", "content": f"The plan:\n{PLAN}"}]


def _hand_off(engine, tokenizer, r: int):
    plan_ids = tokenizer(PLAN, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    engine.replay(_sender(_task(r)), agent="planner", reply_ids=plan_ids)
    return engine.replay(_reader(_task(r)), agent="reviewer", reply_ids=[tokenizer.eos_token_id])


def test_the_check_measures_what_re_rotation_alone_would_have_served(model, tokenizer):
    """The reviewer's first call computes the task (a new anchor, no estimate); the check then
    records the KL a re-rotation-only engine's same call has against dense, and charges its
    forward to the call."""
    engine = KVCommEngine(model, tokenizer, config=mechanics(text_copies=False, reply_copies=False))
    rerotate = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate", dense_when_cheaper=False,
                                                                  audit_every=0))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    read = _hand_off(engine, tokenizer, 0)
    rerotated = _hand_off(rerotate, tokenizer, 0)
    assert read.result.stats.forwarded.audit > 0  # the check's prefill, charged to the call
    kl = engine.anchors.tracker.rerotation_samples("reviewer")[-1]
    expected = first_token_kl(first_logits(dense, _reader(_task(0)), agent="reviewer"), rerotated.first_token_logits)
    assert rerotated.result.stats.reused_tokens > 0 and expected > 0
    assert abs(kl - expected) <= 1e-4 + 0.05 * expected


def test_a_receiver_within_the_budget_is_served_re_rotated_and_its_text_copies_stop(model, tokenizer):
    """Two checks within a generous budget: the next call's task (which the gate would compute
    as a new anchor) is reused re-rotated, visibly, and the planner feeds no text copy for the
    reviewer. A budget no check meets keeps computing it."""
    trusting = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=50.0, reply_copies=False))
    strict = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=1e-12, reply_copies=False))
    for r in range(2):
        _hand_off(trusting, tokenizer, r)
        _hand_off(strict, tokenizer, r)
    assert trusting.anchors.tracker.rerotation_within_budget("reviewer", 50.0)
    assert not strict.anchors.tracker.rerotation_within_budget("reviewer", 1e-12)
    plan_ids = tokenizer(PLAN, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    sent = trusting.replay(_sender(_task(2)), agent="planner", reply_ids=plan_ids).result
    assert sent.stats.framed_versions == 0  # no copy of the task for a reviewer served re-rotated
    read = trusting.replay(_reader(_task(2)), agent="reviewer", reply_ids=[tokenizer.eos_token_id]).result
    task = [d for d in read.stats.shared_decisions if d.segment.kind == ("user", None) and d.gate]
    assert task and all(d.status == "reused" and d.gate.offsets == "rerotated" for d in task), read.stats.decisions
    strict_sent = strict.replay(_sender(_task(2)), agent="planner", reply_ids=plan_ids).result
    assert strict_sent.stats.framed_versions >= 1  # the same call copies the task for an unmeasured reviewer
    strict_read = strict.replay(_reader(_task(2)), agent="reviewer", reply_ids=[tokenizer.eos_token_id]).result
    assert all(d.gate is None or d.gate.offsets != "rerotated" for d in strict_read.stats.decisions)


def test_a_reply_is_never_served_re_rotated_alone_by_default(model, tokenizer):
    """``experimental.rerotate_replies`` off (the default): within a generous budget the reviewer
    is served the task re-rotated, but the planner's reply, which no version fits, is computed;
    the check measures the prompt so (the reply computed: more audit ids than where replies are
    re-rotated). On, the reply is served re-rotated too (its gate record says so, not "own": the
    receiver's own offsets were refused over the budget)."""
    served, audit_ids = {}, {}
    for rerotate_replies in (False, True):
        engine = KVCommEngine(model, tokenizer, config=mechanics(
            kl_budget=50.0, reply_copies=False, experimental={"rerotate_replies": rerotate_replies}))
        audit_ids[rerotate_replies] = _hand_off(engine, tokenizer, 0).result.stats.forwarded.audit
        assert engine.anchors.tracker.rerotation_within_budget("reviewer", 50.0)
        read = _hand_off(engine, tokenizer, 1).result
        served[rerotate_replies] = {d.segment.kind: d for d in read.stats.shared_decisions if d.gate}
    assert served[False][("user", None)].gate.offsets == "rerotated"
    reply = served[False][("planner", "assistant")]
    assert reply.status == "prefilled" and reply.reason in ("new_anchor", "over_kl_budget"), reply
    assert served[True][("planner", "assistant")].gate.offsets == "rerotated"
    assert audit_ids[False] > audit_ids[True] > 0


def test_one_check_far_under_the_budget_is_enough(model, tokenizer):
    """``rerotation_trust="clear_sample"``: one check at a quarter of the budget or less
    (``clear_margin``) trusts re-rotation at once: the reviewer's next call is served
    re-rotated. One merely within the budget waits for a second sample, and the next call
    computes the task again."""
    from kvcomm_agents import ExperimentalSettings

    clear = ExperimentalSettings(rerotation_trust="clear_sample")
    probe = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=50.0, reply_copies=False))
    _hand_off(probe, tokenizer, 0)
    (kl,) = probe.anchors.tracker.rerotation_samples("reviewer")
    assert kl > 0
    for budget, trusted in ((5 * kl, True), (2 * kl, False)):
        engine = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=budget, reply_copies=False,
                                                                 experimental=clear))
        _hand_off(engine, tokenizer, 0)
        read = _hand_off(engine, tokenizer, 1).result
        task = [d for d in read.stats.shared_decisions if d.segment.kind == ("user", None) and d.gate]
        assert task and any(d.gate.offsets == "rerotated" for d in task) == trusted, (budget, read.stats.decisions)


def test_a_new_reader_served_on_the_pools_samples_is_audited_on_its_first_call(model, tokenizer):
    """With ``experimental.audit_new_readers`` a second reviewer, served the task re-rotated on
    the first reviewer's samples alone, is audited on that first call (dense prefill charged to
    it) and has a sample of its own after it; without, the periodic audit is not due yet."""
    from kvcomm_agents import ExperimentalSettings

    plan_ids = tokenizer(PLAN, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for audit_new in (True, False):
        engine = KVCommEngine(model, tokenizer, config=mechanics(
            kl_budget=50.0, reply_copies=False, experimental=ExperimentalSettings(audit_new_readers=audit_new)))
        for r in range(2):
            _hand_off(engine, tokenizer, r)
        engine.replay(_sender(_task(2)), agent="planner", reply_ids=plan_ids)
        read = engine.replay(_reader(_task(2)), agent="second-reviewer", reply_ids=[tokenizer.eos_token_id]).result
        task = [d for d in read.stats.shared_decisions if d.segment.kind == ("user", None) and d.gate]
        assert task and all(d.gate.offsets == "rerotated" for d in task), read.stats.decisions
        own = engine.anchors.tracker.rerotation_samples("second-reviewer")
        if audit_new:
            assert read.stats.audit_kl is not None and read.stats.forwarded.audit >= read.stats.prompt_tokens
            assert own == [read.stats.audit_kl]
        else:
            assert read.stats.audit_kl is None and own == []


def test_re_rotation_trusted_before_its_samples_is_audited_until_they_are_enough(model, tokenizer):
    """``experimental.rerotation_trust``: "audited" serves the reviewer's first call re-rotated
    with no sample at all and audits it (a dense prefill charged to the call, its KL the first
    sample), and computes the text again once audits put it over the budget; "one_sample" (the
    default) serves the second call re-rotated on the first call's check, even where the check
    is not clear of a quarter of the budget."""
    from kvcomm_agents import ExperimentalSettings

    def engine(trust: str, budget: float):
        return KVCommEngine(model, tokenizer, config=mechanics(
            kl_budget=budget, reply_copies=False, experimental=ExperimentalSettings(rerotation_trust=trust)))

    def task_offsets(read):
        task = [d for d in read.stats.shared_decisions if d.segment.kind == ("user", None) and d.gate]
        assert task, read.stats.decisions
        return {d.gate.offsets for d in task}

    audited = engine("audited", 50.0)
    first = _hand_off(audited, tokenizer, 0).result
    assert task_offsets(first) == {"rerotated"} and first.stats.audit_kl is not None
    assert first.stats.forwarded.audit >= first.stats.prompt_tokens
    assert audited.anchors.tracker.rerotation_samples("reviewer") == [first.stats.audit_kl]
    assert audited.anchors.tracker.rerotation_unconfirmed()  # one sample: the next such call is audited too

    probe = KVCommEngine(model, tokenizer, config=mechanics(kl_budget=50.0, reply_copies=False))
    _hand_off(probe, tokenizer, 0)
    (kl,) = probe.anchors.tracker.rerotation_samples("reviewer")
    one = engine("one_sample", 2 * kl)  # within the budget, not within a quarter of it
    assert "rerotated" not in task_offsets(_hand_off(one, tokenizer, 0).result)  # nothing measured yet: computed
    read = _hand_off(one, tokenizer, 1).result
    assert task_offsets(read) == {"rerotated"} and read.stats.audit_kl is None
    strict = engine("audited", kl / 2)  # the audit finds the first call over the budget: the next computes
    assert task_offsets(_hand_off(strict, tokenizer, 0).result) == {"rerotated"}
    assert "rerotated" not in task_offsets(_hand_off(strict, tokenizer, 1).result)


def test_a_restarted_engine_serves_re_rotated_from_its_first_call_on_what_an_earlier_one_measured(
        model, tokenizer, tmp_path):
    """``remember_measurements``: the first engine's check lands in the folder; a second engine
    on the same model and settings serves the reviewer's first call re-rotated (no second
    computation of the task to measure it again), and writes its own samples after audits. An
    engine remembering nothing computes the task on its first call."""
    config = mechanics(kl_budget=50.0, reply_copies=False, remember_measurements=str(tmp_path))
    first = KVCommEngine(model, tokenizer, config=config)
    _hand_off(first, tokenizer, 0)
    (kl,) = first.anchors.tracker.rerotation_samples("reviewer")
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]
    restarted = KVCommEngine(model, tokenizer, config=config)
    assert restarted.anchors.tracker.pooled_rerotation_samples() == [kl]
    read = _hand_off(restarted, tokenizer, 1).result
    task = [d for d in read.stats.shared_decisions if d.segment.kind == ("user", None) and d.gate]
    assert task and all(d.status == "reused" and d.gate.offsets == "rerotated" for d in task), read.stats.decisions
    forgetful = KVCommEngine(model, tokenizer, config=config.model_copy(update={"remember_measurements": False}))
    read = _hand_off(forgetful, tokenizer, 1).result
    assert all(d.gate is None or d.gate.offsets != "rerotated" for d in read.stats.decisions)


def test_a_reader_trusted_with_re_rotation_still_gets_reply_copies_by_default(model, tokenizer):
    """With reply copies on, the planner's framing learned from a reviewer whose re-rotation is
    trusted stays a rule its replies may be copied for: by default the reviewer would compute
    the reply, and the copy is what spares it that. With replies re-rotated alone too, the copy
    would never be read: the rule is dropped. (A sender whose own prompt holds re-rotated KV
    feeds no copy either way: ``Framer.for_call``.)"""
    for rerotate_replies in (False, True):
        engine = KVCommEngine(model, tokenizer, config=mechanics(
            kl_budget=50.0, text_copies=False, experimental={"rerotate_replies": rerotate_replies}))
        for r in range(2):
            _hand_off(engine, tokenizer, r)
        assert engine.anchors.tracker.rerotation_within_budget("reviewer", 50.0)
        assert engine._framer.reply_framing.rules("planner")  # learned from the reviewer's prompts
        assert bool(engine._framer._rules("planner", 64, 48)) is not rerotate_replies
