"""The only module that touches transformers' caches and forward keywords.

Supports transformers 5.17 to 5.x: 5.17's forward takes ``past_key_values=``, newer releases
prefer ``cache=`` (``past_key_values=`` warns there and goes in 5.40). Cache tensors are
``[batch, kv_heads, tokens, head_dim]`` per layer, KV heads not repeated for GQA.

Everything above this module (matching, planning, anchors, alignment, capture) works on token
ids and :class:`~kvcomm_agents.kv.block.KVBlock` tensors, so a second runtime (vLLM) can reuse it.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .. import forwards
from ..kv.block import KVBlock, device_groups
from .growing_cache import GrowingLayer, hold
from .placement import input_device, kv_devices, wait_for

__all__ = ["new_cache", "cache_from_block", "layer_kv", "num_cached", "num_layers", "run_forward",
           "input_device", "kv_devices", "wait_for", "position_mask", "Prefill", "prefill", "kv_at_positions", "kv_reader",
           "batchable", "left_padded", "take_row", "keep_first"]


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model``."""
    return DynamicCache(config=model.config)


def cache_from_block(model: PreTrainedModel, block: KVBlock) -> DynamicCache:
    """A cache holding ``block``'s KV (its per-layer views, taken as they are).

    Built with ``ddp_cache_data`` (assigning into an empty cache's layers is silently dropped);
    later forwards concatenate onto copies, never in place.
    """
    return DynamicCache(ddp_cache_data=block.layers(), config=model.config)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of one layer, ``[batch, kv_heads, tokens, head_dim]`` each: views a
    growing layer (:mod:`.growing_cache`) may write over after a cut, so copy what is kept."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def num_layers(cache: DynamicCache) -> int:
    """Layers held by the cache."""
    return len(cache.layers)


def num_cached(cache: DynamicCache) -> int:
    """Tokens whose KV every layer still holds (a sliding-window layer may have dropped some)."""
    return min(layer.keys.shape[-2] if layer.keys is not None else 0 for layer in cache.layers)


@lru_cache(maxsize=None)
def _cache_keyword(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@lru_cache(maxsize=None)
def _accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def run_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    last_logits_only: bool = True,
    logits_rows: Optional[int] = None,
) -> torch.Tensor:
    """One forward pass that appends to ``cache`` in place; its query tokens are charged to the
    active :func:`kvcomm_agents.forwards.charging` tally.

    Args:
        input_ids: ``[B, q]`` (``B > 1``: a batch, :func:`left_padded`).
        cache: the cache to extend (mutated).
        position_ids: ``[B, q]``; None lets the model count from the cache length.
        attention_mask: None for the model's own causal mask, a ready 4-D additive mask
            ``[1, 1, q, cached + q]``, or a ``[B, cached + q]`` padding mask (1: attend).
        last_logits_only: compute the LM head for the last position only.
        logits_rows: compute it for the last that many positions (overrides ``last_logits_only``).

    Returns:
        Logits ``[B, q, vocab]`` (``[B, 1, vocab]`` with ``last_logits_only``; ``[B, logits_rows,
        vocab]``), where the model can compute fewer rows (``logits_to_keep``); else ``[B, q, vocab]``.
    """
    kwargs = {_cache_keyword(type(model)): cache, "use_cache": True}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    rows = logits_rows if logits_rows is not None else (1 if last_logits_only else None)
    if rows is not None and _accepts_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = rows
    logits = model(input_ids=input_ids, **kwargs).logits
    forwards.charge(int(input_ids.numel()))
    return logits[:, -rows:] if rows is not None else logits


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
class Prefill:
    """Outcome of prefilling one prompt.

    Attributes:
        logits: ``[vocab]`` float32 logits of the last prompt token.
        cache: the filled cache, slots in storage order.
        slot_positions: ``[C]`` int64 CPU prompt positions of the cache slots, in storage order.
        align_s: seconds spent building the cache from the reused KV and the mask.
    """

    logits: torch.Tensor
    cache: DynamicCache
    slot_positions: torch.Tensor
    align_s: float


