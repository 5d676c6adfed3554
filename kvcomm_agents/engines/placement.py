"""Where a model computes and where accelerate keeps its weights: its input ids' device, each
layer's KV device, and the weights accelerate offloads (``device_map`` placing layers on
``"cpu"`` or ``"disk"`` beside an accelerator, ``cpu_offload``), which wait on the meta device
between forwards and are loaded from the hook's weights map for each."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
from transformers import PreTrainedModel

from ..model_config import text_config

__all__ = ["execution_device", "input_device", "kv_devices", "offload_hook", "offloaded_tensors", "covers_children",
           "offloads_buffers", "offloaded_buffers", "model_lock", "wait_for"]

#: (weights map, key prefix, buffers too): where a module under an offloading hook keeps its tensors.
OffloadScope = Optional[tuple[Any, str, bool]]
_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _hooks(module: torch.nn.Module) -> tuple:
    """accelerate's hooks on ``module`` (a ``SequentialHook`` holds several); read from the
    module's own attributes, not through ``nn.Module.__getattr__``, which raises for a miss."""
    hook = module.__dict__.get("_hf_hook")
    return () if hook is None else tuple(getattr(hook, "hooks", None) or (hook,))


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where ``module`` computes: the device accelerate's hook moves its weights to for each
    forward (offloaded weights wait on the meta device), else its weights' device."""
    weights = next(module.parameters()).device
    for part in (module,) if weights.type != "meta" else module.modules():  # a hook may sit on a submodule
        for hook in _hooks(part):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(_accelerator(), device) if isinstance(device, int) else torch.device(device)
    return weights


def _accelerator() -> str:
    """The device type an integer device index names (accelerate's convention: the accelerator)."""
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    return current.type if current is not None else "cuda"


def wait_for(device: torch.device | str) -> None:
    """Block until the work queued on ``device`` has run, so that a timer reads a forward's end
    rather than its launch: accelerators (CUDA, XPU, MPS, ...) run kernels asynchronously; the CPU
    and the meta device have nothing queued."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
    elif device.type == "cuda":  # torch before 2.6
        torch.cuda.synchronize(device)
    else:  # a backend without a synchronize of its own: nothing to wait on from here
        synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
        if synchronize is not None:
            synchronize()


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model's input ids go (its embedding's device)."""
    return execution_device(model.get_input_embeddings())


def kv_devices(model: PreTrainedModel) -> list[torch.device]:
    """Per decoder layer, where its KV lives: where the layer computes (one device unless the
    model is spread over several with ``device_map``)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        return [input_device(model)] * text_config(model.config).num_hidden_layers
    return [execution_device(layer) for layer in layers]


def offload_hook(module: torch.nn.Module):
    """accelerate's hook that keeps ``module``'s weights offloaded, or None."""
    for hook in _hooks(module):
        if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None:
            return hook
    return None


def covers_children(hook) -> bool:
    """Whether an offloading ``hook`` keeps its module's submodules' weights too (keys relative
    to its module: ``dispatch_model`` hooks a block that way)."""
    return bool(getattr(hook, "place_submodules", False))


def offloads_buffers(hook) -> bool:
    """Whether an offloading ``hook`` keeps buffers in its map too (else they stay in place)."""
    return bool(getattr(hook, "offload_buffers", False))


def offloaded_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of ``module`` a hook that offloads buffers keeps in its map: the persistent
    ones (a non-persistent buffer, a rotary table, is not in a state dict and stays in place)."""
    return [(key, t) for key, t in module._buffers.items() if key not in module._non_persistent_buffers_set]


def offloaded_tensors(model: torch.nn.Module) -> dict[str, tuple[Any, str]]:
    """Each offloaded parameter or buffer by its full name (as ``named_parameters`` gives it):
    the weights map its hook loads it from and its key there. Keys follow the hooks, not the
    model's names, so a wrapper added around an offloaded model changes nothing."""
    inherited: dict[str, OffloadScope] = {}  # by module name: the scope its children inherit
    found: dict[str, tuple[Any, str]] = {}
    for name, module in model.named_modules():
        parent, _, own_name = name.rpartition(".")
        above = inherited.get(parent) if name else None
        scope: OffloadScope = None if above is None else (above[0], f"{above[1]}{own_name}.", above[2])
        hook = offload_hook(module)
        if hook is not None:
            scope = (hook.weights_map, "", offloads_buffers(hook))
            inherited[name] = scope if covers_children(hook) else None
        else:
            inherited[name] = scope
        if scope is not None:
            weights, prefix, buffers = scope
            kept = [*module._parameters.items(), *(offloaded_buffers(module) if buffers else ())]
            found.update({f"{name}.{key}" if name else key: (weights, prefix + key) for key, t in kept if t is not None})
    return found


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock engines serving ``model`` share where its forwards change it (accelerate loads
    offloaded weights into the modules for each forward and puts them back after): one per such
    model; a fresh one for any other model, whose forwards only read it."""
    if not any(offload_hook(module) is not None for module in model.modules()):
        return threading.RLock()
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(model, threading.RLock())
