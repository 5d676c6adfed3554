"""The fidelity metrics on hand-made inputs."""

import math

import torch

from kvcomm_agents.fidelity import agreement_rate, first_token_kl, tokens_agree


def test_kl_is_zero_for_equal_logits_and_matches_the_formula():
    logits = torch.tensor([2.0, 0.5, -1.0])
    assert first_token_kl(logits, logits) == 0.0
    other = torch.tensor([0.0, 0.0, 0.0])
    p = torch.softmax(logits, -1)
    expected = float((p * (p.log() - math.log(1 / 3))).sum())
    assert abs(first_token_kl(logits, other) - expected) < 1e-6
    assert first_token_kl(logits, other) != first_token_kl(other, logits)  # direction matters


def test_agreement_stops_at_dense_end_of_sequence():
    eos = 0
    assert tokens_agree([5, 6, eos], [5, 6, eos, 9, 9], k=32, eos_ids=[eos])
    assert not tokens_agree([5, 6, eos], [5, 6, 7, eos], k=32, eos_ids=[eos])
    assert tokens_agree([1] * 40, [1] * 32 + [2] * 8, k=32)
    assert not tokens_agree([1] * 40, [1] * 31 + [2] * 9, k=32)
    assert agreement_rate([([1, 2], [1, 2]), ([1, 2], [1, 3])], k=2) == 0.5
