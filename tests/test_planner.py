"""Planning one call (no model): what is reused exactly, re-rotated or computed, and why, on
prompts of the tiny tokenizer's chat template and a store of segments (KV: zeros)."""

import torch

from kvcomm_agents.anchors import KVCommAnchors
from kvcomm_agents.config import KVCommConfig
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.matching import find_occurrences
from kvcomm_agents.planner import plan_call
from kvcomm_agents.prompt import render_prompt

from .test_matching import REPLY, TOKENIZER, make_segment
from .conftest import mechanics

QUESTION = "How many clips did Natalia sell in April and May?"


def setup(method="rerotate", **config):
    store = SegmentStore(1 << 20)
    reply, question = make_segment(REPLY), make_segment(QUESTION, kind=("user", None))
    store.put(reply)
    store.put(question)
    messages = [{"role": "system", "content": "You are solver two."}, {"role": "user", "content": QUESTION},
                {"role": "user", "content": "Agent 1 said: " + REPLY, "segment": reply.ref.model_dump()}]
    return store, render_prompt(TOKENIZER, messages), mechanics(method=method, **config), reply, question


def partition(plan) -> None:
    """Reused and computed positions together are the prompt, each once; the last token is computed."""
    computed, reused = plan.computed_positions().tolist(), plan.reused_positions().tolist()
    assert sorted(computed + reused) == list(range(plan.num_prompt))
    assert plan.num_prompt - 1 in computed and plan.reused_tokens == len(reused)


def test_rerotation_reuses_both_segments_as_runs_of_their_own_ids():
    store, layout, config, reply, question = setup(min_match_tokens=4)
    plan = plan_call(layout, store=store, fingerprint="m", config=config, agent="s2")
    assert [(d.segment_id, d.status, d.reason) for d in plan.decisions] == [
        (question.id, "reused", "content"), (reply.id, "reused", "reference")]
    assert plan.dense_reason is None and plan.prefix is None and plan.observations == ()
    starts = [run.prompt_start for run in plan.runs]
    assert starts == sorted(starts) and all(a.prompt_end <= b.prompt_start for a, b in zip(plan.runs, plan.runs[1:]))
    for run in plan.runs:
        assert layout.ids[run.prompt_start : run.prompt_end].tolist() == list(
            run.segment.token_ids[run.segment_start : run.segment_start + run.length])
        assert run.key_offsets is None and run.verdict is None  # re-rotation only
    assert sum(d.reused_tokens for d in plan.decisions) == plan.reused_tokens
    assert plan.first_rerotated() == plan.runs[0].prompt_start
    partition(plan)
    # own text after each segment running to its end: up to the next segment (its computed
    # head tokens belong to the segment) or the last token
    assert [run.head for run in plan.runs] == [config.recompute_head] * 2
    assert [(p.start, p.end, p.after.id) for p in plan.pieces] == [
        (plan.runs[0].prompt_end, plan.runs[1].prompt_start - plan.runs[1].head, question.id),
        (plan.runs[1].prompt_end, plan.num_prompt - 1, reply.id)]
    assert all(not p.reused and not p.observed for p in plan.pieces)


def test_refusals_and_short_runs_are_reported_per_segment():
    store, layout, config, _, _ = setup()
    off = plan_call(layout, store=store, fingerprint="m", config=config, refuse_reason="reuse_off")
    assert off.dense_reason == "reuse_off" and off.runs == () and off.reused_tokens == 0
    assert [(d.status, d.reason) for d in off.decisions] == [("prefilled", "reuse_off")] * 2
    short = plan_call(layout, store=store, fingerprint="m", config=config.model_copy(update={"min_match_tokens": 100}))
    assert [d.reason for d in short.decisions] == ["too_short", "too_short"] and short.dense_reason == "nothing_to_reuse"
    foreign = plan_call(layout, store=store, fingerprint="other", config=config)
    assert [(d.reason, d.segment is not None) for d in foreign.decisions] == [("foreign_model", True)]  # by reference only
    exact = plan_call(layout, store=store, fingerprint="m", config=mechanics(method="exact_prefix"))
    assert [d.reason for d in exact.decisions] == ["exact_only", "exact_only"] and exact.runs == ()