MASK_BUDGET = 1 << 24
"""Most query x key mask elements one masked forward may build (64 MiB as float32): a prompt
whose masked prefill would exceed it is computed in position-ordered windows instead."""

MIN_WINDOW = 1024
"""Fewest queries of a window (unless fewer remain): bounds the number of forwards, each of
which copies the cache once, at the price of a mask of ``MIN_WINDOW x prompt`` elements."""


def prefill(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    computed: torch.Tensor,
    reused: Optional[KVBlock] = None,
    reused_positions: Optional[torch.Tensor] = None,
    *,
    masked: bool = False,
    position_offset: int = 0,
    mask_budget: Optional[int] = None,
    min_window: Optional[int] = None,
) -> Prefill:
    """Put ``reused`` KV into a cache and compute the ``computed`` positions.

    Without ``masked`` (no reuse, or reuse that is a plain prefix of the prompt) this is one
    forward with the model's own causal mask. With ``masked`` (reused KV anywhere else) a query
    may see a key only if the key's position is not later than its own (:func:`position_mask`),
    since transformers' own mask would let new tokens see every cached token:

    - small prompts (``computed x (reused + computed)`` within ``mask_budget``): one forward, cache
      slots in storage order (the reused slots, then the computed tokens);
    - larger ones: :func:`_windows` cuts the computed tokens into position-ordered windows (the
      text before the first reused slot, then windows whose mask fits the budget or that hold
      :data:`MIN_WINDOW` queries); each window splices in the reused KV that precedes its last
      query and runs one forward, with a position mask only where reused slots interleave its
      queries. Memory stays linear in the prompt length (a window's mask is at most
      ``max(mask_budget, MIN_WINDOW x prompt)`` elements, not ``prompt x prompt``).

    Args:
        prompt_ids: ``[N]`` int64 CPU prompt ids.
        computed: ``[Q]`` int64 ascending positions to compute (the last prompt token among them).
        reused: KV of the reused slots (keys already at their prompt positions), or None.
        reused_positions: ``[R]`` ascending prompt positions of ``reused``'s tokens, in its order;
            with ``computed`` they cover the prompt.
        position_offset: run the prompt that many positions later (RoPE is relative: the logits
            must not change; the canonical-frame check). ``slot_positions`` stay prompt indices.
        mask_budget: most mask elements one forward may build (None: :data:`MASK_BUDGET`).
        min_window: fewest queries of a window (None: :data:`MIN_WINDOW`).
    """
    started = time.perf_counter()
    if reused is None or not masked:
        return _single_forward(model, prompt_ids, computed, reused, reused_positions, False, position_offset,
                               started)
    budget = MASK_BUDGET if mask_budget is None else mask_budget
    queries, keys = computed.numel(), computed.numel() + reused_positions.numel()
    if queries * keys <= budget:
        return _single_forward(model, prompt_ids, computed, reused, reused_positions, True, position_offset,
                               started)
    windows = _windows(computed, reused_positions, budget, MIN_WINDOW if min_window is None else min_window)
    return _windowed(model, prompt_ids, computed, reused, reused_positions, windows, position_offset, started)


def _single_forward(model, prompt_ids, computed, reused, reused_positions, masked, position_offset,
                    started) -> Prefill:
    device = input_device(model)
    mask = None
    if reused is None:
        cache = new_cache(model)
        cached_positions = torch.empty(0, dtype=torch.long)
    else:
        cache = cache_from_block(model, reused)
        cached_positions = reused_positions
        if masked:
            mask = position_mask(computed, torch.cat([cached_positions, computed]), dtype=model.dtype, device=device)
    align_s = time.perf_counter() - started
    position_ids = (computed[None] + position_offset).to(device) if reused is not None or position_offset else None
    logits = run_forward(model, prompt_ids[computed][None].to(device), cache, position_ids=position_ids,
                         attention_mask=mask)
    return Prefill(logits[0, -1].float(), cache, torch.cat([cached_positions, computed]), align_s)


