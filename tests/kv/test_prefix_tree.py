"""The prefix tree finds what a scan of every entry finds, through adds, splits and removals."""

import random

from kvcomm_agents.kv.prefix_tree import PrefixTree


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def scan_longest(entries: dict[str, tuple[str, list[int]]], ids: list[int], fingerprint: str) -> int:
    return max((common(e, ids) for fp, e in entries.values() if fp == fingerprint), default=0)


def test_longest_and_prefixes_match_a_scan_of_every_entry_through_adds_and_removals():
    rng = random.Random(0)
    tree, entries = PrefixTree(), {}
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(6)]  # shared openings
    for step in range(600):
        if entries and rng.random() < 0.35:
            key = rng.choice(sorted(entries))
            tree.remove(key)
            del entries[key]
        else:
            ids = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 10))]
            key, fingerprint = f"k{step % 40}", rng.choice(["m1", "m2"])  # keys are re-added too
            tree.add(key, fingerprint, ids)
            entries[key] = (fingerprint, ids)
        for _ in range(3):
            query = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
            fingerprint = rng.choice(["m1", "m2"])
            expected = scan_longest(entries, query, fingerprint)
            hit = tree.longest(query, fingerprint)
            if expected == 0:
                assert hit is None
            else:
                key, n = hit
                assert n == expected and entries[key][0] == fingerprint and common(entries[key][1], query) == n
            covered = {k for k, (fp, e) in entries.items() if fp == fingerprint and query[: len(e)] == e}
            assert set(tree.prefixes_of(query, fingerprint)) == covered
        assert len(tree) == len(entries)


def test_removing_every_entry_leaves_nothing_to_find():
    tree = PrefixTree()
    tree.add("a", "m", [1, 2, 3, 4])
    tree.add("b", "m", [1, 2, 9])
    tree.add("c", "m", [1, 2])
    assert tree.longest([1, 2, 3, 7], "m") == ("a", 3)
    assert tree.longest([1, 2, 3, 7], "other") is None
    assert sorted(tree.prefixes_of([1, 2, 9, 9], "m")) == ["b", "c"]
    for key in ("c", "a", "b", "unknown"):
        tree.remove(key)
    assert tree.longest([1, 2, 3], "m") is None and len(tree) == 0
