"""What models kvcomm-agents can reuse KV for, checked at load time.

Config checks refuse what re-rotation cannot handle (dynamic NTK, YaRN, partial or interleaved
rotary dimensions, per-layer rope bases, MLA, attention kernels that ignore 4-D masks); then a
numerical self-check re-rotates the model's own layer-0 keys from positions ``0..n`` to
``δ..δ+n`` and compares them with the keys the model computes there. Before either, every
model, dense included, passes :func:`~.cache_check.check_cache`. A composite (vision-language)
config is read through its text config. It fails loudly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import PreTrainedModel

from .engines import hf
from .cache_check import check_cache
from .identity import weights_digest
from .model_config import forward_settings, sliding_window, text_config
from .kv.rope import RopeRotator
from .errors import RopeCheckError, UnsupportedModelError

__all__ = ["ModelInfo", "inspect_model", "check_rerotation", "model_fingerprint", "check_config", "rotator_from_config"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
REUSE_ATTENTION = ("sdpa", "eager")
#: Architectures refused outright: per-layer rope bases / sliding layers (Gemma 2/3, Cohere 2).
#: MLA (DeepSeek V2/V3, MiniCPM3, ...) is refused by its config fields, whatever the type.
REFUSED_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text", "cohere2")
_CHECK_SHIFT = 29


@dataclass
class ModelInfo:
    """What the engine needs to know about a supported model.

    Attributes:
        rotator: re-rotates this model's keys (None when reuse is off).
        sliding_window: the attention window in tokens, or None for full attention.
        fingerprint: identifies model, dtype and tokenizer; segments of other fingerprints are
            never used.
        eos_ids: token ids that end a reply.
        max_positions: the longest sequence the model's positions cover (None if unknown).
    """

    rotator: Optional[RopeRotator]
    sliding_window: Optional[int]
    fingerprint: str
    eos_ids: frozenset[int]
    max_positions: Optional[int] = None


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return dict(params)


def check_config(config, *, attention: Optional[str] = "check") -> None:
    """Refuse, from the config alone, what exact re-rotation cannot handle.

    Args:
        config: a transformers ``PretrainedConfig``.
        attention: the attention implementation to check (``"check"``: the config's own;
            None: skip, for runtimes with their own kernels such as vLLM).

    Raises:
        UnsupportedModelError: with what is not supported.
    """
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"'{getattr(config, 'model_type', '?')}' is an encoder-decoder model")
    config = text_config(config)
    model_type = getattr(config, "model_type", "?")
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"'{model_type}' uses per-layer rope bases or sliding-window layers, "
            "which re-rotation does not support yet"
        )
    if getattr(config, "kv_lora_rank", None) or getattr(config, "qk_rope_head_dim", None):
        raise UnsupportedModelError(
            f"'{model_type}' uses multi-head latent attention (MLA): its cache holds compressed latents "
            "with decoupled rotary keys, which re-rotation does not model")
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not all(no_rope):
        raise UnsupportedModelError(f"'{model_type}' has layers without rotary embeddings (no_rope_layers)")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        raise UnsupportedModelError(f"layer types {sorted(layer_types)} are not supported")
    params = _rope_parameters(config)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        raise UnsupportedModelError(
            "rope_type 'dynamic' (dynamic NTK) changes frequencies with sequence length, so "
            "cached keys cannot be re-rotated exactly"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings (factor {partial}) are not supported")
    if attention == "check":
        _check_attention(config)


def _check_attention(config) -> None:
    attention = getattr(config, "_attn_implementation", None)
    if attention not in REUSE_ATTENTION:
        raise UnsupportedModelError(f"attn_implementation '{attention}' ignores custom 4-D attention masks, which reuse "
                                    "needs; load the model with attn_implementation='sdpa'")


def rotator_from_config(config) -> RopeRotator:
    """The re-rotation of a model known only by its config (a runtime that is not transformers,
    e.g. vLLM): config checks (:func:`check_config`, attention kernel not checked), then the
    rotary frequencies as transformers computes them for the config's rope type."""
    check_config(config, attention=None)
    config = text_config(config)
    params = _rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if float(scaling) != 1.0:
        raise UnsupportedModelError("rotary attention scaling != 1 (YaRN, longrope) is not supported")
    if 2 * inv_freq.numel() != head_dim:
        raise UnsupportedModelError(
            f"rotary embeddings cover {2 * inv_freq.numel()} of {head_dim} head channels (partial rotary)")
    return RopeRotator(inv_freq)


