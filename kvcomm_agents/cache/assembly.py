"""Assemble a receiver's cache from exact and re-rotated pieces, and prefill the rest in one pass.

Cache slots are in *storage* order (exact prefix, then each re-rotated run, then the computed
tokens), not position order; the explicit 4-D mask lets a query see a key only if the key's
position is not later than its own. Without it transformers lets new tokens attend to every
cached token, including reused KV of text that comes later in the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel

from ..plan import CallPlan
from . import hf_cache
from .rope import RopeRotator
from .segments import stacked_layers

__all__ = ["position_mask", "PrefillResult", "prefill", "kv_at_positions", "stacked_kv_at_positions", "assemble_layer", "assemble"]


def position_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, *, dtype: torch.dtype, device
) -> torch.Tensor:
    """Additive causal mask by position.

    Args:
        query_positions: ``[Q]`` positions of the tokens being computed.
        key_positions: ``[K]`` positions of every key slot (cached slots then the queries).

    Returns:
        ``[1, 1, Q, K]`` in ``dtype``: 0 where ``key_pos <= query_pos``, the dtype's minimum
        elsewhere (works for eager and SDPA attention).
    """
    visible = key_positions[None, :].to(device) <= query_positions[:, None].to(device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


@dataclass
class PrefillResult:
    """Outcome of prefilling one prompt.

    Attributes:
        logits: ``[vocab]`` float32 logits of the last prompt token.
        cache: the filled cache, slots in storage order.
        slot_positions: ``[C]`` int64 CPU positions of the cache slots, in storage order.
        align_s: seconds spent re-rotating and assembling the cache.
    """

    logits: torch.Tensor
    cache: DynamicCache
    slot_positions: torch.Tensor
    align_s: float


def assemble_layer(
    plan: CallPlan, rotator: RopeRotator, layer: int, position_offset: int = 0, *, with_prefix: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` ``[1, kv_heads, reused, head_dim]`` of one layer's reused slots in
    storage order: the exact prefix (unless ``with_prefix`` is False), then each re-rotated run
    (plus its offsets) moved to its prompt positions."""
    keys, values = [], []
    prefix_len = plan.prefix_length
    if plan.prefix is not None and with_prefix:
        prefix_keys = plan.prefix.entry.keys[layer][:, :, :prefix_len]
        keys.append(rotator.shift(prefix_keys, position_offset) if position_offset else prefix_keys)
        values.append(plan.prefix.entry.values[layer][:, :, :prefix_len])
    for run in plan.runs:
        start, end = run.segment_start, run.segment_start + run.length
        run_keys = run.segment.keys[layer][:, :, start:end]
        run_values = run.segment.values[layer][:, :, start:end]
        if run.key_offsets is not None and layer > 0:
            # learned context offsets are added in the canonical frame, before rotation
            run_keys = (run_keys.float() + run.key_offsets[layer - 1, None].to(run_keys.device)).to(run_keys.dtype)
            run_values = (run_values.float() + run.value_offsets[layer - 1, None].to(run_values.device)).to(run_values.dtype)
        keys.append(rotator.shift(run_keys, run.shift + position_offset))
        values.append(run_values)
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


