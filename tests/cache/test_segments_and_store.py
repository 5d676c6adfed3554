"""Segment references survive JSON; the store keeps its byte budget and never evicts pinned entries."""

import json

import pytest
import torch

from kvcomm_agents import SegmentRef
from kvcomm_agents.cache.segments import KVSegment, content_hash
from kvcomm_agents.cache.store import SegmentStore


def make_segment(text="hello world", tokens=4, layers=2, model="m1", kind=("user", None)):
    keys = [torch.zeros(1, 2, tokens, 8) for _ in range(layers)]
    values = [torch.ones(1, 2, tokens, 8) for _ in range(layers)]
    spans = [(i, i + 1) for i in range(tokens)]
    return KVSegment.create(kind=kind, text=text, token_ids=list(range(tokens)), char_spans=spans,
                            keys=keys, values=values, model_fingerprint=model)


def test_ref_survives_json_round_trip():
    ref = make_segment(kind=("solver-1", "assistant")).ref
    restored = SegmentRef.model_validate(json.loads(ref.model_dump_json()))
    assert restored == ref
    assert SegmentRef.coerce(ref.model_dump()) == ref
    assert restored.kind == ("solver-1", "assistant")


def test_content_hash_changes_with_text_and_ids():
    assert content_hash("a b", [1, 2]) != content_hash("a c", [1, 2])
    assert content_hash("a b", [1, 2]) != content_hash("a b", [1, 3])


def test_segment_rejects_mismatched_kv():
    with pytest.raises(ValueError):
        KVSegment.create(kind=("user", None), text="x", token_ids=[1, 2], char_spans=[(0, 1), None],
                         keys=[torch.zeros(1, 1, 3, 4)], values=[torch.zeros(1, 1, 3, 4)], model_fingerprint="m")


def test_budget_evicts_least_recently_used():
    one = make_segment("a" * 10)
    store = SegmentStore(max_bytes=2 * one.nbytes)
    first, second, third = make_segment("first text"), make_segment("second text"), make_segment("third text")
    store.put(first)
    store.put(second)
    assert store.get(first.id) is first  # touch: second is now least recently used
    store.put(third)
    assert store.get(second.id) is None and store.was_evicted(second.id)
    assert store.get(first.id) is first and store.get(third.id) is third
    stats = store.stats()
    assert stats.bytes <= stats.max_bytes and stats.evictions == 1 and stats.segments == 2


def test_pinned_segments_are_not_evicted():
    first, second = make_segment("first text"), make_segment("second text")
    store = SegmentStore(max_bytes=first.nbytes)
    store.put(first)
    with store.pinned([first]):
        store.put(second)  # over budget, but first is pinned: second goes instead
        assert store.get(first.id) is first
        assert store.get(second.id) is None
    assert store.stats().bytes <= store.max_bytes


def test_oversized_segment_is_refused():
    store = SegmentStore(max_bytes=10)
    assert store.put(make_segment()) is False
    assert len(store) == 0


def test_find_in_text_is_per_model_and_non_overlapping():
    store = SegmentStore(max_bytes=1 << 30)
    long = make_segment("the answer is 72", model="m1")
    inner = make_segment("answer", model="m1")
    other = make_segment("Agent", model="m2")
    for seg in (long, inner, other):
        store.put(seg)
    found = store.find_in_text("Agent 1 said: the answer is 72. Final answer", "m1")
    assert [(seg.text, offset) for seg, offset in found] == [("the answer is 72", 14), ("answer", 38)]
    assert store.find_text("answer", "m2") is None


def test_prefix_lookup_and_domination():
    store = SegmentStore(max_bytes=1 << 30)
    kv = [torch.zeros(1, 1, 5, 2)]
    store.put_prefix(torch.tensor([1, 2, 3, 4, 5]), kv, kv, "m1")
    entry, n = store.longest_prefix(torch.tensor([1, 2, 3, 9]), "m1")
    assert n == 3
    assert store.longest_prefix(torch.tensor([1, 2, 3]), "m2") is None
    longer = [torch.zeros(1, 1, 7, 2)]
    store.put_prefix(torch.tensor([1, 2, 3, 4, 5, 6, 7]), longer, longer, "m1")
    assert store.stats().prefixes == 1  # the shorter entry is covered and dropped
    store.clear()
    assert len(store) == 0
