"""A model's identity is its weights: a content checksum of every parameter and buffer.

KV computed by one set of weights must never be reused by another (a fine-tune, an unmerged LoRA
adapter, an in-place weight change). :func:`weights_digest` reads every parameter and buffer
once, with its name, shape and dtype: a tensor on the CPU is hashed byte for byte (SHA-256 over
its memory, no copy); a tensor on an accelerator is reduced where it lives, in chunks, to the
plain and the position-weighted sums of its raw bits read as integers (a single changed element
or a permutation changes them), so no weights cross to the host. A weight accelerate offloads
(on the meta device between forwards) is read where its hook loads it from. One pass over the
weights: about half a second for the embedded 135M model on a CPU core. Not meant to resist a
deliberate collision.

:class:`WeightsWatch` tells cheaply, before every call, whether the weights may have changed since
the digest: another tensor object under a name, an in-place write (every in-place operation bumps
a tensor's version counter: optimiser steps, ``load_state_dict``, ``copy_``) or another set of
active adapters.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from typing import Hashable, Iterator

import torch

from .engines.placement import covers_children, offload_hook, offloaded_buffers, offloaded_tensors, offloads_buffers
from .errors import UnsupportedModelError

__all__ = ["weights_digest", "values_kept", "WeightsWatch"]

_CHUNK = 1 << 24  # elements per reduction step (bounded extra memory)
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = [(f"param:{n}", p) for n, p in model.named_parameters()]
    tensors += [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    return sorted(tensors, key=lambda item: item[0])


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` int32 pseudo-random weights of the positions inside a chunk (cached per device)."""
    cached = _WEIGHTS.get(device)
    if cached is None or cached.numel() < n:
        position = torch.arange(1, max(n, 1024) + 1, dtype=torch.int64)
        cached = (position * 2654435761 % 65521 + 1).to(device=device, dtype=torch.int32)
        _WEIGHTS[device] = cached
    return cached[:n]


def _tensor_checksum(t: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes; the chunked integer sums of an accelerator tensor."""
    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu":
        return hashlib.sha256(memoryview(flat.contiguous().view(torch.uint8).numpy())).hexdigest()
    return repr(_device_sums(flat))


def _device_sums(flat: torch.Tensor) -> list[int]:
    """Per chunk of the tensor's raw bits read as integers: their sum and their position-weighted
    sum (int32 products wrap and int64 sums wrap: exact modular arithmetic, the same in any
    summation order)."""
    if flat.is_complex() or flat.element_size() not in _INT_OF_SIZE:
        flat = flat.float()
    words = flat.view(_INT_OF_SIZE[flat.element_size()])
    sums = []
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK]
        if chunk.dtype != torch.int32 and chunk.dtype != torch.int64:
            chunk = chunk.to(torch.int32)
        weights = _position_weights(chunk.numel(), chunk.device)
        sums.append(int(chunk.sum(dtype=torch.int64)))
        sums.append(int((chunk * weights.to(chunk.dtype)).sum(dtype=torch.int64)))
    return sums


_DIGESTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()
_DIGESTS_LOCK = threading.RLock()  # engines sharing one model read and re-state its digest


def weights_digest(model: torch.nn.Module, *, recompute: bool = False) -> str:
    """Hex digest of every parameter and buffer (names, shapes, dtypes and contents) and of the
    active adapters, if the model has any (PEFT). Remembered per model while :class:`WeightsWatch`
    sees no change (engines sharing one model compute it once); ``recompute`` reads the weights
    again anyway (a write into ``.data`` changes nothing the watch sees)."""
    with _DIGESTS_LOCK:
        state = _snapshot(model)
        known = _DIGESTS.get(model)
        if known is not None and known[0] == state and not recompute:
            return known[1]
        digest = _compute_digest(model)
        _DIGESTS[model] = (state, digest)
        return digest


@contextlib.contextmanager
def values_kept(model: torch.nn.Module) -> Iterator[None]:
    """Lay ``model``'s tensors out anew inside this block without changing any value (the same
    values in another memory order, :mod:`.engines.weight_layout`): a digest remembered for the
    weights as they were when the block began stays theirs, so it is not read again. A digest
    remembered for older weights (a change the watch saw, not read yet) is left to be read."""
    before = _snapshot(model)
    yield
    with _DIGESTS_LOCK:  # a digest read meanwhile, mid-layout, was read for another snapshot
        known = _DIGESTS.get(model)
        if known is not None and known[0] == before:
            _DIGESTS[model] = (_snapshot(model), known[1])


@torch.no_grad()
def _compute_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    offloaded = offloaded_tensors(model)
    for name, tensor in _named_tensors(model):
        kept = offloaded.get(name.split(":", 1)[1])
        if kept is not None:  # offloaded by accelerate: read where its hook loads it from
            tensor = _read_offloaded(name, *kept)
        elif tensor.is_meta:
            digest.update(f"{name}:meta".encode())
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{_tensor_checksum(tensor)};".encode())
    digest.update(repr(_active_adapters(model)).encode())
    return digest.hexdigest()[:32]


def _read_offloaded(name: str, weights, key: str) -> torch.Tensor:
    """An offloaded tensor from its hook's weights map (read from disk where it is kept there)."""
    try:
        return weights[key]
    except KeyError as error:  # a digest without these weights could match another model's
        raise UnsupportedModelError(
            f"the offloaded weight {name.split(':', 1)[1]!r} is not in the map its accelerate hook loads it from "
            f"(key {key!r}); the model's identity is its weights, and these cannot be read", dense_fallback=False,
        ) from error


