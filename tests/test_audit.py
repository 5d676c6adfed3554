"""``kvcomm_agents.audit``: which reused calls are audited, the KL an audit reports, the
flipped pass that gives the offset tracker a paired sample, what the dense pass hands to the
capture and what an audit forwards. Plans are built by hand from segments cut out of other
prompts' dense passes: no engine, no planner."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvcomm_agents import KVCommConfig
from kvcomm_agents.anchors import KVCommAnchors
from kvcomm_agents.audit import Audit, CallAuditor
from kvcomm_agents.capture import CallCapture
from kvcomm_agents.engines import hf
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.forwards import ForwardTally, charging
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.plan import CallPlan, ReusedRun
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.support import rotator_from_config

from .conftest import QUESTION, run_plan

SYSTEM = "You are a careful math solver. Answer the question and give the final number."
NOTE = "The quick brown fox jumps over the lazy dog while the agents debate the answer."
QUESTION_KIND, NOTE_KIND = ("user", None), ("document", None)


class Spy:
    """Stands in for the capture: records what :meth:`CallCapture.observe` is given."""

    def __init__(self):
        self.seen = []

    def observe(self, plan, agent, kv_at, anchors=None):
        self.seen.append((plan, agent, kv_at, anchors))


class Freeze:
    """Stands in for the engine's freeze count (``engine.freeze_anchors()``): the anchors are
    frozen while ``active``."""

    active = False


class Prompt:
    """The receiver's prompt (system, question, note) and two plans of it: the question and the
    note reused re-rotated from another prompt, the question's with estimated offsets (applied in
    ``on``, held back in ``off``). Dense, on and off first-token logits differ."""

    def __init__(self, model, tokenizer):
        rotator = rotator_from_config(model.config)
        cutter = CallCapture(SegmentStore(1 << 30), tokenizer, rotator, "audit-test", KVCommConfig())
        self.layout = render_prompt(tokenizer, [{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": QUESTION},
                                                {"role": "user", "content": NOTE}])
        self.ids, self.n = self.layout.ids, self.layout.ids.numel()
        runs = [self._run(model, tokenizer, cutter, index, text, kind)
                for index, (text, kind) in enumerate(((QUESTION, QUESTION_KIND), (NOTE, NOTE_KIND)), 1)]
        config = model.config
        shape = (config.num_hidden_layers - 1, config.num_key_value_heads, runs[0].length, config.head_dim)
        generator = torch.Generator().manual_seed(0)
        offsets = [0.3 * torch.randn(shape, generator=generator) for _ in range(2)]
        estimated = replace(runs[0], key_offsets=offsets[0], value_offsets=offsets[1],
                            verdict=SimpleNamespace(context_matched=False, from_version=False))
        self.on = CallPlan(self.ids, runs=(estimated, runs[1]))
        self.off = CallPlan(self.ids, runs=(replace(estimated, offsets_on=False), runs[1]))
        self.plain = CallPlan(self.ids, runs=tuple(runs))
        self.dense = hf.prefill(model, self.ids, torch.arange(self.n))
        self.on_logits = run_plan(model, rotator, self.on).logits
        self.off_logits = run_plan(model, rotator, self.off).logits

    def _run(self, model, tokenizer, cutter, index, text, kind) -> ReusedRun:
        """Message ``index`` of this prompt served from its KV computed after another system text."""
        other = render_prompt(tokenizer, [{"role": "system", "content": "You are solver two."},
                                          {"role": "user", "content": text}])
        there = other.tokens_within(*other.content_spans[1])
        here = self.layout.tokens_within(*self.layout.content_spans[index])
        ids = other.ids[there.start:there.stop].tolist()
        assert ids == self.layout.ids[here.start:here.stop].tolist() and here.start != there.start
        pre = hf.prefill(model, other.ids, torch.arange(other.ids.numel()))
        segment = cutter.cut(hf.kv_reader(pre.cache, pre.slot_positions), there.start, ids,
                             [None] * len(ids), text, kind)
        return ReusedRun(segment, here.start, 0, len(ids))


@pytest.fixture(scope="module")
def prompt(llama, tokenizer):
    with torch.inference_mode():
        return Prompt(llama, tokenizer)


def auditor_for(model, **config):
    """A CallAuditor with a spy for its capture; its anchors' freeze counter is ``.freeze``.
    Audits are not priced against what reuse spared unless ``audit_share`` is given."""
    config = KVCommConfig(**{"audit_share": None, **config})
    freeze = Freeze()
    anchors = KVCommAnchors.from_config(config, default_max_bytes=1 << 30, freeze=freeze)
    auditor = CallAuditor(model, rotator_from_config(model.config), config, anchors, Spy())
    auditor.freeze = freeze
    return auditor


def audited(auditor, plan, logits, agent="r"):
    """``auditor.audit`` and the tokens it forwarded."""
    tally = ForwardTally()
    with torch.inference_mode(), charging(tally, "audit"):
        audit = auditor.audit(plan, logits, agent)
    assert tally.total == tally.tokens["audit"]
    return audit, tally.total


def test_every_nth_reused_call_is_audited_and_no_dense_call(llama, prompt):
    auditor = auditor_for(llama, method="rerotate", audit_every=3)
    assert auditor.audit(CallPlan(prompt.ids), prompt.dense.logits, "r") is None
    assert auditor.reused_calls == 0  # a dense call does not count towards the period
    due = [isinstance(audited(auditor, prompt.plain, prompt.on_logits)[0], Audit) for _ in range(6)]
    assert due == [False, False, True, False, False, True]
    assert len(auditor.capture.seen) == 2  # only audits observe
    off = auditor_for(llama, method="rerotate", audit_every=0)
    assert [audited(off, prompt.plain, prompt.on_logits)[0] for _ in range(3)] == [None] * 3


def test_every_nth_audit_waits_until_reuse_has_spared_what_it_costs(llama, prompt):
    """``audit_share``: the audits' forwarded ids stay within that share of the prompt ids the
    reused calls spared; a due audit runs on the first call after which it fits."""
    spared = prompt.n - prompt.plain.computed_positions().numel()
    assert 0 < spared < prompt.n
    share = 0.5
    auditor = auditor_for(llama, method="rerotate", audit_every=1, audit_share=share)
    due, forwarded = [], 0
    for call in range(1, 13):
        fits = forwarded + prompt.n <= share * spared * call
        audit, ids = audited(auditor, prompt.plain, prompt.on_logits)
        forwarded += ids
        due.append(audit is not None)
        assert due[-1] == fits  # never ahead of what reuse paid, and never later
        assert forwarded <= share * spared * call
    assert 0 < sum(due) < len(due)
    assert auditor.spared_ids == 12 * spared and auditor.audit_ids == forwarded == sum(due) * prompt.n


def test_an_audit_held_back_runs_on_the_first_call_it_fits_between_periods(llama, prompt):
    """Due on the 3rd reused call but not yet paid for, the audit waits for the first call on
    which it fits (the 5th here), not for the next multiple of ``audit_every``."""
    spared = prompt.n - prompt.plain.computed_positions().numel()
    share = prompt.n / (4.5 * spared)  # one audit fits once 4.5 calls' worth of ids were spared
    auditor = auditor_for(llama, method="rerotate", audit_every=3, audit_share=share)
    due = [audited(auditor, prompt.plain, prompt.on_logits)[0] is not None for _ in range(7)]
    assert due == [False, False, False, False, True, False, False]


def test_warm_up_audits_are_not_held_back_but_charged_to_the_same_account(llama, prompt):
    """A kind that wants samples is audited on its warm-up gap however little reuse spared; the
    every-N-th audit then waits until reuse has paid for both, later than it would have for its
    own cost alone."""
    spared = prompt.n - prompt.plain.computed_positions().numel()
    assert spared == prompt.n - prompt.on.computed_positions().numel()
    probe = auditor_for(llama, method="kvcomm", audit_every=1)
    gap = probe.anchors.tracker.warmup_gap
    share = prompt.n / ((gap + 1) * spared)  # alone, a plain call's audit would fit on call gap + 1
    auditor = auditor_for(llama, method="kvcomm", audit_every=1, audit_share=share)
    warm_up = [audited(auditor, prompt.on, prompt.on_logits) for _ in range(gap)]
    assert [audit is not None for audit, _ in warm_up] == [False] * (gap - 1) + [True]
    forwarded = warm_up[-1][1]
    assert forwarded > prompt.n and auditor.audit_ids == forwarded  # the dense and the flipped pass
    assert forwarded > share * auditor.spared_ids  # it ran on credit
    plain, call = [], gap
    while not any(plain):
        call += 1
        assert call < gap + 50, "the every-N-th audit never ran"
        plain.append(audited(auditor, prompt.plain, prompt.on_logits)[0] is not None)
    first = len(plain)  # the plain call whose audit ran
    assert forwarded + prompt.n <= share * spared * call  # paid for both, then
    assert forwarded + prompt.n > share * spared * (call - 1)  # and not a call sooner
    assert first > 1  # without the warm-up's charge it would have run on the first
    assert auditor.audit_ids == forwarded + prompt.n


def test_an_audit_is_kl_of_dense_against_served_over_one_dense_prefill(llama, prompt):
    """Re-rotation only (``method="rerotate"``): the audit forwards the prompt once, densely, and
    hands that exact pass to the capture as an observation of the reused runs (no anchors)."""
    auditor = auditor_for(llama, method="rerotate", audit_every=1)
    audit, forwarded = audited(auditor, prompt.on, prompt.on_logits)  # offsets in the plan: no flip without kvcomm
    served_kl = first_token_kl(prompt.dense.logits, prompt.on_logits)
    assert first_token_kl(prompt.on_logits, prompt.dense.logits) != pytest.approx(served_kl, rel=1e-4)  # the direction shows
    assert audit.kl == pytest.approx(served_kl, rel=1e-4) and audit.kl > 1e-3
    torch.testing.assert_close(audit.dense.logits, prompt.dense.logits, atol=1e-5, rtol=1e-5)
    assert forwarded == prompt.n and hf.num_cached(audit.dense.cache) == prompt.n
    assert audited(auditor, prompt.on, prompt.dense.logits)[0].kl < 1e-6  # served as dense would: no drift
    plan, agent, kv_at, anchors = auditor.capture.seen[0]
    assert agent == "r" and anchors is None and not plan.runs
    assert [(o.segment, o.prompt_start, o.length) for o in plan.observations] == [
        (r.segment, r.prompt_start, r.length) for r in prompt.on.runs]
    exact = hf.kv_at_positions(prompt.dense.cache, prompt.dense.slot_positions, torch.arange(prompt.n))
    observed = kv_at(torch.arange(prompt.n))
    for layer in range(exact.num_layers):
        torch.testing.assert_close(observed.layer(layer)[0], exact.layer(layer)[0], atol=1e-5, rtol=1e-5)


def test_a_kvcomm_audit_adds_a_paired_sample_from_a_flipped_pass(llama, prompt):
    """KVCOMM: one more reuse prefill with the question's estimated offsets flipped; the tracker
    gets KL(dense || offsets on) and KL(dense || offsets off), whichever way the call was served."""
    auditor = auditor_for(llama, method="kvcomm", audit_every=1)
    kl_on = first_token_kl(prompt.dense.logits, prompt.on_logits)
    kl_off = first_token_kl(prompt.dense.logits, prompt.off_logits)
    assert abs(kl_on - kl_off) > 1e-3
    flipped_pass = prompt.on.computed_positions().numel()
    for agent, plan, served, kl in (("r1", prompt.on, prompt.on_logits, kl_on),
                                    ("r2", prompt.off, prompt.off_logits, kl_off)):
        audit, forwarded = audited(auditor, plan, served, agent)
        assert audit.kl == pytest.approx(kl, rel=1e-4)
        assert forwarded == prompt.n + flipped_pass
    records = {r.receiver: r for r in auditor.anchors.tracker.records()}
    assert set(records) == {"r1", "r2"}
    for record in records.values():
        assert record.kind == QUESTION_KIND and record.samples == 1
        assert record.mean_kl_on == pytest.approx(kl_on, rel=1e-4)
        assert record.mean_kl_off == pytest.approx(kl_off, rel=1e-4)
    assert auditor.capture.seen[-1][3] is auditor.anchors  # the dense pass feeds the anchors
    auditor.freeze.active = True  # frozen anchors: nothing to flip, nothing recorded
    audit, forwarded = audited(auditor, prompt.on, prompt.on_logits, "r3")
    assert audit is not None and forwarded == prompt.n
    assert {r.receiver for r in auditor.anchors.tracker.records()} == {"r1", "r2"}


def test_warm_up_audits_reach_calls_with_estimated_offsets_between_periods(llama, prompt):
    """Far from its period, a reused call is audited while the tracker wants samples of a kind it
    carries estimated offsets of, once in ``warmup_gap`` calls; never a call without estimates
    or with the anchors frozen."""
    auditor = auditor_for(llama, method="kvcomm", audit_every=1000)
    gap = auditor.anchors.tracker.warmup_gap
    assert gap > 1
    due = [audited(auditor, prompt.on, prompt.on_logits)[0] is not None for _ in range(gap)]
    assert due == [False] * (gap - 1) + [True]
    assert [audited(auditor, prompt.plain, prompt.on_logits, "plain")[0] for _ in range(gap)] == [None] * gap
    auditor.freeze.active = True
    assert [audited(auditor, prompt.on, prompt.on_logits, "frozen")[0] for _ in range(gap)] == [None] * gap
