"""The segment store: KV segments and exact prefixes under one byte budget.

Thread-safe. Entries are evicted least recently used first when the budget is exceeded, never
while a running call has them pinned. Segments are found by reference (id) or by content (their
text appearing verbatim in a message); exact prefixes by the longest common prefix of token ids;
and any run of token ids shared with any entry, wherever it sits (:meth:`SegmentStore.find_runs`,
a rolling-hash index kept with the entries). With a shared tier (:mod:`.shared`, e.g. Redis for a
fleet of replicas), every entry computed here is also published, and entries other replicas
published are found like local ones; their KV is fetched on first use and held here under the
same budget (:mod:`.tier_link`: round trips run outside the store's lock, so a slow tier delays
only the lookups that need it).
"""

from __future__ import annotations

import itertools
import threading
import uuid
import warnings
from collections import OrderedDict, deque
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch
from pydantic import BaseModel

from ..checks import byte_budget
from ..errors import BudgetWarning
from .block import KVBlock
from .entries import Entry, PrefixEntry
from .prefix_tree import PrefixTree
from .text_index import TextIndex, placed
from .run_index import TokenRunIndex, longest_through, scan
from .segments import KVSegment
from .shared import SharedSegments
from .tier_link import REMOTE, TierLink

__all__ = ["SegmentStore", "PrefixEntry", "StoreStats"]


class StoreStats(BaseModel):
    """Counters of a :class:`SegmentStore`."""

    segments: int
    prefixes: int
    bytes: int
    max_bytes: int
    evictions: int
    pinned: int
    shared_fetched: int = 0
    shared_misses: int = 0