def test_a_malformed_reference_is_computed_not_raised():
    store, _, config, _, _ = setup()
    messages = [{"role": "user", "content": REPLY, "segment": {"id": "abc", "kind": "nonsense"}}]
    plan = plan_call(render_prompt(TOKENIZER, messages), store=store, fingerprint="m", config=config)
    assert [(d.status, d.reason, d.segment_id, d.segment) for d in plan.decisions] == [("prefilled", "bad_reference", "?", None)]
    assert plan.runs == ()


def test_exact_prefix_comes_first_and_is_capped_before_the_last_token():
    store, layout, config, _, question = setup()
    n = layout.ids.numel()
    kv = KVBlock.stacked(torch.zeros(2, 1, n + 3, 4), torch.zeros(2, 1, n + 3, 4))
    store.put_prefix(torch.cat([layout.ids, torch.tensor([1, 2, 3])]), kv, "m")  # an earlier prompt + reply
    plan = plan_call(layout, store=store, fingerprint="m", config=config)
    assert plan.prefix_length == n - 1 and plan.runs == ()
    assert [(d.status, d.reason) for d in plan.decisions] == [("reused", "exact_prefix")] * 2
    partition(plan)
    no_prefix = plan_call(layout, store=store, fingerprint="m", config=config.model_copy(update={"prefix_cache": False}))
    assert no_prefix.prefix is None and no_prefix.runs


def test_kvcomm_without_anchors_computes_from_the_first_new_segment_on():
    store, layout, config, reply, question = setup("kvcomm")
    anchors = KVCommAnchors()
    plan = plan_call(layout, store=store, fingerprint="m", config=config, agent="s2", anchors=anchors)
    assert [(d.reason, d.gate.decision if d.gate else None) for d in plan.decisions] == [
        ("new_anchor", "new_anchor"), ("after_new_anchor", None)]
    assert plan.runs == () and plan.dense_reason == "nothing_to_reuse"
    assert [o.segment.id for o in plan.observations] == [question.id, reply.id]
    assert all(p.observed for p in plan.pieces) and len(plan.pieces) == 2
    assert anchors.nbytes() == 0  # planning records nothing


def test_short_approximate_runs_are_computed_whole():
    from kvcomm_agents.repairs import computed_head

    assert computed_head(16, 0) == 0 and computed_head(0, 500) == 0
    assert computed_head(16, 500) == 16 and computed_head(16, 10) == 10  # a run within the head: whole
    assert computed_head(16, 64, 64) == 64 and computed_head(16, 65, 64) == 16


def test_a_run_moved_counted_from_where_its_kv_was_computed():
    """``moved_past_its_context``: a stored prompt's view was computed from position 0; a segment
    with a short recorded context right after it; one with none recorded (captured after
    estimated KV) is counted from its own start, wherever capture cut it; after a full window
    the position capture recorded says, and without one nothing tells: never moved."""
    from types import SimpleNamespace

    from kvcomm_agents.kv.store import SegmentStore
    from kvcomm_agents.repairs import moved_past_its_context

    def segment(kind, context, computed_at=None):
        return SimpleNamespace(ref=SimpleNamespace(kind=kind), context_ids=tuple(range(context)),
                               computed_at=computed_at)

    prompt, reply = SegmentStore.PREFIX_KIND, ("assistant", "solver")
    assert moved_past_its_context(segment(prompt, 0, 0), 10 + 65, 10)
    assert not moved_past_its_context(segment(prompt, 0, 0), 10 + 64, 10)
    assert moved_past_its_context(segment(reply, 20), 20 + 65, 0) and not moved_past_its_context(segment(reply, 20), 84, 0)
    assert moved_past_its_context(segment(reply, 0), 65, 0) and not moved_past_its_context(segment(reply, 0), 64, 0)
    assert not moved_past_its_context(segment(reply, 64), 1000, 0)  # a full window: how far is unknown
    # after a full window, the recorded position decides
    assert moved_past_its_context(segment(reply, 64, 500), 500 + 65, 0)
    assert not moved_past_its_context(segment(reply, 64, 500), 500 + 64, 0)
    assert moved_past_its_context(segment(reply, 64, 100), 100 + 30 + 65, 30)  # a run from the segment's id 30
    assert not moved_past_its_context(segment(reply, 64, 500), 200, 0)  # moved earlier: it follows less
    # captured after estimated KV (no context): from its own start, however near where capture cut it
    assert moved_past_its_context(segment(reply, 0, 900), 950, 0)