def _with_offsets(kv: torch.Tensor, offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """``kv`` ``[L, H, n, D]`` with ``offsets`` ``[L-1, H, n, D]`` added to layers 1..L-1 (a copy)."""
    if offsets is None:
        return kv
    out = kv.to(torch.float32, copy=True)
    out[1:] += offsets.to(out.device)
    return out.to(kv.dtype)


def _assemble_stacked(
    plan: CallPlan, rotator: RopeRotator, position_offset: int
) -> Optional[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every layer's reused slots at once, as views of ``[L, kv_heads, reused, head_dim]``
    tensors: one rotation, one offset addition and one concatenation per run instead of one per
    layer. None when some KV holder's layers live on several devices (``device_map``)."""
    keys, values = [], []
    if plan.prefix is not None:
        stacked = stacked_layers(plan.prefix.entry)
        if stacked is None:
            return None
        prefix_keys = stacked[0][:, :, : plan.prefix_length]
        keys.append(rotator.shift(prefix_keys, position_offset) if position_offset else prefix_keys)
        values.append(stacked[1][:, :, : plan.prefix_length])
    for run in plan.runs:
        stacked = stacked_layers(run.segment)
        if stacked is None:
            return None
        window = slice(run.segment_start, run.segment_start + run.length)
        keys.append(rotator.shift(_with_offsets(stacked[0][:, :, window], run.key_offsets), run.shift + position_offset))
        values.append(_with_offsets(stacked[1][:, :, window], run.value_offsets))
    if len(keys) == 1:  # an exact prefix alone: views, the cache's update makes the one copy
        all_keys, all_values = keys[0], values[0]
    else:
        all_keys, all_values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return [(all_keys[i : i + 1], all_values[i : i + 1]) for i in range(all_keys.shape[0])]


def assemble(plan: CallPlan, rotator: RopeRotator, num_layers: int, position_offset: int = 0):
    """Per-layer ``(keys, values)`` ``[1, kv_heads, reused, head_dim]`` of the reused slots, in
    the order of ``plan.reused_positions()`` (recomputed positions dropped)."""
    layers = _assemble_stacked(plan, rotator, position_offset)
    if layers is None:
        layers = [assemble_layer(plan, rotator, i, position_offset) for i in range(num_layers)]
    if plan.recompute is not None:
        positions = torch.cat([torch.arange(plan.prefix_length)]
                              + [torch.arange(run.prompt_start, run.prompt_end) for run in plan.runs])
        keep = (~torch.isin(positions, plan.recompute)).nonzero().flatten()
        index = keep.to(layers[0][0].device)
        layers = [(k.index_select(2, index.to(k.device)), v.index_select(2, index.to(v.device))) for k, v in layers]
    return layers


def prefill(
    model: PreTrainedModel, rotator: RopeRotator, plan: CallPlan, *, clock=None, position_offset: int = 0
) -> PrefillResult:
    """Build the cache of ``plan``'s reused pieces and compute everything else in one forward.

    With nothing reused this is a plain forward over the whole prompt (transformers' own mask);
    with an exact prefix only, a plain forward over the tail. Otherwise the computed tokens go
    through one forward with :func:`position_mask`.

    ``position_offset`` runs the whole prompt ``c`` positions later (its first token at ``c``);
    RoPE attention is relative, so the logits must not change: the canonical-frame check.
    ``slot_positions`` stay prompt indices.
    """
    import time

    clock = clock or time.perf_counter
    device = model.get_input_embeddings().weight.device
    ids = plan.prompt_ids
    computed = plan.computed_positions()
    started = clock()
    if plan.reused_tokens == 0:
        cache = hf_cache.new_cache(model)
        mask = None
        cached_positions = torch.empty(0, dtype=torch.long)
    else:
        layers = assemble(plan, rotator, model.config.num_hidden_layers, position_offset)
        cache = hf_cache.cache_from_layers(model, layers)
        cached_positions = plan.reused_positions()
        mask = None
        if plan.runs:
            slots = torch.cat([cached_positions, computed])
            mask = position_mask(computed, slots, dtype=model.dtype, device=device)
    align_s = clock() - started
    position_ids = (computed[None] + position_offset).to(device) if plan.reused_tokens or position_offset else None
    logits = hf_cache.run_forward(
        model,
        ids[computed][None].to(device),
        cache,
        position_ids=position_ids,
        attention_mask=mask,
    )
    slot_positions = torch.cat([cached_positions, computed])
    return PrefillResult(logits[0, -1].float(), cache, slot_positions, align_s)


def _slots_of(slot_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    lookup = torch.full((int(slot_positions.max()) + 1,), -1, dtype=torch.long)
    lookup[slot_positions] = torch.arange(slot_positions.numel())
    slots = lookup[positions]
    if bool((slots < 0).any()):
        raise ValueError("asked for positions the cache does not hold")
    return slots


def stacked_kv_at_positions(
    cache: DynamicCache, slot_positions: torch.Tensor, positions: torch.Tensor
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """As :func:`kv_at_positions`, but every layer in one ``[L, kv_heads, n, head_dim]`` keys and
    one values tensor (gathered straight into them); None if the layers live on several devices."""
    layers = [hf_cache.layer_kv(cache, layer) for layer in range(hf_cache.num_layers(cache))]
    if len({k.device for k, _ in layers}) != 1:
        return None
    first_k, first_v = layers[0]
    index = _slots_of(slot_positions, positions).to(first_k.device)
    keys = first_k.new_empty((len(layers), first_k.shape[1], index.numel(), first_k.shape[3]))
    values = first_v.new_empty((len(layers), first_v.shape[1], index.numel(), first_v.shape[3]))
    for i, (k, v) in enumerate(layers):
        torch.index_select(k[0], 1, index, out=keys[i])
        torch.index_select(v[0], 1, index, out=values[i])
    return keys, values


def kv_at_positions(
    cache: DynamicCache, slot_positions: torch.Tensor, positions: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy the KV of the given prompt positions out of a cache, in the order given.

    Args:
        cache: a cache whose slot ``i`` holds position ``slot_positions[i]``.
        slot_positions: ``[C]`` int64 (every position at most once).
        positions: ``[n]`` int64 positions wanted, each present in ``slot_positions``.

    Returns:
        Per-layer keys and values, ``[1, kv_heads, n, head_dim]``, new contiguous tensors.
    """
    slots = _slots_of(slot_positions, positions)
    keys, values = [], []
    for layer in range(hf_cache.num_layers(cache)):
        k, v = hf_cache.layer_kv(cache, layer)
        index = slots.to(k.device)
        keys.append(k.index_select(2, index))
        values.append(v.index_select(2, index))
    return keys, values
