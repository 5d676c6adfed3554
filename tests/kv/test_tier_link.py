"""``kv.tier_link.TierLink`` on its own parts (a lock, an entries dict, a run index, an insert
callable) and the in-process tier: what it indexes, publishes, fetches and forgets."""

from __future__ import annotations

import threading
import warnings

import torch

from kvcomm_agents.errors import SharedTierWarning
from kvcomm_agents.kv.run_index import TokenRunIndex
from kvcomm_agents.kv.shared import MemorySegments, encode_entry
from kvcomm_agents.kv.tier_link import REMOTE, TierLink

from .test_shared import _segment


class Parts:
    """What a store hands its link: its lock, entries and run index, and where fetched entries go."""

    def __init__(self, shared) -> None:
        self.lock, self.entries, self.runs, self.inserted = threading.RLock(), {}, TokenRunIndex(4), []
        self.link = TierLink(shared, store_lock=self.lock, entries=self.entries, runs=self.runs,
                             insert=self.insert, prefix_entry=lambda *args: ("prefix", *args))

    def insert(self, key, entry) -> None:
        self.inserted.append(key)
        self.entries[key] = entry


def indexed(runs: TokenRunIndex, key: str) -> bool:
    try:
        runs.ids(key)
    except KeyError:
        return False
    return True


def tier_holding(*segments) -> MemorySegments:
    tier = MemorySegments()
    for segment in segments:
        tier.publish(*encode_entry(segment))
    return tier


def test_sync_indexes_what_the_tier_holds_and_this_store_does_not():
    mine, theirs = _segment(6), _segment(7)
    parts = Parts(tier_holding(mine, theirs))
    parts.entries[mine.id] = mine
    parts.link.sync()
    assert set(parts.link.remote) == {theirs.id}
    assert parts.runs.ids(REMOTE + theirs.id) == tuple(theirs.token_ids)
    assert parts.runs.ids(REMOTE + theirs.id) is parts.link.remote[theirs.id].token_ids  # the catalog's, not a copy
    assert not indexed(parts.runs, REMOTE + mine.id)  # held here: not indexed as remote
    parts.link.sync()  # a second read sees nothing new
    assert set(parts.link.remote) == {theirs.id}


def test_fetch_inserts_the_entry_once_and_a_missing_blob_is_forgotten():
    theirs, gone = _segment(7), _segment(8)
    tier = tier_holding(theirs, gone)
    parts = Parts(tier)
    parts.link.sync()
    fetched = parts.link.fetch(parts.link.remote[theirs.id])
    assert fetched.id == theirs.id and parts.inserted == [theirs.id]
    torch.testing.assert_close(fetched.kv.keys[0], theirs.kv.keys[0])
    assert parts.link.fetch(parts.link.remote[theirs.id]) is fetched and parts.inserted == [theirs.id]  # held
    tier.drop(gone.id)
    assert parts.link.fetch(parts.link.remote[gone.id]) is None
    assert gone.id not in parts.link.remote and not indexed(parts.runs, REMOTE + gone.id)
    assert (parts.link.fetched, parts.link.misses) == (1, 1)


def test_publish_makes_an_entry_findable_again_once_evicted_and_a_failing_tier_warns_once():
    tier = MemorySegments()
    parts = Parts(tier)
    segment = _segment(9)
    parts.link.publish(segment.id, segment)
    assert tier.fetch(segment.id) is not None and segment.id in parts.link.remote
    assert parts.runs.ids(REMOTE + segment.id) == tuple(segment.token_ids)  # not held here: findable remotely
    parts.runs.remove(REMOTE + segment.id)
    parts.link.removed(segment.id)  # the store dropped it: the tier still holds it
    assert parts.runs.ids(REMOTE + segment.id) == tuple(segment.token_ids)

    class Down(MemorySegments):
        def publish(self, item, blob):
            raise ConnectionError("tier down")

    broken = Parts(Down())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        broken.link.publish(segment.id, segment)
        broken.link.publish(segment.id, segment)
    assert [w.category for w in caught] == [SharedTierWarning]
    assert not broken.link.remote
