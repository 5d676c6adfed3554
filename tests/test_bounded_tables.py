"""A long-running engine meets agent names and weights without end (agents named per user or per
request, senders of a graph that changes shape, online fine-tuning): every table keyed by them
stays bounded, dropping what was used least recently, and the indexes forget a fingerprint with
nothing left (no model)."""

import torch

from kvcomm_agents.anchors import tracker as tracker_module
from kvcomm_agents.anchors.pool import AnchorPool
from kvcomm_agents.anchors.tracker import OffsetTracker
from kvcomm_agents.framing import replies as replies_module
from kvcomm_agents.framing.replies import FramingRule, ReaderFraming
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.store import SegmentStore
from kvcomm_agents.recent import RecentDict

from .anchors.synthetic import KIND, offsets, segment
from .kv.test_segments import make_segment


def test_a_recent_dict_keeps_the_most_recently_used_keys():
    table = RecentDict(3, [("a", 1), ("b", 2), ("c", 3)])
    assert table.touch("a", list) == 1  # used: now the newest
    table["d"] = 4
    assert list(table) == ["c", "a", "d"]
    assert table.touch("e", lambda: 5) == 5 and list(table) == ["a", "d", "e"]


def test_the_tracker_keeps_the_receivers_and_kinds_seen_last(monkeypatch):
    monkeypatch.setattr(tracker_module, "MAX_AGENTS", 4)
    monkeypatch.setattr(tracker_module, "MAX_AGENT_KINDS", 6)
    tracker = OffsetTracker(window=2, min_samples=1)
    for user in range(50):  # a server naming its agents per user
        receiver = f"user-{user}"
        tracker.record_rerotated(receiver, 0.001 * user)
        tracker.record(receiver, (f"sender-{user}", "assistant"), 0.01, 0.02)
        tracker.within_budget(receiver, ("document", None), 0.0)  # held back: counted
        tracker.warmup_audit_due(receiver, [("document", None)])
    assert sorted(tracker.pooled_rerotation_samples()) == [0.001 * u for u in range(46, 50)]
    assert tracker.rerotation_samples("user-0") == [] and tracker.rerotation_samples("user-49") == [0.049]
    assert [r.receiver for r in tracker.records()] == [f"user-{u}" for u in range(44, 50)]
    assert len(tracker.measurements()["rerotated"]) == 4 and len(tracker.measurements()["paired"]) == 6
    assert not tracker.unmeasured_probe("user-0", ("document", None))  # forgotten with its receiver's turn
    tracker.restore(tracker.parse_measurements(tracker.measurements()))  # restored under the same bounds
    tracker.record_rerotated("user-50", 0.05)
    assert len(tracker.measurements()["rerotated"]) == 4


def test_reply_framings_are_kept_for_the_senders_seen_last(monkeypatch):
    monkeypatch.setattr(replies_module, "MAX_AGENTS", 3)
    framing = ReaderFraming()
    rule = FramingRule(0, (1, 2, 3), ())
    for sender in range(10):
        framing._remember(f"sender-{sender}", rule, reader="reader")
    assert [s for s in range(10) if framing.rules(f"sender-{s}")] == [7, 8, 9]


def test_a_receiver_whose_offsets_all_went_leaves_the_pool():
    pool = AnchorPool(KIND, max_anchors=2, eviction_window=2)
    for user in range(20):  # each anchor read by a receiver seen once
        slot = pool.add(segment(user))
        pool.record(slot, f"user-{user}", 0, *offsets(user, tokens=6))
        pool.record_own_text(slot, f"user-{user}", "piece", *offsets(user, tokens=2))
    assert sorted(pool.placeholder) == ["user-18", "user-19"]
    assert sorted(pool.own_text) == [("user-18", "piece"), ("user-19", "piece")]
    pool.evict_one()
    pool.compact()
    assert sorted(pool.placeholder) == ["user-19"] and len(pool.own_text) == 1


def _prefix_kv(tokens: int) -> KVBlock:
    return KVBlock.stacked(torch.zeros(2, 2, tokens, 8), torch.zeros(2, 2, tokens, 8))


def test_the_store_forgets_a_fingerprint_with_nothing_left():
    """Weights changed after every call: each fingerprint's entries are evicted, and the
    indexes keep no table for it (they grew by one per weights version)."""
    one = make_segment(text="a text long enough to be indexed by windows", tokens=4).nbytes
    store = SegmentStore(max_bytes=2 * one)
    for version in range(30):
        fingerprint = f"weights-{version}"
        store.put(make_segment(text="a text long enough to be indexed by windows", tokens=4, fingerprint=fingerprint))
        store.put(make_segment(text="short", tokens=4, fingerprint=fingerprint))
        store.put_prefix(torch.arange(4), _prefix_kv(4), fingerprint)
    assert len(store._texts._windows) <= 2 and len(store._texts._short) <= 2
    assert len(store._prefixes._roots) <= 2
    store.clear()
    assert not store._texts._windows and not store._texts._short and not store._prefixes._roots
