"""Loading models: the embedded default, a local folder, or a hub id when online."""

from __future__ import annotations

import os
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .embedded import embedded_model_dir
from .errors import ModelNotAvailableError

__all__ = ["load_model"]


def _resolve_dtype(dtype, device: str, device_map) -> torch.dtype | str:
    if dtype is not None:
        return getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    on_cuda = (device or "").startswith("cuda") or (device_map is not None and torch.cuda.is_available())
    return "auto" if on_cuda else torch.float32


def load_model(
    model: Optional[str | os.PathLike] = None,
    *,
    dtype=None,
    device: Optional[str] = None,
    device_map=None,
    attn_implementation: Optional[str] = None,
    cache_dir: Optional[str | os.PathLike] = None,
) -> tuple[PreTrainedModel, object]:
    """Load a causal LM and its tokenizer.

    Args:
        model: a local folder or hub id; None loads the embedded SmolLM2-135M-Instruct.
        dtype: None means float32 on CPU and the checkpoint's dtype on CUDA.
        device: "cpu", "cuda", "cuda:1", ...; None picks CUDA when available (ignored with
            ``device_map``).
        device_map: passed to transformers/accelerate to spread layers over devices.
        attn_implementation: "sdpa" (default) or "eager"; kernels that ignore 4-D masks are
            refused for reuse at engine construction.
        cache_dir: where the embedded model is converted to (and the hub cache, for hub ids).
    """
    if device_map is None and device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    source = str(embedded_model_dir(cache_dir)) if model is None else str(model)
    kwargs = {"dtype": _resolve_dtype(dtype, device or "", device_map)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    hub_kwargs = {"cache_dir": str(cache_dir)} if (model is not None and cache_dir is not None) else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **hub_kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(source, **kwargs, **hub_kwargs)
    except OSError as error:
        raise ModelNotAvailableError(
            f"could not load '{source}' ({error}); pass a local folder, a hub id when online, or "
            "model=None for the embedded default (offline, HF_HUB_OFFLINE=1 makes a hub id fail at once "
            "instead of after the hub's retries)"
        ) from error
    if device_map is None:
        loaded = loaded.to(device)
    loaded.eval()
    return loaded, tokenizer
