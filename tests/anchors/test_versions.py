"""Recorded versions: a segment reused with the offsets another receiver recorded for it, when
that receiver's prompt had the same text before it; chosen by context, kept through compaction
and save/load; and, on both tiny model families, served closer to dense than re-rotation only."""

import dataclasses

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.anchors.persist import load_pools, save_pools
from kvcomm_agents.anchors.pool import AnchorPool
from kvcomm_agents.kv.segments import CONTEXT_TOKENS
from kvcomm_agents.versions.match import MIN_CONTEXT_MATCH, best_recorded_version, common_suffix, framed_receiver
from kvcomm_agents.fidelity import first_token_kl

from ..conftest import first_logits
from .synthetic import KIND, offsets, segment
from ..conftest import mechanics


def test_common_suffix_counts_matching_ids_from_the_end():
    assert common_suffix([1, 2, 3, 4], [9, 3, 4]) == 2
    assert common_suffix([1, 2], [1, 2]) == 2
    assert common_suffix([1, 2], [2, 1]) == 0
    assert common_suffix([], [1]) == 0


SHARED = tuple(range(100, 120))  # 20 ids of text two prompts have in common


def _pool_with_versions(base_context=(7, 7, 7)):
    """One anchor recorded by "a" after ``SHARED + (3, 4)`` and by "b" after ``(5, 5, 3, 4)``."""
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=tuple(base_context))
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=2)
    slot = pool.add(seg)
    for receiver, context, seed in (("a", SHARED + (3, 4), 1), ("b", (5, 5, 3, 4), 2)):
        k, v = offsets(seed)
        pool.record(slot, receiver, 0, k, v, context)
    return pool, seg, slot


def test_a_version_fits_only_where_its_whole_context_window_matches():
    pool, seg, slot = _pool_with_versions()
    best = best_recorded_version(pool, "c", seg, 0, 6, SHARED + (3, 4))
    assert (best.receiver, best.slot, best.matched, best.base_matched) == ("a", slot, 22, 0)
    # the same last ids after other text (a lead-in, the end of a system text) are no version
    assert best_recorded_version(pool, "c", seg, 0, 6, (9,) + SHARED + (3, 4)) is None
    assert best_recorded_version(pool, "c", seg, 0, 6, (0, 3, 4)) is None
    # a full window (CONTEXT_TOKENS ids) that matches fits whatever came before it
    window = tuple(range(200, 200 + CONTEXT_TOKENS))
    k, v = offsets(4)
    pool.record(slot, "w", 0, k, v, window)
    assert best_recorded_version(pool, "c", seg, 0, 6, (1, 2) + window).receiver == "w"
    assert best_recorded_version(pool, "c", seg, 0, 6, (1,) + window[1:]) is None  # its first id differs


def test_a_runs_own_recomputed_head_is_no_evidence_that_the_text_before_it_matches():
    """A run reused from segment token ``h`` (its first ``h`` ids computed) holds those ids in
    the prompt: they match every version through the segment's own ids, so they count for
    nothing: a prompt that starts with the run fits no version."""
    seg = dataclasses.replace(segment(1, tokens=40), context_ids=(7,) * 30)
    head = MIN_CONTEXT_MATCH
    own = tuple(seg.token_ids[:head])
    assert best_recorded_version(None, "c", seg, head, 40, (9,) * 30 + own, held=head) is None
    best = best_recorded_version(None, "c", seg, head, 40, (7,) * 30 + own, held=head)
    assert best is not None and best.matched == 30
    start = dataclasses.replace(seg, context_ids=())
    assert best_recorded_version(None, "c", start, head, 40, own) is not None  # counted, the head would fit
    assert best_recorded_version(None, "c", start, head, 40, own, held=head) is None


def test_the_base_wins_when_its_context_matches_and_needs_no_pool():
    pool, seg, _ = _pool_with_versions(base_context=SHARED + (3, 4))
    best = best_recorded_version(pool, "c", seg, 0, 6, SHARED + (3, 4))  # base and "a" match whole
    assert (best.receiver, best.slot, best.matched) == (None, None, 22)
    assert best_recorded_version(None, "c", seg, 0, 6, SHARED + (3, 4)).receiver is None


def test_records_must_cover_the_run_and_a_run_inside_the_segment_extends_each_context():
    pool, seg, slot = _pool_with_versions()
    k, v = offsets(3, tokens=3)
    pool.record(slot, "d", 2, k, v, SHARED + (3, 4, 0, 1))  # tokens 2..5 only: no version of 0..6
    assert best_recorded_version(pool, "d", seg, 0, 6, SHARED + (3, 4)).receiver == "a"
    # from segment token 2, "a"'s context is SHARED + (3, 4) + the segment's ids 0, 1; "d"'s
    # covers 2..5 and matches as long: the asking receiver's own version wins the tie
    assert best_recorded_version(pool, "d", seg, 2, 5, SHARED + (3, 4, 0, 1)).receiver == "d"
    assert best_recorded_version(pool, "c", seg, 2, 5, SHARED + (3, 4, 0, 1)).receiver == "a"


