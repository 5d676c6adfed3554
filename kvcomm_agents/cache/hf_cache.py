"""The only module that touches transformers' cache internals and forward keywords.

Supports transformers 5.17 to 5.x: 5.17's forward takes ``past_key_values=``, newer releases
prefer ``cache=`` (``past_key_values=`` warns there and goes in 5.40). Cache tensors are
``[batch, kv_heads, tokens, head_dim]`` per layer, KV heads not repeated for GQA.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from transformers import DynamicCache, PreTrainedModel

__all__ = [
    "new_cache",
    "cache_from_layers",
    "layer_kv",
    "num_cached",
    "num_layers",
    "run_forward",
]


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model``."""
    return DynamicCache(config=model.config)


def cache_from_layers(
    model: PreTrainedModel, layers: list[tuple[torch.Tensor, torch.Tensor]]
) -> DynamicCache:
    """A cache holding the given per-layer ``(keys, values)``, each ``[1, kv_heads, n, head_dim]``.

    Built with ``ddp_cache_data`` (assigning into an empty cache's layers is silently dropped).
    The tensors are taken as they are; later forwards concatenate onto copies, never in place.
    """
    return DynamicCache(ddp_cache_data=layers, config=model.config)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, values)`` of one layer, ``[batch, kv_heads, tokens, head_dim]`` each."""
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
) -> torch.Tensor:
    """One forward pass that appends to ``cache`` in place.

    Args:
        input_ids: ``[1, q]``.
        cache: the cache to extend (mutated).
        position_ids: ``[1, q]``; None lets the model count from the cache length.
        attention_mask: None for the model's own causal mask, or a ready 4-D additive mask
            ``[1, 1, q, cached + q]``.
        last_logits_only: compute the LM head for the last position only.

    Returns:
        Logits ``[1, q or 1, vocab]``.
    """
    kwargs = {_cache_keyword(type(model)): cache, "use_cache": True}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if last_logits_only and _accepts_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = 1
    return model(input_ids=input_ids, **kwargs).logits