def test_a_prefix_holding_a_runs_first_ids_by_chance_leaves_its_head_and_short_runs_to_compute():
    store, layout, config, reply, _ = setup(recompute_head=16, recompute_short_runs=64)
    start = next(d.span[0] for d in plan_call(layout, store=store, fingerprint="m", config=config).decisions
                 if d.segment.id == reply.id)
    # an earlier prompt began the reply's text with the same three ids, then went on otherwise
    held = torch.cat([layout.ids[: start + 3], torch.tensor([7, 7, 7])])
    store.put_prefix(held, KVBlock.stacked(torch.zeros(2, 1, held.numel(), 4), torch.zeros(2, 1, held.numel(), 4)), "m")
    plan = plan_call(layout, store=store, fingerprint="m", config=config)
    assert plan.prefix_length == start + 3
    assert not any(run.segment.id == reply.id for run in plan.runs)  # the short reply: computed in context
    partition(plan)
    heads = config.model_copy(update={"recompute_short_runs": 0, "recompute_head": 5})  # the reply outlasts its head
    (run,) = [r for r in plan_call(layout, store=store, fingerprint="m", config=heads).runs if r.segment.id == reply.id]
    assert run.prompt_start == start + 5 and run.head == 2  # the head counted from the run's start
    # a repeated prompt whose prefix holds the head its last call computed computes nothing more
    store.put_prefix(layout.ids[: start + 5], KVBlock.stacked(torch.zeros(2, 1, start + 5, 4),
                                                              torch.zeros(2, 1, start + 5, 4)), "m")
    again = plan_call(layout, store=store, fingerprint="m", config=heads)
    (run,) = [r for r in again.runs if r.segment.id == reply.id]
    assert again.prefix_length == start + 5 and run.prompt_start == start + 5 and run.head == 0


def test_a_short_reply_held_by_an_earlier_readers_prompt_is_reused_with_it():
    from .test_matching import LONG_QUESTION, _spans_setting

    store, reply, lay = _spans_setting(LONG_QUESTION)
    config = mechanics(method="rerotate", recompute_head=16, recompute_short_runs=64)
    plan = plan_call(lay, store=store, fingerprint="m", config=config, agent="judge")
    (decision,) = plan.decisions
    assert (decision.segment.kind, decision.status, decision.found_by) == (SegmentStore.PREFIX_KIND, "reused", "span")
    reply_span = next(o.token_span(lay) for o in find_occurrences(lay, store, "m") if o.segment_id == reply.id)
    reused = set(plan.reused_positions().tolist())
    assert set(range(*reply_span)) <= reused  # the reply (a short run alone) is served with the text before it
    assert plan.runs[0].head == 16 and plan.runs[0].prompt_start == decision.span[0] + 16
    partition(plan)
    alone = plan_call(lay, store=store, fingerprint="m", config=config.model_copy(update={"shared_runs": "anywhere"}))
    assert ("prefilled", "short_run") in [(d.status, d.reason) for d in alone.decisions if d.segment_id == reply.id]
    assert not set(range(*reply_span)) & set(alone.reused_positions().tolist())
