"""The paper's entropy gate on synthetic anchors (no model)."""

import math

import torch

from kvcomm_agents.anchors import KVCommAnchors
from kvcomm_agents.anchors.gate import entropy_score, judge
from kvcomm_agents.kv.block_count import BlockCount

from .synthetic import KIND, LAYERS, offsets, observe, segment


def anchors(**kw) -> KVCommAnchors:
    return KVCommAnchors(**{"estimator": "weighted", "max_bytes": 1 << 30, **kw})


def test_entropy_score_is_the_normalised_entropy_of_softmax_weights():
    score, p = entropy_score(torch.full((5,), 7.0))
    assert math.isclose(score, 1.0, rel_tol=1e-9) and torch.allclose(p, torch.full((5,), 0.2))
    distances = torch.tensor([0.0, 1.0, 3.0])
    q = torch.exp(-distances) / torch.exp(-distances).sum()
    expected = float(-(q * torch.log2(q)).sum()) / math.log2(3)
    score, p = entropy_score(distances)
    assert math.isclose(score, expected, rel_tol=1e-6) and torch.allclose(p, q)
    assert entropy_score(torch.tensor([0.0, 1000.0]))[0] < 1e-6  # one clear nearest


def test_equally_distant_anchors_give_maximal_entropy_and_a_new_anchor():
    reg = anchors(gamma=0.3)
    base = segment(0)
    for i in range(4):  # anchors at exactly the same value distance from the query
        values = base.kv.values[0].clone()
        values[1 + i % (LAYERS - 1), i % 2, i, 0] += 2.0
        observe(reg, "s2", segment(100 + i, values=values), *offsets(i))
    verdict = reg.decide("s2", base)
    assert verdict.anchors == 4 and math.isclose(verdict.entropy, 1.0, rel_tol=1e-6)
    assert not verdict.reuse and verdict.score == verdict.entropy


def test_gate_needs_two_anchors_and_reuses_a_clear_nearest():
    reg = anchors(gamma=0.3)
    query = segment(0)
    observe(reg, "s2", segment(1, scale=5.0), *offsets(1))
    one = reg.decide("s2", query)
    assert not one.reuse and one.anchors == 1 and one.score is None  # one anchor only
    assert reg.decide("s3", query).anchors == 0  # no offsets for this receiver
    near = segment(0)  # same tensors as the query, another segment id
    observe(reg, "s2", near, *offsets(2))
    verdict = reg.decide("s2", query)
    assert verdict.reuse and verdict.anchors == 2 and verdict.entropy < 0.01
    pool = reg.pool(KIND)
    assert int(pool.activations[pool.slot_of(near.id)]) == 1  # credited
    assert pool.slot_of(query.id) is None


def test_min_anchors_and_frozen_pools():
    count = BlockCount()
    reg = anchors(gamma=1.0, min_anchors=3, freeze=count)
    for i in range(2):
        observe(reg, "s2", segment(i), *offsets(i))
    verdict = reg.decide("s2", segment(9))
    assert verdict.anchors == 2 and verdict.entropy is not None and not verdict.reuse  # scored, too few
    reg.min_anchors = 2
    count.enter()
    assert reg.decide("s2", segment(9)).reuse  # gamma 1 reuses whatever the entropy
    assert int(reg.pool(KIND).activations.sum()) == 0  # frozen: nobody credited
    count.leave()
    reg.decide("s2", segment(9))
    assert int(reg.pool(KIND).activations.sum()) >= 1


def test_a_receiver_that_recorded_the_segment_reuses_its_own_offsets():
    reg = anchors()
    seg = segment(3)
    observe(reg, "s2", seg, *offsets(3))
    verdict = judge(reg.pool(KIND), "s2", seg, gamma=0.0, min_anchors=2)
    assert verdict.reuse and verdict.own_offsets and verdict.candidates.tolist() == [reg.pool(KIND).slot_of(seg.id)]
    assert not judge(reg.pool(KIND), "s9", seg, gamma=1.0, min_anchors=1).reuse
    assert not judge(None, "s2", seg, gamma=1.0, min_anchors=1).reuse  # no pool of this kind yet