def _windows(computed: torch.Tensor, reused_positions: torch.Tensor, budget: int,
             min_window: int = MIN_WINDOW) -> list[tuple[int, int]]:
    """Cut ``computed`` (``[Q]`` ascending) into ``[s, e)`` index ranges computed one forward each.

    The computed tokens before the first reused slot form the first window (an empty cache: the
    model's own causal attention, no mask). Every later window's keys are the reused slots before
    its last query plus the queries so far, so its mask has ``(e - s) * (reused_before[e - 1] + e)``
    elements: windows grow greedily while that fits ``budget``, and hold at least ``min_window``
    queries (unless fewer remain).
    """
    reused_before = torch.searchsorted(reused_positions, computed).tolist()
    total = len(reused_before)
    lead = int(torch.searchsorted(computed, reused_positions[0])) if reused_positions.numel() else total
    windows, start = ([(0, lead)] if lead else []), lead
    while start < total:
        low, high = min(start + min_window, total), total  # the largest end that fits, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            if (mid - start) * (reused_before[mid - 1] + mid) <= budget:
                low = mid
            else:
                high = mid - 1
        windows.append((start, low))
        start = low
    return windows


def _windowed(model, prompt_ids, computed, reused, reused_positions, windows, position_offset,
              started) -> Prefill:
    """Prefill window by window in position order, splicing reused KV in between (slots ascending
    by position except where a window's reused slots interleave its queries)."""
    device = input_device(model)
    cache = new_cache(model)
    slots: list[torch.Tensor] = []
    align_s, spliced, logits = 0.0, 0, None
    for start, end in windows:
        tick = time.perf_counter()
        queries = computed[start:end]
        last = int(queries[-1])
        upto = int(torch.searchsorted(reused_positions, last))  # reused slots before the last query
        mask = None
        if upto > spliced:
            piece = reused.window(spliced, upto)
            for layer, (keys, values) in enumerate(piece.layers()):
                cache.update(keys, values, layer)
            slots.append(reused_positions[spliced:upto])
            if int(reused_positions[upto - 1]) > int(queries[0]):  # reused slots between queries
                keys_at = torch.cat(slots + [queries])
                mask = position_mask(queries, keys_at, dtype=model.dtype, device=device)
            spliced = upto
        slots.append(queries)
        align_s += time.perf_counter() - tick
        logits = run_forward(model, prompt_ids[queries][None].to(device), cache,
                             position_ids=(queries[None] + position_offset).to(device), attention_mask=mask)
    return Prefill(logits[0, -1].float(), cache, torch.cat(slots), align_s)