def test_a_slot_written_by_two_passes_is_no_version_and_contexts_survive_compaction_and_files(tmp_path):
    pool, seg, slot = _pool_with_versions()
    k, v = offsets(4, tokens=2)
    pool.record(slot, "a", 1, k, v, (6, 6))  # a second pass over part of the same slot: mixed
    assert slot not in pool.placeholder["a"].contexts
    other = pool.add(segment(2, tokens=6))
    pool.record(other, "b", 0, *offsets(5), (4, 4))
    pool.segment_ids[slot] = None  # emptied, then compacted: the other anchor moves to slot 0
    pool.compact()
    assert pool.placeholder["b"].contexts[0].ids == (4, 4)
    save_pools([pool], tmp_path / "a.safetensors", {"fingerprint": "m"})
    (loaded,), _ = load_pools(tmp_path / "a.safetensors", fingerprint="m", shape=(3, 2, 8), max_anchors=4,
                              eviction_window=2, device=torch.device("cpu"), dtype=torch.float32)
    assert loaded.placeholder["b"].contexts == pool.placeholder["b"].contexts


def _messages(system: str, question: str, reply: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question},
            {"role": "user", "content": f"Solver one said:\n{reply}"}]


def test_a_reply_recorded_by_one_receiver_serves_the_next_with_near_exact_offsets(model, tokenizer):
    """Solver one replies; solver two computes the reply in context (a new anchor) and records
    it; solver three, whose prompt has the same text before the reply, reuses it with solver
    two's offsets. Its audit records solver three's exact offsets of the reply: solver two's are
    far nearer to them than none (re-rotation only), and the call drifts from dense less than
    re-rotation only's."""
    engine = KVCommEngine(model, tokenizer, config=mechanics(audit_every=1))
    rerotate = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate", audit_every=0))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    question = "Sam has twelve apples and eats three of them. How many apples are left now?"
    reply = "Twelve minus three is nine, so Sam has nine apples left. The final number is 9."
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for each in (engine, rerotate):  # the sender's reply, canonical ids (a tiny model's own is noise)
        each.replay([{"role": "user", "content": question}], agent="s1", reply_ids=reply_ids)
    second = engine.replay(_messages("You are solver two.", question, reply), agent="s2",
                           reply_ids=[tokenizer.eos_token_id])
    assert "new_anchor" in [d.gate.decision for d in second.result.stats.shared_decisions if d.gate]
    third = _messages("You are solver three.", question, reply)
    replay = engine.replay(third, agent="s3", reply_ids=[tokenizer.eos_token_id])
    gates = {d.segment.kind: d.gate for d in replay.result.stats.shared_decisions}
    assert gates[("s1", "assistant")] is not None and gates[("s1", "assistant")].offsets == "recorded", replay.result.stats.shared_decisions
    assert replay.result.stats.audit_kl is not None  # its dense pass recorded s3's own offsets
    pool = engine.anchors.pool(("s1", "assistant"))
    (slot,) = [i for i, sid in enumerate(pool.segment_ids) if sid is not None]
    n = int(pool.lengths[slot])
    for part in (0, 1):  # keys, values
        exact = pool.placeholder["s3"].slot(slot)[part][:, :, 4:n]  # past the recomputed head
        used = pool.placeholder["s2"].slot(slot)[part][:, :, 4:n]
        error = float((used - exact).square().sum() / exact.square().sum())
        assert error < 0.5, (part, error)  # tiny random models: 0.19 (llama), 0.36 (qwen2)
    reference = first_logits(dense, third, agent="s3")
    assert first_token_kl(reference, replay.first_token_logits) < first_token_kl(reference, first_logits(rerotate, third, agent="s3"))


def test_a_reply_generated_after_estimated_kv_is_no_version(model, tokenizer):
    """A reply keeps its context ids (and may serve as a version) only when no KV before it was
    estimated: after a call that reused a segment with estimated offsets it has none."""
    config = mechanics(gamma=1.0, audit_every=0, prefix_cache=False, kl_budget=None)
    engine = KVCommEngine(model, tokenizer, config=config)
    questions = [f"How many apples are left if Sam has {'very ' * (8 - i)}many and eats {i}?" for i in range(4)]
    estimated = None
    for i, question in enumerate(questions):
        engine.chat([{"role": "user", "content": question}], agent="s1", max_new_tokens=1)
        reply_ids = tokenizer(f"Sam has {i} apples left, says solver two.", add_special_tokens=False)["input_ids"]
        result = engine.replay([{"role": "system", "content": "You are solver two."},
                                {"role": "user", "content": question}], agent="s2",
                               reply_ids=reply_ids + [tokenizer.eos_token_id]).result
        offsets = [d.gate.offsets for d in result.stats.shared_decisions if d.gate is not None]
        reply = engine.store.get(result.segment.id) if result.segment is not None else None
        if reply is None:
            continue
        if "estimated" in offsets:
            estimated = reply
        elif not offsets or all(o in ("base", "recorded", "own") for o in offsets):
            assert reply.context_ids  # exact (or version-only) context: kept
    assert estimated is not None and estimated.context_ids == ()


def test_a_framed_copy_needs_its_lead_in_and_the_text_before_it_to_match():
    """A framed copy's context ends with its readers' lead-in: a prompt that shares only the
    lead-in (however long) is not the same text before the reply, so the copy is no version
    there; with 16 more ids in common it is."""
    seg = dataclasses.replace(segment(1, tokens=6), context_ids=(7, 7, 7))
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=2)
    slot = pool.add(seg)
    lead = tuple(range(300, 320))  # a 20-id lead-in, longer than MIN_CONTEXT_MATCH
    k, v = offsets(1)
    pool.record(slot, framed_receiver(0), 0, k, v, SHARED + lead, min_match=MIN_CONTEXT_MATCH + len(lead))
    assert best_recorded_version(pool, "r", seg, 0, 6, tuple(range(500, 520)) + lead) is None
    best = best_recorded_version(pool, "r", seg, 0, 6, SHARED + lead)
    assert (best.receiver, best.matched) == (framed_receiver(0), len(SHARED) + len(lead))
