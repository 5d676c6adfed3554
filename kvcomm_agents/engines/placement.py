"""Where a model computes: its input ids' device and each layer's KV device, as transformers
and accelerate place the model (one device, layers spread with ``device_map``, or weights
offloaded to the CPU or disk, waiting on the meta device between forwards)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

__all__ = ["execution_device", "input_device", "kv_devices"]


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: the device accelerate's offload hook moves its weights to for
    each forward (``device_map`` with CPU or disk offload, ``cpu_offload``: the weights wait on
    the meta device), else its weights' device."""
    weights = next(module.parameters()).device
    for part in (module,) if weights.type != "meta" else module.modules():  # a hook may sit on a submodule
        device = getattr(getattr(part, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    return weights


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model's input ids go (its embedding's device)."""
    return execution_device(model.get_input_embeddings())


def kv_devices(model: PreTrainedModel) -> list[torch.device]:
    """Per decoder layer, where its KV lives: where the layer computes (one device unless the
    model is spread over several with ``device_map``)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        return [input_device(model)] * model.config.num_hidden_layers
    return [execution_device(layer) for layer in layers]
