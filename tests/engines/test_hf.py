"""The runtime module's pure parts (no model): the position mask."""

import torch

from kvcomm_agents.engines.hf import position_mask


def test_position_mask_lets_a_query_see_keys_at_its_position_or_before():
    queries = torch.tensor([4, 7])
    keys = torch.tensor([0, 5, 6, 1, 4, 7])  # storage order: reused slots, then the queries
    mask = position_mask(queries, keys, dtype=torch.float32, device="cpu")
    assert mask.shape == (1, 1, 2, 6)
    low = torch.finfo(torch.float32).min
    expected = torch.tensor([[0, low, low, 0, 0, low], [0, 0, 0, 0, 0, 0]])
    assert torch.equal(mask[0, 0], expected)
    assert position_mask(queries, keys, dtype=torch.bfloat16, device="cpu").dtype == torch.bfloat16
