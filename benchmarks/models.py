"""Models the benchmark runs: the embedded default, a local folder, or ``random:<shape>``.

``random:<shape>`` builds a model with random weights (``normal_(0, 0.02)`` on every matrix,
norms at one) from a built-in config, created directly on the device, paired with the byte-level
test tokenizer and its ChatML template: no download, no checkpoint, the real architecture's cost.
Speed only: its replies are noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvcomm_agents.models import load_model
from kvcomm_agents.testing import tiny_llama, tiny_qwen2, tiny_tokenizer

__all__ = ["SHAPES", "LoadedModel", "load"]

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

#: name -> (model class, config class, config fields); public shapes of released checkpoints
SHAPES: dict[str, tuple[type, type, dict]] = {
    "llama-3.1-8b": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-3.2-1b": (LlamaForCausalLM, LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True)),
    "qwen2.5-7b": (Qwen2ForCausalLM, Qwen2Config, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False)),
}

#: The tests' seeded random models (3 layers, 64 wide): they run anywhere, in seconds per graph.
TINY = {"tiny": tiny_llama, "tiny-qwen2": tiny_qwen2}


@dataclass
class LoadedModel:
    """A model, its tokenizer, and a short tag naming it in output files."""

    model: torch.nn.Module
    tokenizer: object
    tag: str
    spec: str


def _random_model(shape: str, tokenizer, device: str, dtype: torch.dtype):
    if shape in TINY:  # the tests' tiny families: CPU smoke runs, and both families' fidelity
        return TINY[shape](tokenizer, seed=0).to(device=device, dtype=dtype)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape '{shape}'; built-in: {', '.join([*TINY, *SHAPES])}")
    model_class, config_class, fields = SHAPES[shape]
    config = config_class(**fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.02)
    return model.eval()


def load(spec: str, *, device: str, dtype: torch.dtype) -> LoadedModel:
    """``embedded`` (SmolLM2-135M-Instruct, offline), ``random:<shape>``, or a local folder."""
    if spec.startswith("random:"):
        shape = spec.split(":", 1)[1]
        tokenizer = tiny_tokenizer()
        return LoadedModel(_random_model(shape, tokenizer, device, dtype), tokenizer, f"random-{shape}", spec)
    model, tokenizer = load_model(None if spec == "embedded" else spec, device=device, dtype=dtype)
    tag = "embedded" if spec == "embedded" else spec.rstrip("/").rsplit("/", 1)[-1]
    return LoadedModel(model, tokenizer, tag, spec)
