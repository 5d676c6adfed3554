"""Own-text KV: kept per agent and piece, first one wins, byte budget, a shared freeze count."""

import torch

from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.block_count import BlockCount
from kvcomm_agents.kv.own_text import OwnTextStore, piece_key
from kvcomm_agents.kv.segments import KVSegment


def piece(tokens: int = 3, agent: str = "a") -> KVSegment:
    kv = KVBlock.stacked(torch.zeros(2, 1, tokens, 4), torch.zeros(2, 1, tokens, 4))
    return KVSegment.create(kind=(agent, "own_text"), text="", token_ids=list(range(tokens)),
                            char_spans=[None] * tokens, kv=kv, fingerprint="m")


def test_piece_key_depends_on_the_ids_only():
    assert piece_key([1, 2, 3]) == piece_key((1, 2, 3))
    assert piece_key([1, 2, 3]) != piece_key([1, 2, 4]) and piece_key([12, 3]) != piece_key([1, 23])


def test_pieces_are_per_agent_and_the_first_one_wins():
    store = OwnTextStore(1 << 20)
    first, second = piece(), piece()
    assert store.put("a", "k", first) and store.put("a", "k", second)
    assert store.get("a", "k") is first and store.get("b", "k") is None
    assert len(store) == 1 and store.nbytes() == first.nbytes
    store.clear()
    assert len(store) == 0 and store.get("a", "k") is None


def test_budget_drops_the_least_recently_used():
    one = piece()
    store = OwnTextStore(2 * one.nbytes)
    store.put("a", "k1", one)
    store.put("a", "k2", piece())
    store.get("a", "k1")  # k2 is now least recently used
    store.put("a", "k3", piece())
    assert store.get("a", "k2") is None and store.get("a", "k1") is one and store.get("a", "k3") is not None
    assert store.nbytes() <= store.max_bytes
    assert not OwnTextStore(one.nbytes - 1).put("a", "k", one)  # larger than the budget


def test_freezing_nests_and_interleaves():
    count = BlockCount()
    store = OwnTextStore(1 << 20, count)
    assert not store.frozen
    count.enter()
    count.enter()
    count.leave()  # one block of two ended: still frozen
    assert store.frozen and not store.put("a", "k", piece()) and len(store) == 0
    count.leave()
    assert not store.frozen and store.put("a", "k", piece())
    assert not OwnTextStore(1 << 20).frozen  # a count of its own by default