class SegmentStore:
    """In-process store of KV segments and exact prefixes with a byte budget.

    Args:
        max_bytes: budget for all KV held; least recently used entries go first beyond it.
        min_run: shortest shared token run :meth:`find_runs` must find (``min_match_tokens``).
        shared: a tier shared with other stores (other replicas); None: this process only.
        layer_devices: per model layer, where KV fetched from ``shared`` goes (:func:`.shared.decode_entry`).
    """

    PREFIX_KIND = ("prompt", None)
    """Kind of the segment view of an exact prefix served as a token run (its anchor pool)."""

    def __init__(self, max_bytes: int, *, min_run: int = 8, shared: SharedSegments | None = None,
                 layer_devices: Sequence[torch.device] | None = None) -> None:
        self.max_bytes = byte_budget(max_bytes)
        self._lock = threading.RLock()  # the store's memory; never held during a round trip to the tier
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # LRU order, oldest first
        self._bytes = 0
        self._pins: dict[str, int] = {}
        self._evicted: deque[str] = deque(maxlen=4096)
        self._evictions = 0
        self._warned = False
        self._runs = TokenRunIndex(min_run)
        self._prefixes = PrefixTree()  # the exact-prefix entries by their ids
        self._texts = TextIndex()  # the segments by their texts and content hashes
        self._used: dict[str, int] = {}  # key -> when it was last inserted or used (LRU order)
        self._clock = itertools.count()
        self._views: dict[str, KVSegment] = {}  # segment views of prefix entries, by entry id
        self._view_entries: dict[str, str] = {}  # the entry id of each view id
        self.shared = shared
        self._tier = TierLink(shared, store_lock=self._lock, entries=self._entries, runs=self._runs,
                              insert=lambda key, entry: self._insert(key, entry, publish=False),
                              prefix_entry=PrefixEntry, layer_devices=layer_devices) if shared is not None else None

    def fetch_onto(self, layer_devices: Sequence[torch.device]) -> None:
        """Where KV fetched from the shared tier goes, per model layer, unless set at construction
        (an engine calls it: a store built by hand fetched onto the CPU until its first publish)."""
        if self._tier is not None:
            self._tier.place(layer_devices)

    # ---- segments -------------------------------------------------------------------------
    def put(self, segment: KVSegment) -> bool:
        """Add a segment; returns False when it alone exceeds the budget (not stored)."""
        return self._insert(segment.id, segment)

    def get(self, segment_id: str) -> KVSegment | None:
        """The segment with this id (a prefix entry's segment view too, :meth:`find_runs`), or
        None if unknown or evicted. Marks it recently used."""
        with self._lock:
            entry = self._entries.get(segment_id)
            viewed = self._view_entries.get(segment_id)
            if entry is None and viewed is not None and viewed in self._entries:
                self._touch(viewed)
                return self._segment_view(self._entries[viewed])
        if entry is None and self._tier is not None:
            self._tier.sync()
            with self._lock:
                item = self._tier.remote.get(segment_id)
            entry = self._tier.fetch(item) if item is not None and not item.prefix else None
        if not isinstance(entry, KVSegment):
            return None
        with self._lock:
            if segment_id in self._entries:
                self._touch(segment_id)
        return entry

    def was_evicted(self, segment_id: str) -> bool:
        """True if this id was evicted recently (distinguishes 'evicted' from 'not_found')."""
        with self._lock:
            return segment_id in self._evicted

    def find_by_hash(self, text_hash: str, fingerprint: str) -> KVSegment | None:
        """A segment of ``fingerprint`` with exactly this text and ids hash."""
        with self._lock:
            keys = self._recent_first(self._texts.with_hash(text_hash, fingerprint))
            return self._entries[keys[0]] if keys else None

    def twins(self, segment: KVSegment, fingerprint: str) -> list[KVSegment]:
        """Other segments of ``fingerprint`` with the same text and ids as ``segment`` (another
        producer's), most recent first."""
        with self._lock:
            return [self._entries[key] for key in self._recent_first(self._texts.with_hash(segment.ref.text_hash, fingerprint))
                    if self._entries[key] is not segment and key != segment.ref.id]

    def find_text(self, text: str, fingerprint: str) -> KVSegment | None:
        """The most recent segment of ``fingerprint`` whose text is exactly ``text``."""
        with self._lock:
            keys = self._recent_first(self._texts.with_text(text, fingerprint))
            return self._entries[keys[0]] if keys else None

    def find_in_text(
        self, text: str, fingerprint: str, *, min_chars: int = 1
    ) -> list[tuple[KVSegment, int]]:
        """Segments of ``fingerprint`` whose text appears verbatim in ``text``.

        Returns:
            ``(segment, char_offset)`` pairs that do not overlap, longest segments first, then
            sorted by offset. Each text is taken once (the most recently used segment of it).
        """
        with self._lock:
            held = {seg_text: self._entries[self._recent_first(self._texts.with_text(seg_text, fingerprint))[0]]
                    for seg_text in self._texts.texts_in(text, fingerprint, min_chars)}
        return [(held[seg_text], offset) for seg_text, offset in placed(text, held)]

    # ---- exact prefixes -------------------------------------------------------------------
    def put_prefix(self, token_ids: torch.Tensor, kv: KVBlock, fingerprint: str) -> bool:
        """Keep the exact KV of ``token_ids`` (``[n]``); drops the entries it covers if it fits."""
        ids = token_ids.detach().to("cpu", torch.long)
        entry = PrefixEntry(f"prefix-{uuid.uuid4().hex}", ids, kv, fingerprint)
        with self._lock:  # covered, dropped and inserted in one hold: two calls cannot both insert it
            if self.covers(ids, fingerprint):
                return True
            if entry.nbytes <= self.max_bytes:
                for key in self._prefixes.prefixes_of(ids.tolist(), fingerprint):
                    self._remove(key)  # covered; a running call keeps its own tensors
            kept = self._insert(entry.id, entry, publish=False)
        if entry.nbytes <= self.max_bytes and self._tier is not None:  # outside the lock: a tier round trip
            self._tier.publish(entry.id, entry)
        return kept

    def covers(self, token_ids: torch.Tensor, fingerprint: str) -> bool:
        """Whether a prefix entry held here, or one the shared tier's catalog announced, holds
        all of ``token_ids`` (``[n]`` int64): nothing fetched, no round trip to the tier."""
        ids = token_ids.detach().to("cpu", torch.long)
        with self._lock:
            hit = self._prefixes.longest(ids.tolist(), fingerprint)
            if hit is not None and hit[1] == ids.numel():
                return True
            return self._tier is not None and bool(self._tier.longer_prefixes(ids, fingerprint, ids.numel() - 1))

    def longest_prefix(self, token_ids: torch.Tensor, fingerprint: str) -> tuple[PrefixEntry, int] | None:
        """The prefix entry sharing the longest common prefix with ``token_ids`` (``[T]`` int64)
        and its length (a longer one of the shared tier is fetched)."""
        ids = token_ids.detach().to("cpu", torch.long)
        with self._lock:
            hit = self._prefixes.longest(ids.tolist(), fingerprint)
            best = (self._entries[hit[0]], hit[1]) if hit is not None else None
        if self._tier is not None:
            self._tier.sync()
            with self._lock:
                longer = self._tier.longer_prefixes(ids, fingerprint, best[1] if best else 0)
            for item in longer:
                entry = self._tier.fetch(item)
                if isinstance(entry, PrefixEntry):
                    best = (entry, entry.common_prefix(ids))
                    break
        if best is not None:
            with self._lock:
                if best[0].id in self._entries:
                    self._touch(best[0].id)
        return best

    # ---- shared token runs anywhere ---------------------------------------------------------
    def find_runs(self, token_ids: torch.Tensor, fingerprint: str, free: torch.Tensor,
                  upper: int) -> list[tuple[KVSegment, int, int, int]]:
        """Runs of ``token_ids`` that a stored entry of ``fingerprint`` holds, wherever they sit.

        Args:
            token_ids: ``[n]`` int64 prompt ids.
            free: ``[n]`` bool, the positions a run may cover.
            upper: runs end before this position.

        Returns:
            ``(segment, prompt_start, segment_start, length)`` in prompt order, not overlapping,
            each at least ``min_run`` long; an exact prefix entry is served through a segment view
            of kind :attr:`PREFIX_KIND` (its keys are already in the canonical frame).
        """
        ids = token_ids.detach().to("cpu", torch.long)
        return self._runs_found(lambda allowed: scan(ids, free, self._runs, allowed, upper), fingerprint)

    def prefix_run_through(self, token_ids: torch.Tensor, fingerprint: str, free: torch.Tensor, upper: int,
                           position: int, wanted: Callable[[int, int], bool]) -> Optional[tuple[KVSegment, int, int, int]]:
        """The longest run of an exact prefix entry (a whole earlier prompt) through prompt
        ``position`` that ``wanted(prompt_start, length)`` accepts (:func:`.run_index.longest_through`),
        as :meth:`find_runs` gives runs; None if there is none."""
        ids = token_ids.detach().to("cpu", torch.long)

        def lookup(allowed: Callable[[str], bool]) -> list[tuple[str, int, int, int]]:
            run = longest_through(ids, free, self._runs, allowed, upper, position, wanted)
            return [run] if run is not None else []
        found = self._runs_found(lookup, fingerprint, prefixes_only=True)
        return found[0] if found else None

    def _runs_found(self, lookup: Callable[[Callable[[str], bool]], Iterable[tuple[str, int, int, int]]],
                    fingerprint: str, prefixes_only: bool = False) -> list[tuple[KVSegment, int, int, int]]:
        """What ``lookup(allowed)`` finds among the entries of ``fingerprint`` (exact prefixes
        only, with ``prefixes_only``), the tier's fetched first (outside the lock), each found
        entry counted as used."""
        def allowed(key: str) -> bool:
            entry = self._entries.get(key)
            return entry is not None and entry.fingerprint == fingerprint \
                and (isinstance(entry, PrefixEntry) or not prefixes_only)

        runs = None
        if self._tier is not None:
            self._tier.sync()
            with self._lock:
                runs = list(lookup(self._tier.or_remote(allowed, fingerprint, prefixes_only)))
                items = [self._tier.item(key) for key, *_ in runs]
            if any(item is not None for item in items):
                self._tier.fetch_all(items)  # then looked up again: found here
                runs = None
        with self._lock:
            found = []
            for key, start, source_start, length in runs if runs is not None else lookup(allowed):
                if key in self._entries:  # (found before the lock was let go: it may have gone since)
                    self._touch(key)
                    found.append((self._segment_view(self._entries[key]), start, source_start, length))
            return found

    def _segment_view(self, entry: Entry) -> KVSegment:
        if isinstance(entry, KVSegment):
            return entry
        view = self._views.get(entry.id)
        if view is None:
            ids = entry.token_ids.tolist()
            view = self._views[entry.id] = KVSegment.create(
                kind=self.PREFIX_KIND, text="", token_ids=ids, char_spans=[None] * len(ids), kv=entry.kv,
                fingerprint=entry.fingerprint, computed_at=0)
            self._view_entries[view.id] = entry.id
        return view

    def catalog_read_once(self) -> ContextManager[None]:
        """Within it, this thread's lookups read the shared tier's catalog once (:meth:`.tier_link.TierLink.read_once`)."""
        return self._tier.read_once() if self._tier is not None else nullcontext()

    # ---- lifetime -------------------------------------------------------------------------
    @contextmanager
    def pinned(self, entries: list[Entry]) -> Iterator[None]:
        """Keep ``entries`` from eviction for the duration of a call (a prefix entry's segment view
        pins the entry)."""
        with self._lock:
            keys = [self._view_entries.get(e.id, e.id) for e in entries]
            for key in keys:
                self._pins[key] = self._pins.get(key, 0) + 1
                if key in self._entries:  # used by a call: most recently used, however it was found
                    self._touch(key)
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self._pins[key] -= 1
                    if not self._pins[key]:
                        del self._pins[key]
                self._evict()

    def resize(self, max_bytes: int) -> None:
        """Change the budget, evicting unpinned entries (least recently used first) to fit."""
        with self._lock:
            self.max_bytes = byte_budget(max_bytes)
            self._evict()

    def stats(self) -> StoreStats:
        """Counts and bytes held."""
        with self._lock:
            prefixes = len(self._prefixes)
            return StoreStats(
                segments=len(self._entries) - prefixes,
                prefixes=prefixes,
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                evictions=self._evictions,
                pinned=sum(key in self._entries for key in self._pins),
                shared_fetched=self._tier.fetched if self._tier is not None else 0,
                shared_misses=self._tier.misses if self._tier is not None else 0,
            )

    def clear(self) -> None:
        """Drop every entry that no running call uses."""
        with self._lock:
            for key in list(self._entries):
                if not self._pins.get(key):
                    self._remove(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _insert(self, key: str, entry: Entry, publish: bool = True) -> bool:
        size = entry.nbytes
        with self._lock:
            if size > self.max_bytes:
                self._too_small(size)
                return False
            if key in self._entries:
                self._remove(key)
            self._entries[key] = entry
            self._bytes += size
            self._runs.remove(REMOTE + key)
            self._runs.add(key, entry.ids_tensor())
            if isinstance(entry, PrefixEntry):
                self._prefixes.add(key, entry.fingerprint, entry.token_ids.tolist())
            elif isinstance(entry, KVSegment):
                self._texts.add(key, entry.ref.fingerprint, entry.text, entry.ref.text_hash)
            self._used[key] = next(self._clock)
            self._evict()
            kept = key in self._entries
        if publish and self._tier is not None:  # even when evicted at once (other replicas may use it)
            self._tier.publish(key, entry)
        return kept

    def _too_small(self, size: int) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"the segment store's budget ({self.max_bytes} bytes) cannot hold a KV entry of {size} bytes: "
                "it is not kept, so later calls compute that text again; raise store_max_bytes",
                BudgetWarning, stacklevel=4,
            )

    def _evict(self) -> None:
        if self._bytes <= self.max_bytes:
            return  # the common case: no list of every key
        for key in list(self._entries):
            if self._bytes <= self.max_bytes:
                return
            if not self._pins.get(key):
                self._remove(key)
                self._evicted.append(key)
                self._evictions += 1

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._runs.remove(key)
        self._prefixes.remove(key)
        self._texts.remove(key)
        self._used.pop(key, None)
        view = self._views.pop(key, None)
        if view is not None:
            self._view_entries.pop(view.id, None)
        if self._tier is not None:  # the tier may still hold it: findable again, fetched on use
            self._tier.removed(key)


    def _touch(self, key: str) -> None:
        """Mark ``key`` most recently used (under the lock)."""
        self._entries.move_to_end(key)
        self._used[key] = next(self._clock)

    def _recent_first(self, keys: list[str]) -> list[str]:
        """``keys`` held here, most recently used first (under the lock)."""
        return sorted((key for key in keys if key in self._entries), key=self._used.__getitem__, reverse=True)


