"""Re-rotation: composition, inversion, the canonical frame, and the load-time self-check."""

import pytest
import torch

from kvcomm_agents.kv.rope import RopeRotator, rotate_half
from kvcomm_agents.errors import RopeCheckError
from kvcomm_agents.support import check_rerotation


@pytest.fixture
def rotator():
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    return RopeRotator(inv_freq)


def test_rotate_half_swaps_and_negates():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(rotate_half(x), torch.tensor([-3.0, -4.0, 1.0, 2.0]))


def test_rotations_compose(rotator):
    keys = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    twice = rotator.shift(rotator.shift(keys, 7), 30)
    once = rotator.shift(keys, 37)
    torch.testing.assert_close(twice, once, atol=1e-12, rtol=0)


def test_rotation_inverts(rotator):
    keys = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(rotator.shift(rotator.shift(keys, 1234), -1234), keys, atol=1e-12, rtol=0)


def test_rotation_preserves_norm_and_changes_keys(rotator):
    keys = torch.randn(1, 2, 5, 16)
    moved = rotator.shift(keys, 11)
    assert not torch.allclose(moved, keys)
    torch.testing.assert_close(moved.norm(dim=-1), keys.norm(dim=-1))


def test_per_token_shifts_match_scalar_shifts(rotator):
    keys = torch.randn(1, 2, 3, 16, dtype=torch.float64)
    per_token = rotator.shift(keys, torch.tensor([4, 9, -2]))
    for t, delta in enumerate([4, 9, -2]):
        torch.testing.assert_close(per_token[:, :, t], rotator.shift(keys[:, :, t : t + 1], delta)[:, :, 0])


def test_canonical_frame_round_trip(rotator):
    """Keys at positions 50.. de-rotated to 0.. then moved to 200.. equal keys moved 150 directly."""
    keys_at_50 = torch.randn(1, 2, 6, 16, dtype=torch.float64)
    canonical = rotator.shift(keys_at_50, -50)
    torch.testing.assert_close(rotator.shift(canonical, 200), rotator.shift(keys_at_50, 150), atol=1e-12, rtol=0)


@pytest.mark.parametrize("delta", [37, torch.tensor([4, 9, -2, 0, 100])])
def test_rotating_into_a_given_tensor_writes_the_same_keys_there(rotator, delta):
    keys = torch.randn(1, 2, 5, 16)
    out = torch.full((1, 2, 9, 16), 7.0)
    moved = rotator.shift(keys, delta, out=out[:, :, 2:7])
    torch.testing.assert_close(moved, rotator.shift(keys, delta), atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, :, 2:7], rotator.shift(keys, delta), atol=1e-6, rtol=0)
    assert torch.all(out[:, :, :2] == 7.0) and torch.all(out[:, :, 7:] == 7.0)  # nothing outside the window


def test_half_by_half_rotation_matches_the_rotate_half_formula(rotator):
    keys = torch.randn(3, 2, 6, 16, dtype=torch.float64)
    angles = 123 * rotator.inv_freq_on(keys.device).double()
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    torch.testing.assert_close(rotator.shift(keys, 123), keys * cos + rotate_half(keys) * sin, atol=1e-12, rtol=0)


def test_rotating_keys_into_themselves_or_with_tables_of_another_width(rotator):
    keys = torch.randn(1, 2, 5, 16)
    expected = rotator.shift(keys, 9)
    assert rotator.shift(keys, 9, out=keys) is keys  # out may be the keys themselves
    torch.testing.assert_close(keys, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="head_dim 8"):
        rotator.shift(keys[..., :8], 9)  # a rotator of 16 channels for 8-wide heads


def test_half_precision_keys_rotate_in_float32(rotator):
    keys = torch.randn(1, 2, 4, 16)
    moved = rotator.shift(keys.to(torch.bfloat16), 100)
    assert moved.dtype == torch.bfloat16
    torch.testing.assert_close(moved.float(), rotator.shift(keys, 100), atol=2e-2, rtol=2e-2)


def test_load_time_check_passes_on_real_models(model, tokenizer):
    inv_freq = model.model.rotary_emb.inv_freq
    assert check_rerotation(model, RopeRotator(inv_freq), tokenizer) < 1e-5


def test_load_time_check_fails_with_wrong_frequencies(model, tokenizer):
    wrong = RopeRotator(model.model.rotary_emb.inv_freq * 1.5)  # e.g. a scaling not modelled
    with pytest.raises(RopeCheckError, match="RoPE check failed"):
        check_rerotation(model, wrong, tokenizer)


def test_load_time_check_fails_for_interleaved_rotation(model, tokenizer):
    """An interleaved (GPT-J style) re-rotation must not pass for a half-split model."""

    class Interleaved(RopeRotator):
        def shift(self, keys, delta):
            pairs = keys.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            moved = super().shift(pairs, delta)
            return moved.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)

    with pytest.raises(RopeCheckError):
        check_rerotation(model, Interleaved(model.model.rotary_emb.inv_freq), tokenizer)


@pytest.mark.model
def test_load_time_check_covers_layers_without_rope(tokenizer):
    """A model whose last layer has no rotary embedding (SmolLM3-style) must not pass."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    from kvcomm_agents import KVCommEngine, UnsupportedModelError

    torch.manual_seed(0)
    config = SmolLM3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 1, 1, 0],
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = SmolLM3ForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="without rotary"):
        KVCommEngine(model, tokenizer)
    with pytest.raises(RopeCheckError, match="layer-3"):
        check_rerotation(model, RopeRotator(model.model.rotary_emb.inv_freq), tokenizer)
