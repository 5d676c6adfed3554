"""A second tier for the segment store, shared by several processes (replicas of one model).

Each replica keeps its own :class:`~.store.SegmentStore` in memory. With a shared tier, every
entry a replica computes (a segment or an exact prefix) is also published: its token ids go to a
*catalog* that every replica reads, its KV to a blob fetched only when a prompt of another
replica (or this one, after an eviction) matches it. A miss anywhere in the tier (an expired
blob, a corrupt one, a tier that is down) costs speed, never correctness: the tokens are computed.

Blobs are safetensors (tensors plus one JSON header), never pickle. :class:`MemorySegments` is
the in-process tier (tests, several engines in one process); :class:`~.redis_tier.RedisSegments`
is the one for a fleet.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from .block import KVBlock, device_groups
from .entries import Entry
from .segments import KVSegment, SegmentRef

__all__ = ["CatalogItem", "SharedSegments", "MemorySegments", "catalog_item", "encode_entry",
           "decode_entry", "FORMAT"]

FORMAT = "kvcomm-segment/1"


@dataclass(frozen=True)
class CatalogItem:
    """What every replica learns of a published entry (its KV stays in the blob).

    Attributes:
        key: the entry's store key (a segment id or a prefix entry id), unique in the tier.
        fingerprint: the model fingerprint of its KV (other models never use it).
        token_ids: the ids it holds KV for (indexed for token runs and exact prefixes).
        prefix: True for an exact prefix (keys at their true positions from 0), False for a
            segment (keys in the canonical frame).
    """

    key: str
    fingerprint: str
    token_ids: tuple[int, ...]
    prefix: bool

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "fingerprint": self.fingerprint, "ids": list(self.token_ids),
                           "prefix": self.prefix})

    @classmethod
    def from_json(cls, text: str | bytes) -> "CatalogItem":
        data = json.loads(text)
        return cls(str(data["key"]), str(data["fingerprint"]), tuple(int(t) for t in data["ids"]), bool(data["prefix"]))


class SharedSegments(Protocol):
    """A tier several stores share. Implementations must be safe to call from several threads."""

    def publish(self, item: CatalogItem, blob: bytes) -> None:
        """Make ``blob`` fetchable under ``item.key`` and append ``item`` to the catalog."""

    def catalog(self, cursor: Any) -> tuple[list[CatalogItem], Any]:
        """Catalog items after ``cursor`` (None: from the start) and the cursor after them
        (opaque to the store)."""

    def fetch(self, key: str) -> Optional[bytes]:
        """The blob of ``key``, or None if the tier no longer holds it."""


class MemorySegments:
    """The shared tier in one process: a list and a dict under a lock (no size limit)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[CatalogItem] = []
        self._blobs: dict[str, bytes] = {}

    def publish(self, item: CatalogItem, blob: bytes) -> None:
        with self._lock:
            self._blobs[item.key] = blob
            self._items.append(item)

    def catalog(self, cursor: Optional[int]) -> tuple[list[CatalogItem], int]:
        with self._lock:
            return self._items[cursor or 0:], len(self._items)

    def fetch(self, key: str) -> Optional[bytes]:
        with self._lock:
            return self._blobs.get(key)

    def drop(self, key: str) -> None:
        """Forget a blob (what an expiring tier does); its catalog item stays."""
        with self._lock:
            self._blobs.pop(key, None)


# ---- blobs ---------------------------------------------------------------------------------

def catalog_item(entry: Entry) -> CatalogItem:
    """The catalog item of a store entry."""
    return CatalogItem(entry.id, entry.fingerprint, tuple(entry.ids_tensor().tolist()),
                       not isinstance(entry, KVSegment))


