"""Find the stored segments' texts: by exact text, by content hash, and inside a longer text.

Before a call the planner asks which stored texts appear verbatim in each message, and capture asks
whether a text or a reply is held already. A scan of every segment costs time in proportion to
the store (with these scans, the soak's calls spent 17 ms before their prefill at 2,700 entries,
4.7 ms with this index: `python -m benchmarks.soak`, docs/reliability.md); the index keeps each
question to the length of the text asked about.

Inside a longer text: each distinct stored text of at least ``2 * GRAM - 1`` characters is
indexed by the ``GRAM``-character windows that start at its last ``GRAM`` window positions before
its final window (offsets ``len - 2*GRAM + 1 .. len - GRAM``); a text is scanned at every
``GRAM``-th position. An occurrence ending at ``e`` always has a scanned position ``p`` with
``e - 2*GRAM < p <= e - GRAM``, whose window is one of those indexed, so every occurrence is found
and then checked character by character. Texts' endings are indexed, not their openings: replies
open alike ("To solve this...") and end apart. Shorter texts (short replies) are few and checked
one by one.

Pure string work (not thread-safe: the store holds its lock around every call).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["TextIndex", "placed"]

#: Characters per indexed window.
GRAM = 16


class TextIndex:
    """Stored segments' texts by model fingerprint."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str], dict[str, None]] = {}  # (fingerprint, text) -> keys
        self._hashes: dict[tuple[str, str], dict[str, None]] = {}  # (fingerprint, text hash) -> keys
        self._windows: dict[str, dict[str, dict[tuple[str, int], None]]] = {}  # fp -> window -> (text, offset)
        self._short: dict[str, dict[str, None]] = {}  # fp -> texts too short for windows
        self._of: dict[str, tuple[str, str, str]] = {}  # key -> (fingerprint, text, text hash)

    def add(self, key: str, fingerprint: str, text: str, text_hash: str) -> None:
        """Index a segment's text (re-adding a key moves it)."""
        self.remove(key)
        self._of[key] = (fingerprint, text, text_hash)
        self._hashes.setdefault((fingerprint, text_hash), {})[key] = None
        keys = self._keys.setdefault((fingerprint, text), {})
        keys[key] = None
        if len(keys) > 1:
            return  # the text is indexed already
        if len(text) < 2 * GRAM - 1:
            self._short.setdefault(fingerprint, {})[text] = None
            return
        windows = self._windows.setdefault(fingerprint, {})
        for offset in range(len(text) - 2 * GRAM + 1, len(text) - GRAM + 1):
            windows.setdefault(text[offset:offset + GRAM], {})[(text, offset)] = None

    def remove(self, key: str) -> None:
        """Forget a segment (unknown keys are ignored)."""
        held = self._of.pop(key, None)
        if held is None:
            return
        fingerprint, text, text_hash = held
        _drop(self._hashes, (fingerprint, text_hash), key)
        if _drop(self._keys, (fingerprint, text), key):
            return  # other segments still hold the text
        if len(text) < 2 * GRAM - 1:
            _drop(self._short, fingerprint, text)
            return
        windows = self._windows[fingerprint]
        for offset in range(len(text) - 2 * GRAM + 1, len(text) - GRAM + 1):
            _drop(windows, text[offset:offset + GRAM], (text, offset))
        if not windows:  # a fingerprint with nothing left (weights changed since)
            del self._windows[fingerprint]

    def with_text(self, text: str, fingerprint: str) -> list[str]:
        """Keys of the segments whose text is exactly ``text``, oldest indexed first."""
        return list(self._keys.get((fingerprint, text), ()))

    def with_hash(self, text_hash: str, fingerprint: str) -> list[str]:
        """Keys of the segments with this text and ids hash, oldest indexed first."""
        return list(self._hashes.get((fingerprint, text_hash), ()))

    def texts_in(self, text: str, fingerprint: str, min_chars: int = 1) -> list[str]:
        """The distinct stored texts of at least ``min_chars`` characters that occur in ``text``."""
        found: dict[str, None] = {}
        windows = self._windows.get(fingerprint)
        if windows:
            for p in range(0, len(text) - GRAM + 1, GRAM):
                for stored, offset in windows.get(text[p:p + GRAM], ()):
                    if p >= offset and stored not in found and len(stored) >= min_chars \
                            and text.startswith(stored, p - offset):
                        found[stored] = None
        for stored in self._short.get(fingerprint, ()):
            if len(stored) >= min_chars and stored in text:
                found[stored] = None
        return list(found)


def placed(text: str, found: Iterable[str]) -> list[tuple[str, int]]:
    """Where the ``found`` texts sit in ``text``: ``(found text, char offset)`` pairs that do not
    overlap, longest texts placed first, every occurrence of each; sorted by offset."""
    taken: list[tuple[int, int]] = []
    places: list[tuple[str, int]] = []
    for stored in sorted(found, key=len, reverse=True):
        start = text.find(stored)
        while start >= 0:
            end = start + len(stored)
            if all(end <= a or start >= b for a, b in taken):
                taken.append((start, end))
                places.append((stored, start))
            start = text.find(stored, start + 1)
    return sorted(places, key=lambda place: place[1])


def _drop(table: dict, key, member) -> bool:
    """Remove ``member`` from ``table[key]``; True while others remain there."""
    members = table.get(key)
    if members is None:
        return False
    members.pop(member, None)
    if members:
        return True
    del table[key]
    return False
