"""The affinity rule: which replica of a fleet serves a prompt, from the token runs each replica
computed. One implementation for both routers that use it: :class:`~.fleet.AffinityRouter`
(client side, :class:`~.fleet.FleetEngine`) and :class:`~.ray_router.KVAffinityRouter` (server
side, Ray Serve).

- :class:`Holdings`: per replica, the token ids of the requests it computed (prompts and replies),
  indexed by the rolling-hash matcher the segment store itself uses, newest ``remember`` kept. A
  prompt's *held* tokens on a replica are the tokens (all but the last) covered by runs of at
  least ``min_run`` ids found anywhere in them: an exact prefix or a segment to re-rotate.
- :class:`AffinityRule`: the replica holding most of the prompt gets it if it holds at least
  ``min_share`` of it and has fewer than ``max_imbalance`` more requests in flight than the least
  busy replica (the rule of cache-aware routers such as SGLang's); otherwise, and on ties, the
  least busy, in turn.
- :class:`ComputedLog`: what a replica reports it computed (Ray Serve's ``record_routing_stats``),
  as compact bytes; :func:`reported_runs` and :meth:`Holdings.sync`: the router's side of it.

No Ray and no vLLM import: the rule is tested without either (``tests/integrations``).
"""

from __future__ import annotations

import itertools
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvcomm_agents.paged import TokenRunIndex, scan

__all__ = ["AffinityRule", "Holdings", "ComputedLog", "reported_runs", "decode_ids", "RUNS_KEY"]

#: the key of the computed runs in a replica's routing stats
RUNS_KEY = "kvcomm_runs"
_ID_CODE = "i"  # 32-bit token ids: every tokenizer's vocabulary fits


class Holdings:
    """The token runs one replica computed, the newest ``remember`` requests kept (not
    thread-safe: its owner locks).

    Args:
        min_run: the shortest token run that counts (the connector's ``min_match_tokens``).
        remember: requests remembered (oldest forgotten first; a replica's own store forgets too).
    """

    def __init__(self, min_run: int = 16, remember: int = 4096):
        if remember < 1:
            raise ValueError("a replica's holdings must remember at least one request")
        self._index = TokenRunIndex(min_run)
        self._order: OrderedDict[str, None] = OrderedDict()
        self.remember = remember

    def add(self, key: str, ids: Sequence[int]) -> None:
        """The replica computed ``ids`` (a prompt followed by its reply), known as ``key``."""
        self._index.add(key, torch.as_tensor(list(ids), dtype=torch.long))
        self._order[key] = None
        self._order.move_to_end(key)
        while len(self._order) > self.remember:
            old, _ = self._order.popitem(last=False)
            self._index.remove(old)

    def discard(self, key: str) -> None:
        """Forget ``key`` (no-op when it is not held)."""
        if key in self._order:
            del self._order[key]
            self._index.remove(key)

    def keys(self) -> list[str]:
        """The keys held, oldest first."""
        return list(self._order)

    def covered(self, prompt_ids: Sequence[int]) -> int:
        """The prompt tokens (all but the last, which is always computed) covered by held runs."""
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        if not self._order or ids.numel() < 2:
            return 0
        free = torch.ones(ids.numel(), dtype=torch.bool)
        return sum(run[3] for run in scan(ids, free, self._index, lambda key: True, ids.numel() - 1))

    def sync(self, prefix: str, reported: Sequence[tuple[str, bytes]]) -> None:
        """Make the keys starting with ``prefix`` exactly those ``reported`` (a replica's own
        report, :func:`reported_runs`): new ones decoded and added, ones it no longer reports
        dropped. Keys with other prefixes (what a router recorded itself) are kept."""
        fresh = {key for key, _ in reported}
        for key in self.keys():
            if key.startswith(prefix) and key not in fresh:
                self.discard(key)
        for key, data in reported:
            if key not in self._order:
                self.add(key, decode_ids(data))


@dataclass(frozen=True)
class AffinityRule:
    """Where a prompt goes, given what each replica holds of it and its requests in flight.

    Args:
        min_share: the share of the prompt a replica must hold for affinity to count.
        max_imbalance: requests in flight beyond the least busy replica's at which affinity yields.
    """

    min_share: float = 0.25
    max_imbalance: int = 4

    def rank(self, held: Sequence[int], in_flight: Sequence[int], prompt_tokens: int, turn: int = 0) -> list[int]:
        """Replica indices, the choice first, then the others least busy first.

        Args:
            held: per replica, the prompt tokens it holds (:meth:`Holdings.covered`).
            in_flight: per replica, its requests in flight.
            prompt_tokens: the prompt's length.
            turn: a counter the caller advances per request: ties go round in turn.
        """
        if len(held) != len(in_flight) or not held:
            raise ValueError(f"held and in_flight must name the same replicas ({len(held)} vs {len(in_flight)})")
        least, best = min(in_flight), max(held)
        candidates = [r for r, n in enumerate(held) if n == best]
        worth = best > 0 and best >= self.min_share * max(prompt_tokens - 1, 1)
        if not worth or min(in_flight[r] for r in candidates) - least >= self.max_imbalance:
            candidates = list(range(len(held)))
        fewest = min(in_flight[r] for r in candidates)
        candidates = [r for r in candidates if in_flight[r] == fewest]
        choice = candidates[turn % len(candidates)]
        others = sorted((r for r in range(len(held)) if r != choice), key=lambda r: (in_flight[r], -held[r]))
        return [choice, *others]


class ComputedLog:
    """What one replica computed, newest first kept, as it reports it to routers.

    Args:
        remember: requests kept.
        max_tokens: token ids kept in all (bounds the report's size: 4 bytes per id).
    """

    def __init__(self, remember: int = 1024, max_tokens: int = 262_144):
        # a per-process prefix: keys of a replaced replica never collide with its predecessor's
        self.prefix = f"{uuid.uuid4().hex[:12]}:"
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._tokens, self._count = 0, itertools.count(1)
        self.remember, self.max_tokens = remember, max_tokens

    def add(self, ids: Sequence[int]) -> Optional[str]:
        """Log ``ids`` (a prompt followed by its reply); returns its key (None when empty)."""
        if not ids:
            return None
        key = f"{self.prefix}{next(self._count)}"
        data = array(_ID_CODE, ids).tobytes()
        self._entries[key] = data
        self._tokens += len(ids)
        while len(self._entries) > 1 and (len(self._entries) > self.remember or self._tokens > self.max_tokens):
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old) // array(_ID_CODE).itemsize
        return key

    def report(self) -> dict:
        """The routing stats: ``{RUNS_KEY: {"prefix": ..., "runs": [(key, bytes), ...]}}``."""
        return {RUNS_KEY: {"prefix": self.prefix, "runs": list(self._entries.items())}}


def reported_runs(stats: Optional[dict]) -> tuple[Optional[str], list[tuple[str, bytes]]]:
    """A replica's routing stats as ``(key prefix, [(key, encoded ids), ...])``; ``(None, [])``
    when it reported none (not yet, or not a replica of this deployment)."""
    entry = (stats or {}).get(RUNS_KEY)
    if not entry:
        return None, []
    return entry["prefix"], list(entry["runs"])


def decode_ids(data: bytes) -> list[int]:
    """Token ids as :meth:`ComputedLog.add` encoded them."""
    ids = array(_ID_CODE)
    ids.frombytes(data)
    return ids.tolist()