def encode_entry(entry: Entry) -> tuple[CatalogItem, bytes]:
    """A store entry as its catalog item and blob.

    The blob holds tensors ``k{g}`` / ``v{g}`` (``[L_g, kv_heads, T, head_dim]`` per device group,
    on the CPU) and a JSON header with the entry's metadata.
    """
    kv: KVBlock = entry.kv
    tensors = {}
    for g, (k, v) in enumerate(zip(kv.keys, kv.values)):
        tensors[f"k{g}"] = k.detach().to("cpu").contiguous()
        tensors[f"v{g}"] = v.detach().to("cpu").contiguous()
    item = catalog_item(entry)
    meta = {}
    if isinstance(entry, KVSegment):
        meta = {"ref": entry.ref.model_dump(mode="json"), "text": entry.text,
                "char_spans": [list(s) if s is not None else None for s in entry.char_spans],
                "context_ids": list(entry.context_ids), "computed_at": entry.computed_at}
    header = {"format": FORMAT, "key": item.key, "fingerprint": item.fingerprint, "prefix": item.prefix,
              "ids": list(item.token_ids), "starts": list(kv.starts), **meta}
    return item, save_bytes(tensors, metadata={"kvcomm": json.dumps(header)})


def decode_entry(item: CatalogItem, blob: bytes, layer_devices: Optional[Sequence[torch.device]] = None):
    """The entry a blob holds: a :class:`KVSegment`, or ``(token_ids [n] int64, KVBlock)`` for an
    exact prefix. Raises ``ValueError`` when the blob is not the one ``item`` announced (another
    key, model or ids, another format, missing or misshapen tensors).

    Args:
        layer_devices: per layer, where its KV goes (the model's; the replica that published it
            may spread its layers otherwise: the KV is regrouped); None: on the CPU, as published.
    """
    try:
        header = _header(blob)
        tensors = load_bytes(blob)
    except Exception as error:  # safetensors raises several types on garbage
        raise ValueError(f"not a segment blob: {error}") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"segment blob format {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("key") != item.key or header.get("fingerprint") != item.fingerprint \
            or tuple(header.get("ids", ())) != item.token_ids or bool(header.get("prefix")) != item.prefix:
        raise ValueError(f"segment blob {item.key!r} does not match its catalog item")
    starts = tuple(int(s) for s in header["starts"])
    try:
        keys = tuple(tensors[f"k{g}"] for g in range(len(starts)))
        values = tuple(tensors[f"v{g}"] for g in range(len(starts)))
    except KeyError as missing:
        raise ValueError(f"segment blob {item.key!r} lacks tensor {missing}") from None
    n = len(item.token_ids)
    for k, v in zip(keys, values):
        if k.dim() != 4 or k.shape != v.shape or k.shape[2] != n:
            raise ValueError(f"segment blob {item.key!r}: KV of shape {tuple(k.shape)} for {n} ids")
    kv = _placed(KVBlock(keys, values, starts), layer_devices, item.key)
    if item.prefix:
        return torch.tensor(item.token_ids, dtype=torch.long), kv
    spans = tuple(tuple(s) if s is not None else None for s in header["char_spans"])
    return KVSegment(SegmentRef.model_validate(header["ref"]), header["text"], item.token_ids, spans, kv,
                     tuple(int(t) for t in header["context_ids"]),
                     None if header.get("computed_at") is None else int(header["computed_at"]))


def _placed(kv: KVBlock, layer_devices: Optional[Sequence[torch.device]], key: str) -> KVBlock:
    """``kv`` (on the CPU, as loaded) with each layer on its device of ``layer_devices``, grouped
    as the model's layers are (a copy per layer where the publisher grouped them otherwise); as
    loaded without ``layer_devices``."""
    if layer_devices is None:
        return kv
    layers, devices = sum(k.shape[0] for k in kv.keys), list(layer_devices)
    if len(devices) != layers:
        raise ValueError(f"segment blob {key!r}: KV of {layers} layers for a model of {len(devices)}")
    groups = device_groups(devices)
    if tuple(start for start, _ in groups) == kv.starts:
        return KVBlock(tuple(k.to(devices[start]) for k, (start, _) in zip(kv.keys, groups)),
                       tuple(v.to(devices[start]) for v, (start, _) in zip(kv.values, groups)), kv.starts)
    return KVBlock.from_layers([(k.to(device), v.to(device)) for (k, v), device in zip(kv.layers(), devices)])

def _header(blob: bytes) -> dict:
    """The JSON header of a safetensors blob, read without loading its tensors."""
    size = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8 : 8 + size]).get("__metadata__") or {}
    return json.loads(meta["kvcomm"])
