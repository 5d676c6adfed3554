"""The offset estimate on synthetic anchors (no model): the weights pick the nearest anchor, the
mean averages, own-text weights are right-aligned; observations are recorded in the canonical frame."""

import torch

from kvcomm_agents.anchors.estimate import estimate_offsets
from kvcomm_agents.anchors.gate import entropy_score
from kvcomm_agents.anchors.pool import AnchorPool

from .synthetic import KIND, offsets, segment, upper


def pool_of(segments, tokens=6):
    pool = AnchorPool(KIND, max_anchors=20, eviction_window=5)
    for i, seg in enumerate(segments):
        pool.record(pool.add(seg), "s2", 0, *offsets(i, tokens))
    return pool


def test_identical_anchor_gets_weight_one_and_its_exact_offsets():
    anchors = [segment(i, scale=20.0) for i in range(4)]  # distances >> temperature
    pool = pool_of(anchors)
    query_k, query_v = upper(anchors[2])
    slots = pool.candidates("s2", 6)
    est = estimate_offsets(pool, "s2", query_k, query_v, slots, "weighted", 1.0)
    k_off, v_off = offsets(2)
    torch.testing.assert_close(est.keys, k_off, atol=1e-4, rtol=0)
    torch.testing.assert_close(est.values, v_off, atol=1e-4, rtol=0)
    assert est.own_text_keys is None
    _, p = entropy_score(pool.value_distances(query_v, slots))
    assert p[slots.tolist().index(pool.slot_of(anchors[2].id))] > 0.999
    mean = estimate_offsets(pool, "s2", query_k, query_v, slots, "mean", 1.0)
    expected = torch.stack([offsets(i)[0] for i in range(4)]).mean(dim=0)
    torch.testing.assert_close(mean.keys, expected, atol=1e-6, rtol=0)  # the plain average
    assert not torch.allclose(mean.keys, k_off, atol=1e-2)


def test_a_shorter_segment_takes_the_anchors_first_tokens():
    anchors = [segment(i, tokens=9) for i in range(2)]
    pool = pool_of(anchors, tokens=9)
    query_k, query_v = upper(segment(7, tokens=4))
    est = estimate_offsets(pool, "s2", query_k, query_v, pool.candidates("s2", 4), "mean", 1.0)
    expected = (offsets(0, 9)[1] + offsets(1, 9)[1])[:, :, :4] / 2
    assert est.values.shape[2] == 4
    torch.testing.assert_close(est.values, expected, atol=1e-6, rtol=0)


def test_own_text_weights_are_right_aligned_per_channel():
    long_anchor, other = segment(0, tokens=9, scale=20.0), segment(1, tokens=9, scale=20.0)
    pool = pool_of([long_anchor, other], tokens=9)
    for i, seg in enumerate((long_anchor, other)):
        pool.record_own_text(pool.slot_of(seg.id), "s2", "piece", *offsets(10 + i, tokens=3))
    # the query is the last 6 tokens of the long anchor: right-aligned own-text weights pick it
    query_k, query_v = upper(long_anchor)
    est = estimate_offsets(pool, "s2", query_k[:, :, 3:], query_v[:, :, 3:], pool.candidates("s2", 6), "weighted",
                           1.0, piece="piece")
    k_own, v_own = offsets(10, tokens=3)
    torch.testing.assert_close(est.own_text_keys, k_own, atol=1e-4, rtol=0)
    torch.testing.assert_close(est.own_text_values, v_own, atol=1e-4, rtol=0)
    mean = estimate_offsets(pool, "s2", query_k, query_v, pool.candidates("s2", 6), "mean", 1.0, piece="piece")
    torch.testing.assert_close(mean.own_text_keys, (k_own + offsets(11, tokens=3)[0]) / 2, atol=1e-6, rtol=0)
    assert estimate_offsets(pool, "s2", query_k, query_v, pool.candidates("s2", 6), "mean", 1.0,
                            piece="other").own_text_keys is None
