"""``BlockCount``: a thread-safe count of open blocks (``freeze_anchors``, ``calibrating``), so
that blocks nest and interleave across threads and tasks."""

from __future__ import annotations

import threading

__all__ = ["BlockCount"]


class BlockCount:
    """Active while at least one block is open; a counter, not a saved flag, so that two
    interleaved blocks never leave it active for good."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self._count > 0

    def enter(self) -> None:
        with self._lock:
            self._count += 1

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