def _check_exact_prefix(config) -> None:
    """What reusing exact prefixes needs of a config: positions whose encoding does not depend on
    the sequence's length (dynamic NTK recomputes its frequencies past the original length, so a
    prefix computed shorter differs) and an attention kernel that takes 4-D masks. Any position
    scheme passes otherwise (absolute, ALiBi, partial or scaled RoPE): the load-time cache check
    proves the model extends a filled cache as one forward computes it."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"'{getattr(config, 'model_type', '?')}' is an encoder-decoder model")
    config = text_config(config)
    params = _rope_parameters(config)
    kinds = [v.get("rope_type", v.get("type")) for v in params.values()] \
        if params and all(isinstance(v, dict) for v in params.values()) else [params.get("rope_type", params.get("type"))]
    if "dynamic" in kinds:
        raise UnsupportedModelError("rope_type 'dynamic' (dynamic NTK) changes frequencies with sequence length, so a "
                                    "prefix's KV computed on a shorter sequence is not the KV a longer prompt computes")
    _check_attention(config)


def _check_config(model: PreTrainedModel) -> RopeRotator:
    check_config(model.config)
    config = text_config(model.config)
    model_type = getattr(config, "model_type", "?")
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor):
        raise UnsupportedModelError(
            f"'{model_type}' has no rotary embedding module holding its frequencies (rotary_emb.inv_freq) for "
            "re-rotation to read: absolute or ALiBi positions, a recurrent state, or rotations computed inside "
            "attention (GPT-J, CodeGen)"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if 2 * inv_freq.numel() != head_dim:
        raise UnsupportedModelError(
            f"rotary embeddings cover {2 * inv_freq.numel()} of {head_dim} head channels (partial rotary)"
        )
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise UnsupportedModelError("rotary attention scaling != 1 (YaRN, longrope) is not supported")
    return RopeRotator(inv_freq)


@torch.no_grad()
def check_rerotation(model: PreTrainedModel, rotator: RopeRotator, tokenizer=None) -> float:
    """Re-rotate every layer's keys computed at positions ``0..n`` by δ and compare with the
    model's own keys at ``δ..δ+n``. Returns the worst relative error; raises
    :class:`RopeCheckError` if too big.
    """
    device = hf.input_device(model)
    ids = None
    if tokenizer is not None:
        ids = tokenizer("Re-rotation check: the quick brown fox.", add_special_tokens=False)["input_ids"][:8]
    if not ids or len(ids) < 4:
        ids = list(range(3, 11))
    input_ids = torch.tensor([ids], device=device)
    caches = []
    for start in (0, _CHECK_SHIFT):
        cache = hf.new_cache(model)
        positions = torch.arange(start, start + len(ids), device=device)[None]
        hf.run_forward(model, input_ids, cache, position_ids=positions)
        caches.append(cache)
    # Shifting every token by the same amount leaves relative positions, hence hidden states,
    # unchanged: every RoPE layer's keys must differ by exactly R(shift), values not at all.
    full_precision = model.dtype in (torch.float32, torch.float64)
    worst = 0.0
    for layer in range(hf.num_layers(caches[0])):
        (k0, v0), (k1, v1) = (hf.layer_kv(c, layer) for c in caches)
        moved = rotator.shift(k0.float(), _CHECK_SHIFT)
        error = float((moved - k1.float()).abs().max() / k1.float().abs().max().clamp_min(1e-6))
        value_error = float((v0.float() - v1.float()).abs().max() / v1.float().abs().max().clamp_min(1e-6))
        worst = max(worst, error)
        # deeper layers add rounding from attention; structural mismatches give errors near 1
        tolerance = (1e-4 if layer == 0 else 1e-3) if full_precision else (3e-2 if layer == 0 else 1e-1)
        if error > tolerance or value_error > tolerance:
            raise RopeCheckError(
                f"load-time RoPE check failed: re-rotated layer-{layer} keys differ from the model's "
                f"own by {error:.2e} (values {value_error:.2e}, tolerance {tolerance:.0e}); this "
                "model's rotary embedding is interleaved, partial, scaled or absent in some layers "
                "in a way re-rotation does not model"
            )
    return worst


def model_fingerprint(model: PreTrainedModel, tokenizer, *, recompute: bool = False) -> str:
    """A short hash of what makes KV compatible: the config's settings a forward depends on
    (:func:`~.model_config.forward_settings`: architecture, RoPE, norms, activation, heads), the
    dtype, every weight and buffer and the active adapters (:func:`~.identity.weights_digest`),
    the tokenizer."""
    config = text_config(model.config)
    summary = {
        "name": getattr(config, "_name_or_path", None),
        "settings": forward_settings(model.config),
        "dtype": str(model.dtype),
        "weights": weights_digest(model, recompute=recompute),
        "vocab": len(tokenizer),
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tokenizer_text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode())
    digest.update(tokenizer_text.encode())
    return digest.hexdigest()[:16]


def _eos_ids(model: PreTrainedModel, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def inspect_model(model: PreTrainedModel, tokenizer, *, reuse: bool, exact_only: bool = False,
                  verify_rope: bool = True) -> ModelInfo:
    """Check ``model`` and ``tokenizer`` and describe them, or raise :class:`UnsupportedModelError`.
    ``exact_only`` (``method="exact_prefix"``): KV is only ever reused at the positions it was
    computed at, so a model re-rotation refuses is served with only what an exact prefix needs
    checked, and no rotator (no segment is kept for other prompts)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UnsupportedModelError("the tokenizer has no chat template")
    rotator = None
    if reuse:  # what the config alone refuses, before any forward
        if not getattr(tokenizer, "is_fast", False):
            raise UnsupportedModelError("reuse needs a fast tokenizer (character offsets)")
        try:
            rotator = _check_config(model)
        except UnsupportedModelError:
            if not exact_only:
                raise
            _check_exact_prefix(model.config)  # exact prefixes need no re-rotation
    check_cache(model)
    if rotator is not None and verify_rope:
        try:
            check_rerotation(model, rotator, tokenizer)
        except RopeCheckError:
            if not exact_only:
                raise
            rotator = None
    config = text_config(model.config)
    max_positions = getattr(config, "max_position_embeddings", None)
    return ModelInfo(rotator, sliding_window(config), model_fingerprint(model, tokenizer), _eos_ids(model, tokenizer),
                     int(max_positions) if max_positions else None)