def _offloaded_state(maps: dict) -> tuple:
    """What :class:`WeightsWatch` reads of offloaded weights: each tensor a map holds in memory,
    as it reads a module's own (a tensor read from disk for each forward is a file's, not
    watched: ``refresh_fingerprint`` after rewriting one)."""
    state = []
    for dataset in maps.values():
        in_memory = getattr(dataset, "state_dict", dataset)  # OffloadedWeightsLoader: its in-memory part
        if isinstance(in_memory, dict):
            state.extend(_tensor_state(name, t) for name, t in in_memory.items())
    return tuple(state)


def _tensor_state(name: str, t: torch.Tensor, offloaded: bool = False) -> tuple:
    """A tensor's object, in-place version counter and memory address; an inference tensor has
    no version counter: its object and address. An offloaded one (``offloaded``), which
    accelerate replaces at each forward, is watched in its map (:func:`_offloaded_state`)."""
    if offloaded:
        return (name, "offloaded", tuple(t.shape))
    try:
        return (name, id(t), t._version, t.data_ptr())
    except RuntimeError:  # an inference tensor: rare, so a try rather than a check on every tensor
        return (name, id(t), t.data_ptr())


def _active_adapters(model: torch.nn.Module) -> Hashable:
    for attribute in ("active_adapters", "active_adapter"):
        value = getattr(model, attribute, None)
        if callable(value):
            try:
                value = value()
            except (ValueError, RuntimeError):  # transformers raises when no adapter is loaded
                value = None
        if value is not None:
            return tuple(value) if isinstance(value, (list, tuple)) else value
    return None


class WeightsWatch:
    """Notices when a model's weights may have changed since :meth:`mark`.

    ``changed()`` compares, per parameter and buffer, the tensor object and its in-place version
    counter, and the active adapters: a few microseconds per hundred tensors, so the engine calls
    it before every call.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._state = _snapshot(model)

    def changed(self) -> bool:
        """True if a tensor was replaced, written in place, or the active adapters changed."""
        return _snapshot(self.model) != self._state

    def mark(self) -> None:
        """Take the current weights as the reference."""
        self._state = _snapshot(self.model)


def _snapshot(model: torch.nn.Module) -> tuple:
    """Each module in the tree once (its object and its children's names), each of its
    parameters' and buffers' names, objects, in-place version counters and memory addresses, and
    the active adapters. Read from the modules' own slots, not through ``named_parameters`` (a
    third of its time: no dotted names are built): a replaced, added or renamed module, a tensor
    replaced or moved between slots, an in-place write, or new memory given through
    ``param.data = ...`` (which bumps no version counter) changes it. A write *into* ``.data``
    (``param.data.mul_(2)``) changes none of these: ``refresh_fingerprint`` is for that."""
    state: list = []
    # (module, what an ancestor's hook offloads of it: None, or whether its buffers too)
    stack, seen, maps = [(model, None)], set(), {}
    while stack:
        module, covered = stack.pop()
        if id(module) in seen:  # shared or cyclic: read once, as named_modules does
            continue
        seen.add(id(module))
        state.append(id(module))
        hook = offload_hook(module) if "_hf_hook" in module.__dict__ else None
        if hook is not None:  # its map, each once: the hooks' PrefixedDatasets share one
            dataset = getattr(hook.weights_map, "dataset", hook.weights_map)
            maps[id(dataset)] = dataset
            covered_here = offloads_buffers(hook)
        else:
            covered_here = covered
        if covered_here is None:  # the common case: nothing offloaded
            for slots in (module._parameters, module._buffers):
                state.extend(_tensor_state(name, t) for name, t in slots.items() if t is not None)
        else:
            kept = {name for name, _ in offloaded_buffers(module)} if covered_here else ()
            state.extend(_tensor_state(name, t, True) for name, t in module._parameters.items() if t is not None)
            state.extend(_tensor_state(name, t, name in kept) for name, t in module._buffers.items() if t is not None)
        below = (covered_here if covers_children(hook) else None) if hook is not None else covered
        for name, child in module._modules.items():
            if child is not None:
                state.append(name)
                stack.append((child, below))
    return (tuple(state), _offloaded_state(maps) if maps else (), _active_adapters(model))
