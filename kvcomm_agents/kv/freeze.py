"""``FreezeCount``: a thread-safe count of open ``freeze_anchors`` blocks (they nest and interleave)."""

from __future__ import annotations

import threading

__all__ = ["FreezeCount"]


class FreezeCount:
    """Frozen while at least one block is open; a counter, not a saved flag, so that two
    interleaved blocks (threads, tasks) never leave it frozen for good."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def frozen(self) -> bool:
        return self._count > 0

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
