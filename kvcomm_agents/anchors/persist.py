"""Anchor pools on disk: one safetensors file, tensors plus a JSON header. Never pickle.

A warm start: anchors learned in one process (or by ``engine.calibrate``) serve the first calls of
the next one. The header records the format, the library version, the model fingerprint, the
pools' bookkeeping and what the tracker measured (``"measurements"``, optional); tensors are each slot's ``{pool}.base{slot}.keys`` / ``.values`` and each
offset stack's ``{pool}.stack{j}.has`` and ``{pool}.stack{j}.part{slot}.keys`` / ``.values``.
A file of another model, a corrupted file or one whose shapes do not fit the model is refused
with :class:`~kvcomm_agents.errors.AnchorFileError` before anything of the engine changes.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import AnchorFileError
from .pool import AnchorPool, OffsetStack, RecordedContext

__all__ = ["FORMAT", "MEASURED_WITH", "save_pools", "load_pools", "measured_alike"]

FORMAT = "kvcomm-anchors/2"  # /1: dense [slots, L-1, H, tokens, D] stacks
#: the settings that shape what an audit or a re-rotation check measures (the recomputed head
#: and tail, the short runs computed, the estimator): a file's measurements serve only an engine
#: that has the same
MEASURED_WITH = ("recompute_head", "recompute_cut_head", "recompute_tail", "recompute_short_runs", "recompute_last_run", "experimental")
#: what a file that does not name one of them was measured with (the setting did not exist: off)
WITHOUT = {"recompute_tail": 0, "recompute_last_run": 0, "recompute_cut_head": 0}


def measured_alike(header: dict, settings: dict) -> bool:
    """Whether a file whose ``header`` holds the settings it was saved under measured as an
    engine of ``settings`` (both as JSON) would: equal on :data:`MEASURED_WITH`."""
    saved = header.get("settings")
    if not isinstance(saved, dict):
        return False
    saved = {**WITHOUT, **saved}
    return all(name in settings and saved.get(name) == settings[name] for name in MEASURED_WITH)


def _put(tensors: dict, name: str, t: Optional[torch.Tensor]) -> None:
    if t is not None:
        tensors[name] = t.detach().to("cpu").contiguous()


def save_pools(pools: list[AnchorPool], path: str | os.PathLike, header: dict) -> None:
    """Write ``pools`` and ``header`` (fingerprint, version, settings) to ``path`` atomically."""
    tensors: dict[str, torch.Tensor] = {}
    described = []
    for p, pool in enumerate(pools):
        name = f"pool{p}"
        _put(tensors, f"{name}.lengths", pool.lengths)
        _put(tensors, f"{name}.activations", pool.activations)
        for slot, base in enumerate(pool.bases):
            if base is not None:
                _put(tensors, f"{name}.base{slot}.keys", base[0])
                _put(tensors, f"{name}.base{slot}.values", base[1])
        stacks = [("placeholder", key, stack) for key, stack in pool.placeholder.items()]
        stacks += [("own_text", key, stack) for key, stack in pool.own_text.items()]
        for j, (_, _, stack) in enumerate(stacks):
            _put(tensors, f"{name}.stack{j}.has", stack.has)
            for slot, (keys, values) in stack.parts.items():
                _put(tensors, f"{name}.stack{j}.part{slot}.keys", keys)
                _put(tensors, f"{name}.stack{j}.part{slot}.values", values)
                _put(tensors, f"{name}.stack{j}.part{slot}.start", torch.tensor([stack.starts.get(slot, 0)]))
        described.append({
            "kind": list(pool.kind), "segment_ids": pool.segment_ids, "created": pool.created, "clock": pool.clock,
            "stacks": [[role, list(key) if isinstance(key, tuple) else key] for role, key, _ in stacks],
            "contexts": [{str(slot): [c.start, c.end, list(c.ids), c.min_match] for slot, c in stack.contexts.items()}
                         for _, _, stack in stacks],
        })
    meta = {"format": FORMAT, **header, "pools": described}
    path = os.fspath(path)
    if os.path.isdir(path):
        example = os.path.join(path, "anchors.safetensors")
        raise IsADirectoryError(f"{path} is a folder; save anchors to a file in it, e.g. {example}")
    tmp = f"{path}.tmp"
    try:
        save_file(tensors, tmp, metadata={"kvcomm": json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a write or a replace that failed leaves nothing behind
            os.remove(tmp)


def load_pools(path: str | os.PathLike, *, fingerprint: str, shape: tuple[int, int, int], max_anchors: int,
               eviction_window: int, device: torch.device, dtype: torch.dtype) -> tuple[list[AnchorPool], dict]:
    """Read pools written by :func:`save_pools` for a model of ``fingerprint`` whose anchors are
    ``[*, L-1, kv_heads, *, head_dim]`` = ``shape`` (``(L-1, kv_heads, head_dim)``); returns the
    pools (tensors on ``device``) and the header. Raises :class:`AnchorFileError`."""
    try:
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as handle:
            meta = json.loads((handle.metadata() or {}).get("kvcomm", "null"))
        tensors = load_file(os.fspath(path))
    except FileNotFoundError:
        raise AnchorFileError(f"{path}: no such anchor file") from None
    except (SafetensorError, OSError, ValueError, json.JSONDecodeError) as error:
        raise AnchorFileError(f"{path} is not a readable anchor file ({error})") from error
    if isinstance(meta, dict) and meta.get("format") == "kvcomm-anchors/1":
        raise AnchorFileError(f"{path} is a kvcomm-anchors/1 file (dense offset stacks, before per-slot storage); "
                              f"this version reads {FORMAT}: write it again with save_anchors")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise AnchorFileError(f"{path} is not a {FORMAT} file")
    if meta.get("fingerprint") != fingerprint:
        raise AnchorFileError(
            f"{path} holds anchors of another model (fingerprint {meta.get('fingerprint')}, this engine's is "
            f"{fingerprint}): KV offsets of other weights, dtype or tokenizer are never used"
        )
    try:
        pools = [_pool(f"pool{p}", desc, tensors, shape, max_anchors, eviction_window, device, dtype)
                 for p, desc in enumerate(meta["pools"])]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise AnchorFileError(f"{path} is corrupted or does not fit this model ({error})") from error
    return pools, meta


def _pool(name: str, desc: dict, tensors: dict, shape: tuple[int, int, int], max_anchors: int, eviction_window: int,
          device: torch.device, dtype: torch.dtype) -> AnchorPool:
    pool = AnchorPool(tuple(desc["kind"]), max_anchors, eviction_window)
    pool.segment_ids = [str(s) if s is not None else None for s in desc["segment_ids"]]
    pool.created = [int(c) for c in desc["created"]]
    pool.clock = int(desc["clock"])
    slots = len(pool.segment_ids)
    if slots > max_anchors or len(pool.created) != slots:
        raise ValueError(f"{slots} anchors in a pool, max_anchors is {max_anchors}")
    pool.lengths = tensors[f"{name}.lengths"].to(torch.long)
    pool.activations = tensors[f"{name}.activations"].to(torch.long)
    if pool.lengths.shape != (slots,) or pool.activations.shape != (slots,):
        raise ValueError("bookkeeping of another size than the pool")
    pool.bases = [None] * slots
    for slot, segment_id in enumerate(pool.segment_ids):
        if segment_id is None:
            if int(pool.lengths[slot]):
                raise ValueError("an empty slot with a length")
            continue
        keys = _checked(tensors[f"{name}.base{slot}.keys"], shape, device, dtype)
        values = _checked(tensors[f"{name}.base{slot}.values"], shape, device, dtype)
        if values.shape != keys.shape or keys.shape[2] != int(pool.lengths[slot]):
            raise ValueError("base KV of another size than its anchor")
        pool.bases[slot] = (keys, values)
    contexts = desc.get("contexts") or [{} for _ in desc["stacks"]]  # files before recorded versions: none
    for j, (role, key) in enumerate(desc["stacks"]):
        has = tensors[f"{name}.stack{j}.has"].to(torch.bool)
        parts, starts = {}, {}
        if has.dim() != 1 or has.numel() > slots:
            raise ValueError("an offset mask of another size than the pool")
        for slot in has.nonzero().flatten().tolist():
            if pool.segment_ids[slot] is None:
                raise ValueError("offsets of an empty slot")
            keys = _checked(tensors[f"{name}.stack{j}.part{slot}.keys"], shape, device, torch.float32)
            values = _checked(tensors[f"{name}.stack{j}.part{slot}.values"], shape, device, torch.float32)
            if values.shape != keys.shape:
                raise ValueError("offsets of another size than their anchor")
            first = int(tensors[f"{name}.stack{j}.part{slot}.start"].reshape(-1)[0])
            if first < 0:
                raise ValueError("offsets before their anchor's first token")
            parts[slot], starts[slot] = (keys, values), first
        stack = OffsetStack(parts, has, starts=starts)
        stack.contexts = {int(slot): RecordedContext(int(c[0]), int(c[1]), tuple(int(i) for i in c[2]),
                                                     int(c[3]) if len(c) > 3 else 0)
                          for slot, c in contexts[j].items()}
        if role == "placeholder":
            pool.placeholder[str(key)] = stack
        elif role == "own_text":
            pool.own_text[(str(key[0]), str(key[1]))] = stack
        else:
            raise ValueError(f"unknown offset stack {role!r}")
    return pool


def _checked(t: torch.Tensor, shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A ``[L-1, H, tokens, D]`` tensor of this model's shape and of ``dtype`` (the model's for
    base KV, float32 for offsets), on ``device``."""
    if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != shape:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} where [{shape[0]}, {shape[1]}, *, {shape[2]}] fits")
    if t.dtype != dtype:
        raise ValueError(f"a {t.dtype} tensor where the model's anchors are {dtype}")
    return t.to(device)
