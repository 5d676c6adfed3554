"""A segment store's link to a shared tier (:mod:`.shared`, e.g. Redis for a fleet of replicas).

What the tier holds is known here from its catalog (token ids, kind, fingerprint per entry; no
KV): :class:`TierLink` reads it, indexes the entries this store does not hold under
``"shared:<key>"`` in the store's rolling-hash run index, publishes every entry the store
computes, and fetches an entry's KV when a prompt matches it. Every round trip to the tier runs
without the store's lock, so a slow tier delays only the lookup that needs it; the catalog
itself is guarded by the store's lock.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..errors import SharedTierWarning
from .entries import Entry
from .prefix_tree import PrefixTree
from .run_index import TokenRunIndex
from .segments import KVSegment
from .shared import CatalogItem, SharedSegments, decode_entry, encode_entry

__all__ = ["TierLink", "REMOTE"]

#: Run-index key prefix of entries the tier holds and the store does not.
REMOTE = "shared:"
#: Catalog items remembered (oldest forgotten first).
MAX_REMOTE = 100_000


class TierLink:
    """The tier's catalog as this store knows it, and the round trips to the tier.

    Args:
        shared: the tier.
        store_lock: the linked store's lock (guards ``entries`` and ``runs``).
        entries: the store's entries by key (read only here).
        runs: the store's run index (the tier's entries are indexed there under :data:`REMOTE`).
        insert: ``insert(key, entry)`` holds a fetched entry in the store (not published again).
        prefix_entry: builds a prefix entry from ``(key, ids, kv, fingerprint)``.
        layer_devices: per model layer, where fetched KV goes; None: where this store's first
            published entry's layers are (the CPU until then).
    """

    def __init__(self, shared: SharedSegments, *, store_lock, entries: Mapping[str, Entry], runs: TokenRunIndex,
                 insert: Callable[[str, Entry], Any], prefix_entry: Callable[..., Entry],
                 layer_devices: Optional[Sequence[torch.device]] = None) -> None:
        self.shared, self.prefix_entry = shared, prefix_entry
        self.store_lock, self.entries, self.runs, self.insert = store_lock, entries, runs, insert
        self.lock = threading.Lock()  # one catalog read at a time (the cursor)
        self._local = threading.local()  # per thread: read_once's depth, and whether it read
        self.remote: OrderedDict[str, CatalogItem] = OrderedDict()  # what the tier holds, by key
        self._prefixes = PrefixTree()  # the tier's exact prefixes by their ids
        self._cursor = None  # the tier's catalog cursor (opaque)
        self._devices = list(layer_devices) if layer_devices is not None else None  # per layer
        self.fetched = self.misses = 0
        self._warned = False

    def place(self, layer_devices: Sequence[torch.device]) -> None:
        """Fetch onto ``layer_devices`` (per model layer) where no devices were given."""
        with self.store_lock:
            if self._devices is None:
                self._devices = list(layer_devices)

    @contextmanager
    def read_once(self) -> Iterator[None]:
        """Within it, this thread's :meth:`sync` reads the catalog once, at the first lookup that
        needs it: a plan's lookups (prefix, references, spans, token runs) cost one round trip,
        not one each. What other replicas publish meanwhile is found by the next plan."""
        depth = getattr(self._local, "depth", 0)
        if not depth:
            self._local.read = False
        self._local.depth = depth + 1  # nested scopes read with the outermost
        try:
            yield
        finally:
            self._local.depth = depth

    def sync(self) -> None:
        """Read the catalog items published since the last read: the round trip without the
        store's lock, the items merged under it. One reader at a time, read and merge together
        (another call's sync returns only once what was read before it is findable here)."""
        if getattr(self._local, "depth", 0):
            if self._local.read:
                return
            self._local.read = True
        with self.lock:
            try:
                items, self._cursor = self.shared.catalog(self._cursor)
            except Exception as error:
                with self.store_lock:
                    self.failed(error)
                return
            with self.store_lock:
                for item in items:
                    if item.key in self.remote or item.key in self.entries:
                        continue
                    self._remember(item)
                    self.runs.add(REMOTE + item.key, item.token_ids)
                while len(self.remote) > MAX_REMOTE:
                    key, _ = self.remote.popitem(last=False)
                    self._prefixes.remove(key)
                    self.runs.remove(REMOTE + key)

    def publish(self, key: str, entry: Entry) -> None:
        """Put an entry computed here into the tier, before the call that computed it returns (an
        agent reading it next, on any replica, must find it). Runs without the store's lock (the
        entry's tensors are never written after insertion), so other calls' lookups do not wait
        for the tier's round trip."""
        try:
            item, blob = encode_entry(entry)
            self.shared.publish(item, blob)
        except Exception as error:  # a tier that is down must not stop the engine
            with self.store_lock:
                self.failed(error)
            return
        with self.store_lock:
            if self._devices is None:
                self._devices = [k.device for k in entry.kv.keys for _ in range(k.shape[0])]
            self._remember(item, key)
            if key not in self.entries:  # evicted meanwhile: findable again, fetched on use
                self.runs.add(REMOTE + key, item.token_ids)

    def fetch(self, item: CatalogItem) -> Entry | None:
        """Fetch and hold an entry of the tier (the round trip and decoding without the store's
        lock); None (and forgotten) when the tier no longer has it, fails, or returns a blob that
        is not the announced entry. Two calls fetching the same entry at once both get it."""
        with self.store_lock:
            held = self.entries.get(item.key)
            devices = self._devices
        if held is not None:  # another call fetched it meanwhile
            return held
        try:
            blob = self.shared.fetch(item.key)
            decoded = decode_entry(item, blob, devices) if blob is not None else None
        except Exception as error:
            with self.store_lock:
                self.failed(error)
            decoded = None
        with self.store_lock:
            if decoded is None:
                self.misses += 1
                if item.key not in self.entries:
                    self.remote.pop(item.key, None)
                    self._prefixes.remove(item.key)
                    self.runs.remove(REMOTE + item.key)
                return self.entries.get(item.key)
            held = self.entries.get(item.key)
            if held is not None:
                return held
            entry = (decoded if isinstance(decoded, KVSegment)
                     else self.prefix_entry(item.key, decoded[0], decoded[1], item.fingerprint))
            self.fetched += 1
            self.insert(item.key, entry)
            return self.entries.get(item.key)

    def longer_prefixes(self, ids: torch.Tensor, fingerprint: str, beat: int) -> list[CatalogItem]:
        """The tier's prefix (not held here) sharing the most leading ids with ``ids`` (``[T]``
        int64), where that is more than ``beat``; empty otherwise. Call under the store's lock.

        Found through a radix tree of the catalog's prefixes (:mod:`.prefix_tree`), so a lookup
        costs the match's length, not the catalog's size. One candidate: where its fetch fails,
        the store serves its own longest prefix (speed, never correctness)."""
        hit = self._prefixes.longest(ids.tolist(), fingerprint)
        if hit is None or hit[1] <= beat or hit[0] in self.entries:
            return []  # a prefix held here shares no more than ``beat`` (the store's own best)
        return [self.remote[hit[0]]]

    def _remember(self, item: CatalogItem, key: str | None = None) -> None:
        """Know that the tier holds ``item`` (under ``key``, its own by default)."""
        key = item.key if key is None else key
        self.remote[key] = item
        if item.prefix:
            self._prefixes.add(key, item.fingerprint, list(item.token_ids))

    def or_remote(self, local: Callable[[str], bool], fingerprint: str,
                  prefixes_only: bool = False) -> Callable[[str], bool]:
        """A run-index key filter: ``local`` for the store's own keys; for the tier's, its
        entries of ``fingerprint`` (exact prefixes only, with ``prefixes_only``)."""
        def allowed(key: str) -> bool:
            if not key.startswith(REMOTE):
                return local(key)
            item = self.item(key)
            return item is not None and item.fingerprint == fingerprint and (item.prefix or not prefixes_only)
        return allowed

    def fetch_all(self, items: list[CatalogItem | None]) -> None:
        """Fetch each of ``items`` not held here (None: a local entry), outside the store's lock."""
        for item in items:
            if item is not None:
                self.fetch(item)

    def item(self, run_key: str) -> CatalogItem | None:
        """The catalog item behind a run-index key of the tier's (``"shared:<key>"``), or None."""
        return self.remote.get(run_key[len(REMOTE):]) if run_key.startswith(REMOTE) else None

    def removed(self, key: str) -> None:
        """The store dropped entry ``key``: if the tier holds it, it is findable again (fetched on
        use). Call under the store's lock."""
        item = self.remote.get(key)
        if item is not None:
            self.runs.add(REMOTE + key, item.token_ids)

    def failed(self, error: Exception) -> None:
        """Warn once that the tier failed; the store serves from memory."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"the shared segment tier failed ({type(error).__name__}: {error}); this store "
                          "serves from memory and computes what it cannot find", SharedTierWarning, stacklevel=3)
