"""Find the stored exact prefix that shares the most leading token ids with a prompt.

A radix tree over the token ids of the store's exact-prefix entries, one tree per model
fingerprint (SGLang's RadixAttention keys its prefix cache the same way): each edge holds a run of
ids, each node the keys of the entries that end there. A lookup walks the prompt's ids down the
tree once, so it costs the length of the match, not the number of entries held; a linear scan
compared the prompt with every entry (about 1 ms per lookup at 73 entries on a CPU core, growing
with the store). Removing an entry prunes and re-merges the nodes it leaves without purpose, so
every node still in the tree leads to at least one entry.

Pure token-id work (not thread-safe: the store holds its lock around every call).
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["PrefixTree"]


class _Node:
    __slots__ = ("edge", "parent", "children", "ends")

    def __init__(self, edge: tuple[int, ...], parent: Optional["_Node"]) -> None:
        self.edge = edge  # the ids from the parent to this node (empty for a root)
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by the first id of the child's edge
        self.ends: dict[str, None] = {}  # keys of the entries ending here, oldest first


def _shared(edge: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    """How many leading ids of ``edge`` equal ``ids[start:]``."""
    part = tuple(ids[start : start + len(edge)])
    if part == edge:
        return len(edge)
    n = 0
    for a, b in zip(edge, part):
        if a != b:
            break
        n += 1
    return n


class PrefixTree:
    """Exact prefixes by their token ids, found by longest common prefix."""

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._where: dict[str, _Node] = {}  # key -> the node its ids end at

    def __len__(self) -> int:
        return len(self._where)

    def add(self, key: str, fingerprint: str, ids: Sequence[int]) -> None:
        """Index ``ids`` (a sequence of ints) under ``key`` (re-adding a key moves it)."""
        if key in self._where:
            self.remove(key)
        node = self._roots.setdefault(fingerprint, _Node((), None))
        pos, n = 0, len(ids)
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(tuple(ids[pos:]), node)
                node.children[ids[pos]] = leaf
                node, pos = leaf, n
                break
            k = _shared(child.edge, ids, pos)
            if k < len(child.edge):  # split the edge where the ids leave it
                middle = _Node(child.edge[:k], node)
                node.children[ids[pos]] = middle
                child.edge, child.parent = child.edge[k:], middle
                middle.children[child.edge[0]] = child
                child = middle
            node, pos = child, pos + k
        node.ends[key] = None
        self._where[key] = node

    def remove(self, key: str) -> None:
        """Forget ``key`` (unknown keys are ignored)."""
        node = self._where.pop(key, None)
        if node is None:
            return
        del node.ends[key]
        while node.parent is not None and not node.ends:
            parent = node.parent
            if not node.children:  # a dead end: drop it, then look at its parent
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:  # a pass-through: merge it into its only child
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[child.edge[0]] = child
            break
        if node.parent is None and not node.children and not node.ends:  # a fingerprint with nothing left
            self._roots = {fp: root for fp, root in self._roots.items() if root is not node}

    def longest(self, ids: Sequence[int], fingerprint: str) -> Optional[tuple[str, int]]:
        """The key of an entry sharing the most leading ids with ``ids``, and how many; None when
        no entry of ``fingerprint`` shares even the first."""
        node = self._roots.get(fingerprint)
        if node is None:
            return None
        pos, n = 0, len(ids)
        while pos < n:
            child = node.children.get(ids[pos])
            if child is None:
                break
            k = _shared(child.edge, ids, pos)
            pos += k
            node = child
            if k < len(child.edge):
                break
        if pos == 0:
            return None
        while not node.ends:  # every node leads to an entry; take the nearest below
            node = next(iter(node.children.values()))
        return next(iter(node.ends)), pos

    def prefixes_of(self, ids: Sequence[int], fingerprint: str) -> list[str]:
        """Keys of the entries whose ids are a prefix of ``ids`` (equal included)."""
        node = self._roots.get(fingerprint)
        found: list[str] = []
        pos, n = 0, len(ids)
        while node is not None:
            found += node.ends
            if pos >= n:
                break
            child = node.children.get(ids[pos])
            if child is None or _shared(child.edge, ids, pos) < len(child.edge):
                break
            node, pos = child, pos + len(child.edge)
        return found
