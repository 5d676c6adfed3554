"""Tables keyed by names a long-running engine may never see again (agents named per user or per
request, senders of a graph that changes shape): held to a bound, the least recently used
key first to go, so that memory and the work that walks them stay flat however many names pass."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, TypeVar

__all__ = ["RecentDict", "MAX_AGENTS", "MAX_AGENT_KINDS"]

K = TypeVar("K")
V = TypeVar("V")

#: Agents a per-agent table keeps (receivers, senders): far more than a graph runs at once.
MAX_AGENTS = 1024
#: ``(agent, segment kind)`` pairs a per-pair table keeps.
MAX_AGENT_KINDS = 4096


class RecentDict(OrderedDict):
    """A dict of at most ``limit`` keys: setting a key, or :meth:`touch`, makes it the newest;
    beyond the limit the oldest go. Not thread-safe on its own (its owners hold a lock)."""

    def __init__(self, limit: int, items: Iterable[tuple[K, V]] = ()) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        super().__init__()
        self.limit = limit
        for key, value in items:
            self[key] = value

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def touch(self, key: K, make: Callable[[], V]) -> V:
        """``key``'s value, made the newest; ``make()`` stored first where the key is missing."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        return value
