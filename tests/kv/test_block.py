"""``KVBlock`` against per-layer loops written here: every operation on a stacked block (also
with several device groups) gives what doing it layer by layer on ``[1, H, T, D]`` tensors gives."""

import pytest
import torch

from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.rope import RopeRotator

LAYERS, HEADS, TOKENS, DIM = 5, 2, 7, 8
INV_FREQ = (1.0 / (10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))).float().double()  # as a model holds it


def per_layer(seed: int = 0, tokens: int = TOKENS, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, HEADS, tokens, DIM, generator=g).to(dtype), torch.randn(1, HEADS, tokens, DIM, generator=g).to(dtype))
            for _ in range(LAYERS)]


def grouped(layers, starts: tuple[int, ...]) -> KVBlock:
    """A block with the given device groups (all on the CPU), built by hand from per-layer KV."""
    bounds = list(starts) + [len(layers)]
    keys = tuple(torch.cat([k for k, _ in layers[a:b]]) for a, b in zip(bounds, bounds[1:]))
    values = tuple(torch.cat([v for _, v in layers[a:b]]) for a, b in zip(bounds, bounds[1:]))
    return KVBlock(keys, values, starts)


def assert_layers(block: KVBlock, expected) -> None:
    assert block.num_layers == len(expected)
    for i, (k, v) in enumerate(expected):
        got_k, got_v = block.layer(i)
        assert got_k.shape == k.shape and got_v.shape == v.shape, i
        torch.testing.assert_close(got_k, k, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_v, v, atol=1e-6, rtol=0)


