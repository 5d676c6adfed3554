"""Find shared token runs anywhere: a rolling-hash index over the token ids of stored KV.

Every stored entry (segment or exact prefix) is indexed by the hashes of its ``gram``-token
windows starting every ``stride`` tokens. A prompt is scanned window by window (one hash per
prompt position, computed for all positions at once); a hit is checked id by id and extended both
ways to a maximal run. With ``gram + stride - 1 <= min_run``, every run of at least ``min_run``
ids shared with an entry holds one indexed window, so it is found wherever it sits in the prompt
and in the entry (LMCache's range matcher does the same for fixed chunks of a prefix).

Pure token-id work, no model: the matcher (:mod:`..matching`) turns runs into reuse candidates.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

import torch

__all__ = ["TokenRunIndex", "window_hashes"]

_BASE = 1_000_003
_MAX_PER_HASH = 16  # the most recent entries kept per window hash (template text recurs everywhere)


def window_hashes(ids: torch.Tensor, gram: int) -> torch.Tensor:
    """Polynomial hashes of every ``gram``-token window of ``ids``.

    Args:
        ids: ``[n]`` int64 token ids (CPU).
        gram: window length.

    Returns:
        ``[max(n - gram + 1, 0)]`` int64; entry ``p`` hashes ``ids[p : p + gram]`` (int64
        arithmetic wraps; equal hashes are checked id by id before use).
    """
    if ids.numel() < gram:
        return torch.empty(0, dtype=torch.long)
    powers = torch.tensor([_signed(pow(_BASE, gram - 1 - j, 1 << 64)) for j in range(gram)], dtype=torch.long)
    return (ids.long().unfold(0, gram, 1) * powers).sum(dim=1)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class TokenRunIndex:
    """Window hashes of the stored entries' ids (not thread-safe: the store holds its lock).

    Args:
        min_run: the shortest run that must always be found (``min_match_tokens``).
    """

    def __init__(self, min_run: int) -> None:
        self.min_run = max(1, int(min_run))
        self.gram = max(1, (self.min_run + 1) // 2)
        self.stride = max(1, self.min_run - self.gram + 1)
        self._table: dict[int, list[tuple[str, int]]] = {}
        self._keys: dict[str, list[int]] = {}  # key -> its window hashes
        self._ids: dict[str, tuple[int, ...]] = {}  # key -> its token ids

    def add(self, key: str, ids: torch.Tensor | tuple[int, ...]) -> None:
        """Index entry ``key`` holding ``ids``: ``[n]`` int64, or a tuple of ints, kept as it is
        (a tier's catalog item's ids, held once however many items the catalog announces)."""
        self.remove(key)
        tensor = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
        hashes = window_hashes(tensor, self.gram)[:: self.stride].tolist()
        for n, value in enumerate(hashes):
            bucket = self._table.setdefault(value, [])
            bucket.append((key, n * self.stride))
            if len(bucket) > _MAX_PER_HASH:
                del bucket[0]
        self._keys[key] = hashes
        self._ids[key] = ids if isinstance(ids, tuple) else tuple(tensor.tolist())

    def remove(self, key: str) -> None:
        """Forget entry ``key`` (no-op if it is not indexed)."""
        self._ids.pop(key, None)
        for value in set(self._keys.pop(key, ())):
            bucket = self._table.get(value)
            if bucket is None:
                continue
            bucket[:] = [hit for hit in bucket if hit[0] != key]
            if not bucket:
                del self._table[value]

    def ids(self, key: str) -> tuple[int, ...]:
        """The token ids of entry ``key``."""
        return self._ids[key]

    def hits(self, value: int) -> Sequence[tuple[str, int]]:
        """``(key, offset)`` of the indexed windows with hash ``value``, most recent last."""
        return self._table.get(value, ())

    def __len__(self) -> int:
        return len(self._keys)


def extend_run(prompt: Sequence[int], source: Sequence[int], p: int, o: int, gram: int, lower: int,
               upper: int, free: list[bool]) -> tuple[int, int, int]:
    """The maximal run through a verified window hit: prompt ``p..p+gram`` equals source
    ``o..o+gram``; grown backwards no lower than ``lower`` and forwards short of ``upper``, over
    free prompt positions only. Returns ``(prompt_start, source_start, length)``."""
    back = 0
    while p - back - 1 >= lower and o - back - 1 >= 0 and free[p - back - 1] \
            and prompt[p - back - 1] == source[o - back - 1]:
        back += 1
    forward = gram
    while p + forward < upper and o + forward < len(source) and free[p + forward] \
            and prompt[p + forward] == source[o + forward]:
        forward += 1
    return p - back, o - back, back + forward


def scan(prompt_ids: torch.Tensor, free: torch.Tensor, index: TokenRunIndex, allowed: Callable[[str], bool],
         upper: int) -> Iterator[tuple[str, int, int, int]]:
    """Maximal shared runs of the prompt, left to right, none overlapping.

    Args:
        prompt_ids: ``[n]`` int64 prompt ids.
        free: ``[n]`` bool, positions a run may cover.
        index: the stored entries' window hashes.
        allowed: whether the entry ``key`` may serve (e.g. it has the engine's fingerprint).
        upper: runs end before this position.

    Yields:
        ``(key, prompt_start, source_start, length)`` with ``length >= index.min_run``; at each
        position the longest run wins (ties: the most recently indexed entry).
    """
    gram = index.gram
    prompt, free_list = tuple(prompt_ids.tolist()), free.tolist()
    hashes = window_hashes(prompt_ids, gram).tolist()
    blocked = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum((~free).long(), 0)]).tolist()
    p, lower = 0, 0
    while p + gram <= upper:
        if blocked[p + gram] - blocked[p]:
            p += 1
            continue
        best = None
        for key, o in reversed(index.hits(hashes[p])):
            if not allowed(key):
                continue
            source = index.ids(key)
            if source[o : o + gram] != prompt[p : p + gram]:
                continue
            run = extend_run(prompt, source, p, o, gram, lower, upper, free_list)
            if best is None or run[2] > best[3]:
                best = (key, *run)
        if best is not None and best[3] >= index.min_run:
            yield best
            p = lower = best[1] + best[3]
        else:
            p += 1


def longest_through(prompt_ids: torch.Tensor, free: torch.Tensor, index: TokenRunIndex,
                    allowed: Callable[[str], bool], upper: int, position: int,
                    wanted: Callable[[int, int], bool]) -> Optional[tuple[str, int, int, int]]:
    """The longest maximal run through prompt ``position`` that ``wanted`` accepts, of those
    covering at least ``gram + stride - 1`` ids from there: each of those holds an indexed window
    starting in ``[position, position + stride)``, so a few look-ups find them all, wherever
    their entries were indexed (an earlier prompt holding a text a few ids after its start).

    Args:
        prompt_ids, free, index, allowed, upper: as for :func:`scan`.
        position: the prompt position the run must cover.
        wanted: ``(prompt_start, length)`` -> whether the caller can use the run.

    Returns:
        ``(key, prompt_start, source_start, length)`` or None; ties: the most recently indexed
        entry (at the lowest window).
    """
    gram, prompt, free_list = index.gram, tuple(prompt_ids.tolist()), free.tolist()
    stop = min(position + index.stride, upper - gram + 1)
    hashes = window_hashes(prompt_ids[position : stop + gram - 1], gram).tolist() if stop > position else []
    best, met = None, set()  # met: (key, source offset - prompt offset) of the runs extended
    for q, value in enumerate(hashes, start=position):
        if not all(free_list[q : q + gram]):
            continue
        for key, o in reversed(index.hits(value)):
            if (key, o - q) in met or not allowed(key):
                continue  # a later window of a run already met: the same run
            source = index.ids(key)
            if source[o : o + gram] != prompt[q : q + gram]:
                continue
            met.add((key, o - q))
            run = extend_run(prompt, source, q, o, gram, 0, upper, free_list)
            if run[0] <= position and (best is None or run[2] > best[3]) and wanted(run[0], run[2]):
                best = (key, *run)
    return best
