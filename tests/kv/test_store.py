"""The store keeps its byte budget, never evicts pinned entries, finds segments per model."""

import pytest
import torch

from kvcomm_agents.errors import BudgetWarning, InvalidRequestError
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.store import SegmentStore

from .test_segments import make_segment


def block(tokens: int) -> KVBlock:
    return KVBlock.stacked(torch.zeros(1, 1, tokens, 2), torch.zeros(1, 1, tokens, 2))


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



def test_a_prefix_served_through_its_segment_view_is_pinned_while_a_call_uses_it():
    ids = torch.arange(40)
    store = SegmentStore(max_bytes=1 << 20, min_run=8)
    kv = KVBlock.stacked(torch.zeros(1, 1, 40, 4), torch.zeros(1, 1, 40, 4))
    store.put_prefix(ids, kv, "m")
    (view, *_), = store.find_runs(ids, "m", torch.ones(40, dtype=torch.bool), 39)
    assert view.ref.kind == SegmentStore.PREFIX_KIND
    with store.pinned([view]):
        store.resize(0)  # everything unpinned goes
        assert len(store) == 1 and store.longest_prefix(ids, "m")[1] == 40 and store.stats().pinned == 1
    with store.pinned([make_segment("never stored")]):
        assert len(store) == 0 and store.stats().pinned == 0  # only entries the store holds count

@pytest.mark.parametrize("budget", [-1, 1.5, True, "1GB", None])
def test_a_budget_that_is_not_a_byte_count_is_refused_and_the_old_one_kept(budget):
    with pytest.raises(InvalidRequestError, match="byte budget"):
        SegmentStore(max_bytes=budget)
    store = SegmentStore(max_bytes=1 << 20)
    with pytest.raises(InvalidRequestError, match="byte budget"):
        store.resize(budget)
    assert store.stats().max_bytes == 1 << 20
    import numpy as np

    store.resize(np.int64(2048))  # an integer of another type is one
    assert store.stats().max_bytes == 2048 and type(store.stats().max_bytes) is int


def test_oversized_segment_is_refused():
    store = SegmentStore(max_bytes=10)
    assert store.put(make_segment()) is False
    assert len(store) == 0


def test_find_in_text_is_per_model_and_non_overlapping():
    store = SegmentStore(max_bytes=1 << 30)
    long = make_segment("the answer is 72", fingerprint="m1")
    inner = make_segment("answer", fingerprint="m1")
    other = make_segment("Agent", fingerprint="m2")
    for seg in (long, inner, other):
        store.put(seg)
    found = store.find_in_text("Agent 1 said: the answer is 72. Final answer", "m1")
    assert [(seg.text, offset) for seg, offset in found] == [("the answer is 72", 14), ("answer", 38)]
    assert store.find_text("answer", "m2") is None


def test_prefix_lookup_and_domination():
    store = SegmentStore(max_bytes=1 << 30)
    store.put_prefix(torch.tensor([1, 2, 3, 4, 5]), block(5), "m1")
    entry, n = store.longest_prefix(torch.tensor([1, 2, 3, 9]), "m1")
    assert n == 3 and entry.fingerprint == "m1" and entry.kv.num_tokens == 5
    assert store.longest_prefix(torch.tensor([1, 2, 3]), "m2") is None
    store.put_prefix(torch.tensor([1, 2, 3, 4, 5, 6, 7]), block(7), "m1")
    assert store.stats().prefixes == 1  # the shorter entry is covered and dropped
    store.clear()
    assert len(store) == 0


def test_a_prefix_over_the_whole_budget_leaves_the_shorter_ones_it_covers():
    store = SegmentStore(max_bytes=block(10).nbytes)
    store.put_prefix(torch.arange(10), block(10), "m")
    with pytest.warns(BudgetWarning):
        assert store.put_prefix(torch.arange(20), block(20), "m") is False  # too big: not kept
    assert store.longest_prefix(torch.arange(20), "m")[1] == 10  # and the shorter one is still served
    assert store.put_prefix(torch.arange(10), block(10), "m") is True and store.stats().prefixes == 1