def rotate(keys: torch.Tensor, delta: int) -> torch.Tensor:
    """RoPE by ``delta`` positions, from the formula (float64), independent of ``kv.rope``."""
    angles = delta * INV_FREQ
    cos, sin = torch.cat([angles.cos(), angles.cos()]), torch.cat([angles.sin(), angles.sin()])
    x = keys.double()
    half = torch.cat([-x[..., DIM // 2 :], x[..., : DIM // 2]], dim=-1)
    return (x * cos + half * sin).to(keys.dtype)


GROUPINGS = [(0,), (0, 2), (0, 1, 4)]


@pytest.mark.parametrize("starts", GROUPINGS)
def test_layers_and_shape(starts):
    layers = per_layer()
    block = grouped(layers, starts)
    assert_layers(block, layers)
    assert [k.data_ptr() for k, _ in block.layers()] == [block.layer(i)[0].data_ptr() for i in range(LAYERS)]
    assert (block.num_tokens, block.num_layers, block.dtype) == (TOKENS, LAYERS, torch.float32)
    assert block.nbytes == 2 * LAYERS * HEADS * TOKENS * DIM * 4


def test_stacked_is_one_group_taken_as_is():
    keys, values = torch.randn(LAYERS, HEADS, TOKENS, DIM), torch.randn(LAYERS, HEADS, TOKENS, DIM)
    block = KVBlock.stacked(keys, values)
    assert block.starts == (0,) and block.keys[0] is keys and block.values[0] is values
    assert_layers(block, [(keys[i : i + 1], values[i : i + 1]) for i in range(LAYERS)])


def test_from_layers_groups_consecutive_layers_by_device():
    layers = per_layer()
    one = KVBlock.from_layers(layers)
    assert one.starts == (0,) and len(one.keys) == 1
    assert_layers(one, layers)
    assert one.keys[0].data_ptr() != layers[0][0].data_ptr()  # a copy
    # layers 0-1 on the CPU, 2-3 on the meta device, 4 on the CPU again: three groups
    devices = ["cpu", "cpu", "meta", "meta", "cpu"]
    mixed = KVBlock.from_layers([(k.to(d), v.to(d)) for (k, v), d in zip(layers, devices)])
    assert mixed.starts == (0, 2, 4) and [k.shape[0] for k in mixed.keys] == [2, 2, 1]
    assert [k.device.type for k in mixed.keys] == ["cpu", "meta", "cpu"]
    torch.testing.assert_close(mixed.layer(4)[0], layers[4][0], atol=0, rtol=0)
    torch.testing.assert_close(mixed.layer(1)[1], layers[1][1], atol=0, rtol=0)


@pytest.mark.parametrize("starts", GROUPINGS)
def test_window_and_select(starts):
    layers = per_layer()
    block = grouped(layers, starts)
    assert_layers(block.window(2, 5), [(k[:, :, 2:5], v[:, :, 2:5]) for k, v in layers])
    assert block.window(2, 5).num_tokens == 3 and block.window(2, 5).starts == starts
    index = torch.tensor([6, 0, 3, 3])
    assert_layers(block.select(index), [(k[:, :, index], v[:, :, index]) for k, v in layers])


@pytest.mark.parametrize("starts", GROUPINGS)
@pytest.mark.parametrize("delta", [0, 5, -13, 1000])
def test_shifted_rotates_keys_only(starts, delta):
    layers = per_layer(dtype=torch.float64)
    block = grouped(layers, starts)
    moved = block.shifted(RopeRotator(INV_FREQ.float()), delta)
    assert_layers(moved, [(rotate(k, delta), v) for k, v in layers])
    assert all(a is b for a, b in zip(moved.values, block.values))  # values shared
    if delta == 0:
        assert moved is block


@pytest.mark.parametrize("starts", GROUPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_offsets_adds_to_layers_above_the_first(starts, dtype):
    layers = per_layer(dtype=dtype)
    block = grouped(layers, starts)
    g = torch.Generator().manual_seed(5)
    key_off = torch.randn(LAYERS - 1, HEADS, TOKENS, DIM, generator=g)
    val_off = torch.randn(LAYERS - 1, HEADS, TOKENS, DIM, generator=g)
    expected = [layers[0]] + [((k.float() + key_off[i - 1 : i]).to(dtype), (v.float() + val_off[i - 1 : i]).to(dtype))
                              for i, (k, v) in enumerate(layers) if i > 0]
    out = block.with_offsets(key_off, val_off)
    assert_layers(out, expected)
    assert out.dtype == dtype and out.starts == starts
    assert_layers(block, layers)  # the block itself is unchanged
    assert block.with_offsets(None, None) is block


@pytest.mark.parametrize("starts", GROUPINGS)
def test_upper_layers_are_layers_one_to_last(starts):
    layers = per_layer()
    keys, values = grouped(layers, starts).upper_layers()
    torch.testing.assert_close(keys, torch.cat([k for k, _ in layers[1:]]), atol=0, rtol=0)
    torch.testing.assert_close(values, torch.cat([v for _, v in layers[1:]]), atol=0, rtol=0)


@pytest.mark.parametrize("starts", GROUPINGS)
def test_cat_concatenates_tokens_per_layer(starts):
    parts = [per_layer(seed, tokens) for seed, tokens in ((1, 3), (2, 1), (3, 4))]
    blocks = [grouped(p, starts) for p in parts]
    joined = KVBlock.cat(blocks)
    assert joined.num_tokens == 8 and joined.starts == starts
    assert_layers(joined, [(torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
                           for i in range(LAYERS)])
    assert KVBlock.cat(blocks[:1]) is blocks[0]


@pytest.mark.parametrize("starts", GROUPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_assembled_rotates_each_piece_straight_into_one_block(starts, dtype):
    """Pieces (windows of other blocks, some not moved) rotated into one block equal each piece
    shifted by its delta, then concatenated; a single unmoved piece is returned as it is."""
    parts = [per_layer(seed, tokens, dtype) for seed, tokens in ((1, 3), (2, 1), (3, 4))]
    deltas = (40, 0, -3)
    blocks = [grouped(p, starts).window(0, len(p[0][0][0, 0])) for p in parts]
    rotator = RopeRotator(INV_FREQ.float())
    joined = KVBlock.assembled(list(zip(blocks, deltas)), rotator)
    assert joined.num_tokens == 8 and joined.starts == starts and joined.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    for i in range(LAYERS):
        keys, values = joined.layer(i)
        expected = torch.cat([rotate(p[i][0].float(), d) for p, d in zip(parts, deltas)], dim=2)
        torch.testing.assert_close(keys.float(), expected, atol=tolerance, rtol=0)
        assert torch.equal(values, torch.cat([p[i][1] for p in parts], dim=2))
    assert KVBlock.assembled([(blocks[1], 0)], rotator) is blocks[1]


def test_operations_compose_like_the_assembly_of_a_run():
    """window -> offsets -> shift, as the assembly treats a run, equals the per-layer recipe."""
    layers = per_layer(dtype=torch.float64)
    block = grouped(layers, (0, 3))
    key_off = torch.randn(LAYERS - 1, HEADS, 3, DIM, dtype=torch.float64)
    val_off = torch.randn(LAYERS - 1, HEADS, 3, DIM, dtype=torch.float64)
    out = block.window(2, 5).with_offsets(key_off, val_off).shifted(RopeRotator(INV_FREQ.float()), 40)
    expected = []
    for i, (k, v) in enumerate(layers):
        k, v = k[:, :, 2:5], v[:, :, 2:5]
        if i:
            k, v = k + key_off[i - 1 : i], v + val_off[i - 1 : i]
        expected.append((rotate(k, 40), v))
    assert_layers(out, expected)