def _slots_of(slot_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Cache slots of ``positions``; slots marked with a negative position are never returned
    (another context's tokens sharing the cache, :mod:`kvcomm_agents.framing`)."""
    held = slot_positions >= 0
    lookup = torch.full((int(slot_positions.max()) + 1,), -1, dtype=torch.long)
    lookup[slot_positions[held]] = torch.arange(slot_positions.numel())[held]
    slots = lookup[positions]
    if bool((slots < 0).any()):
        raise ValueError("asked for positions the cache does not hold")
    return slots


def kv_at_positions(cache: DynamicCache, slot_positions: torch.Tensor, positions: torch.Tensor) -> KVBlock:
    """Copy the KV of the given prompt positions out of a cache, in the order given.

    Args:
        cache: a cache whose slot ``i`` holds position ``slot_positions[i]``.
        slot_positions: ``[C]`` int64 (every position at most once; negative: a slot to ignore).
        positions: ``[n]`` int64 positions wanted, each present in ``slot_positions``.

    Returns:
        A new block (gathered straight into one stacked tensor per device group).
    """
    layers = [layer_kv(cache, i) for i in range(num_layers(cache))]
    slots = _slots_of(slot_positions, positions)
    keys, values, starts = [], [], []
    for i, j in device_groups([k.device for k, _ in layers]):
        first_k, first_v = layers[i]
        index = slots.to(first_k.device)
        k_out = first_k.new_empty((j - i, first_k.shape[1], index.numel(), first_k.shape[3]))
        v_out = first_v.new_empty((j - i, first_v.shape[1], index.numel(), first_v.shape[3]))
        for n, (k, v) in enumerate(layers[i:j]):
            torch.index_select(k[0], 1, index, out=k_out[n])
            torch.index_select(v[0], 1, index, out=v_out[n])
        keys.append(k_out)
        values.append(v_out)
        starts.append(i)
    return KVBlock(tuple(keys), tuple(values), tuple(starts))


def append_kv(cache: DynamicCache, block: KVBlock) -> None:
    """Append ``block``'s KV (``[L][1, kv_heads, n, head_dim]``) to every layer of ``cache`` as
    ``n`` more slots, on each layer's device and in its dtype."""
    for layer, (keys, values) in enumerate(block.layers()):
        held = layer_kv(cache, layer)[0]
        cache.update(keys.to(held.device, held.dtype), values.to(held.device, held.dtype), layer)


def keep_slots(cache: DynamicCache, slots: torch.Tensor) -> None:
    """Keep only the cache slots ``slots`` (``[k]`` int64 slot indices, in the order given) in
    every layer of ``cache``; the others are dropped."""
    for layer in cache.layers:
        index = slots.to(layer.keys.device)
        hold(layer, layer.keys.index_select(-2, index), layer.values.index_select(-2, index))


def kv_reader(cache: DynamicCache, slot_positions: torch.Tensor):
    """``positions -> KVBlock`` (:func:`kv_at_positions`) over a filled cache whose slot ``i``
    holds position ``slot_positions[i]`` (``[C]`` int64); the reader takes ``[n]`` int64 positions."""
    return lambda positions: kv_at_positions(cache, slot_positions, positions)


def batchable(cache: DynamicCache) -> bool:
    """Whether ``cache`` can be stepped in a batch (:func:`left_padded`): one sequence, every
    layer a plain full-attention layer holding KV (no sliding window, no quantization)."""
    return bool(cache.layers) and all(type(layer) in (DynamicLayer, GrowingLayer) and layer.keys is not None
                                      and layer.keys.shape[0] == 1 for layer in cache.layers)


def left_padded(model: PreTrainedModel, caches: list[DynamicCache]) -> tuple[DynamicCache, list[int]]:
    """One cache of ``B = len(caches)`` rows, each cache's slots left-padded with zeros to the
    longest (``[B, kv_heads, T, head_dim]`` per layer, copies), and the padding slots per row
    (mask them: ``attention_mask[row, :pad] = 0``)."""
    lengths = [num_cached(cache) for cache in caches]
    pads = [max(lengths) - n for n in lengths]
    layers = []
    for layer in range(num_layers(caches[0])):
        rows = [layer_kv(cache, layer) for cache in caches]
        keys, values = rows[0]
        k_out = keys.new_zeros((len(caches), keys.shape[1], max(lengths), keys.shape[3]))
        v_out = values.new_zeros((len(caches), values.shape[1], max(lengths), values.shape[3]))
        for row, ((k, v), pad) in enumerate(zip(rows, pads)):
            k_out[row, :, pad:] = k[0]
            v_out[row, :, pad:] = v[0]
        layers.append((k_out, v_out))
    return DynamicCache(ddp_cache_data=layers, config=model.config), pads


def take_row(batch: DynamicCache, row: int, pad: int, cache: DynamicCache) -> None:
    """Make ``cache`` hold ``batch``'s row ``row`` without its ``pad`` padding slots (copies)."""
    for source, held in zip(batch.layers, cache.layers):
        hold(held, source.keys[row:row + 1, :, pad:].clone(), source.values[row:row + 1, :, pad:].clone())


def keep_first(cache: DynamicCache, n: int) -> None:
    """Keep the first ``n`` slots of every layer of ``cache`` (views: nothing allocated)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]

