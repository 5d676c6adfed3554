"""Anchor pool storage: slots, offsets per receiver, eviction, credit, compaction (no model)."""

import torch

from kvcomm_agents.anchors.pool import AnchorPool, top_p_members

from .synthetic import KIND, offsets, segment, upper


def test_top_p_credits_only_the_nearest():
    assert top_p_members(torch.tensor([0.05, 0.6, 0.3, 0.05]), 0.9).tolist() == [1, 2]
    assert top_p_members(torch.tensor([0.95, 0.05]), 0.9).tolist() == [0]


def test_eviction_drops_the_least_activated_of_the_oldest():
    pool = AnchorPool(KIND, max_anchors=6, eviction_window=3)
    segs = [segment(i) for i in range(6)]
    for seg in segs:
        pool.add(seg)
    pool.activations[pool.slot_of(segs[0].id)] = 5
    pool.activations[pool.slot_of(segs[1].id)] = 1
    pool.activations[pool.slot_of(segs[2].id)] = 3
    pool.activations[pool.slot_of(segs[3].id)] = 0  # least activated overall, but not among the 3 oldest
    pool.add(segment(6))
    assert pool.slot_of(segs[1].id) is None and len(pool) == 6
    pool.add(segment(7))  # oldest now 0, 2, 3 -> 3 (activation 0) goes
    assert pool.slot_of(segs[3].id) is None and pool.slot_of(segs[0].id) is not None


def test_base_kv_and_offsets_are_stored_per_slot_and_receiver():
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=2)
    short, long = segment(0, tokens=4), segment(1, tokens=9)
    a, b = pool.add(short), pool.add(long)
    assert pool.add(short) == a  # already an anchor
    keys, values = upper(long)
    torch.testing.assert_close(pool.base(b)[0], keys, atol=0, rtol=0)
    torch.testing.assert_close(pool.base(a)[1], upper(short)[1], atol=0, rtol=0)
    assert pool.base(a)[0].shape[2] == 4  # each anchor holds its own length, no padding to the longest
    dense_k, _ = pool.base_dense(torch.tensor([a, b]), 9)
    assert dense_k[0, :, :, 4:].abs().sum() == 0 and torch.equal(dense_k[1], keys.float())  # zero padded
    k_off, v_off = offsets(0, tokens=5)
    pool.record(b, "s2", 2, k_off, v_off)  # tokens 2..7 of the long anchor
    stack = pool.placeholder["s2"]
    torch.testing.assert_close(stack.slot(b)[0][:, :, 2:7], k_off, atol=0, rtol=0)
    torch.testing.assert_close(stack.slot(b)[1][:, :, 2:7], v_off, atol=0, rtol=0)
    assert stack.slot(b)[0].shape[2] == 7 and stack.slot(b)[0][:, :, :2].abs().sum() == 0  # zeros before
    assert stack.slot(a) is None and stack.nbytes == 2 * k_off.numel() * 4  # only the 5 observed tokens
    # candidates: long enough and holding this receiver's offsets
    assert pool.candidates("s2", 6).tolist() == [b] and pool.candidates("s2", 10).tolist() == []
    assert pool.candidates("s3", 1).tolist() == [] and pool.candidates("s2", 6, exclude=b).tolist() == []
    distances = pool.value_distances(upper(short)[1], torch.tensor([a, b]))
    expected = [(pool.base(s)[1][:, :, :4] - upper(short)[1]).norm() for s in (a, b)]
    torch.testing.assert_close(distances, torch.stack(expected), atol=1e-5, rtol=0)
    assert distances[0] == 0


def test_credit_and_compaction_keep_the_occupied_slots_in_order():
    pool = AnchorPool(KIND, max_anchors=4, eviction_window=4)
    segs = [segment(i) for i in range(3)]
    slots = [pool.add(s) for s in segs]
    for slot in slots:
        pool.record(slot, "s2", 0, *offsets(slot))
    pool.credit(torch.tensor(slots), torch.tensor([0.7, 0.25, 0.05]), 0.9)
    assert pool.activations.tolist() == [1, 1, 0]
    held = pool.nbytes
    victim = pool.evict_one()  # the least activated of the window
    assert victim == slots[2] and pool.slot_of(segs[2].id) is None
    before = pool.nbytes
    assert before < held and pool.placeholder["s2"].slot(victim) is None
    pool.compact()
    assert len(pool) == 2 and pool.nbytes == before and len(pool.bases) == 2  # the victim's bytes went with it
    assert [pool.slot_of(s.id) for s in segs[:2]] == [0, 1]
    torch.testing.assert_close(pool.placeholder["s2"].slot(1)[0][:, :, :6], offsets(1)[0], atol=0, rtol=0)
