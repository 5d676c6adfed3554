"""A segment tier shared by replicas (kvcomm_agents.kv.shared): what one replica computed is
found, fetched and reused by another, exactly where reuse is exact; a miss, a corrupt blob or a
tier that is down costs speed, never correctness. Replicas are brokers on transformers
(PrefixOnlyRuntime, what the vLLM connector drives) and engines, on both tiny families; the tier
is the in-process one here and a real Redis server in tests/integrations/test_redis_tier.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.errors import SharedTierWarning
from kvcomm_agents.kv.block import KVBlock
from kvcomm_agents.kv.segments import KVSegment
from kvcomm_agents.kv.shared import CatalogItem, MemorySegments, decode_entry, encode_entry
from kvcomm_agents.kv.store import PrefixEntry, SegmentStore
from kvcomm_agents.testing import PrefixOnlyRuntime

from ..conftest import QUESTION, tol

SYSTEM_A = "You are agent A. Solve the problem step by step."
SYSTEM_B = "You are agent B. Check the answer of the other agent."


def _segment(tokens: int = 5, fingerprint: str = "fp") -> KVSegment:
    g = torch.Generator().manual_seed(tokens)
    kv = KVBlock((torch.randn(2, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g)),
                 (torch.randn(2, 2, tokens, 4, generator=g), torch.randn(1, 2, tokens, 4, generator=g)), (0, 2))
    return KVSegment.create(kind=("solver", "assistant"), text="x" * tokens, token_ids=list(range(10, 10 + tokens)),
                            char_spans=[(i, i + 1) for i in range(tokens)], kv=kv, fingerprint=fingerprint,
                            context_ids=[1, 2, 3], computed_at=40)


def test_blobs_round_trip_segments_and_prefixes_exactly():
    segment = _segment()
    item, blob = encode_entry(segment)
    back = decode_entry(item, blob)
    assert back.ref == segment.ref and back.text == segment.text and back.token_ids == segment.token_ids
    assert back.char_spans == segment.char_spans and back.context_ids == segment.context_ids
    assert back.computed_at == 40
    assert back.kv.starts == (0, 2)
    for a, b in zip((*back.kv.keys, *back.kv.values), (*segment.kv.keys, *segment.kv.values)):
        assert torch.equal(a, b)
    prefix = PrefixEntry("prefix-x", torch.arange(5), KVBlock.stacked(torch.ones(3, 2, 5, 4), torch.zeros(3, 2, 5, 4)), "fp")
    item, blob = encode_entry(prefix)
    ids, kv = decode_entry(item, blob)
    assert item.prefix and torch.equal(ids, torch.arange(5)) and torch.equal(kv.keys[0], prefix.kv.keys[0])
    assert CatalogItem.from_json(item.to_json()) == item


def test_a_blob_without_the_computed_position_decodes_as_unknown():
    """A blob from a replica that did not record where the KV was computed: decoded, its
    position is unknown (None), so the last-run rule falls back to the recorded context."""
    import json

    from safetensors.torch import load as load_bytes
    from safetensors.torch import save as save_bytes

    from kvcomm_agents.kv.shared import _header

    item, blob = encode_entry(_segment())
    header = _header(blob)
    del header["computed_at"]
    older = save_bytes(load_bytes(blob), metadata={"kvcomm": json.dumps(header)})
    back = decode_entry(item, older)
    assert back.computed_at is None and back.context_ids == (1, 2, 3)


def test_fetched_kv_goes_to_the_models_layer_devices_however_the_publisher_grouped_its_layers():
    segment = _segment()  # three layers published in two device groups (layers 0-1, 2)
    item, blob = encode_entry(segment)
    back = decode_entry(item, blob, [torch.device("cpu")] * 3)  # this model: all three on one device
    assert back.kv.starts == (0,) and len(back.kv.keys) == 1
    for (k, v), (k0, v0) in zip(back.kv.layers(), segment.kv.layers()):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert decode_entry(item, blob).kv.starts == (0, 2)  # no model given: as published, on the CPU
    with pytest.raises(ValueError, match="3 layers for a model of 2"):
        decode_entry(item, blob, [torch.device("cpu")] * 2)

def test_a_blob_that_is_not_the_announced_entry_is_refused():
    item, blob = encode_entry(_segment())
    other = CatalogItem(item.key, "another-model", item.token_ids, item.prefix)
    with pytest.raises(ValueError, match="does not match"):
        decode_entry(other, blob)
    with pytest.raises(ValueError, match="not a segment blob"):
        decode_entry(item, b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")


def test_stores_find_each_others_entries_by_id_and_token_runs():
    tier = MemorySegments()
    a, b = SegmentStore(1 << 20, min_run=4, shared=tier), SegmentStore(1 << 20, min_run=4, shared=tier)
    segment = _segment(12)
    a.put(segment)
    assert b.get(segment.id).ref == segment.ref  # by reference
    c = SegmentStore(1 << 20, min_run=4, shared=tier)
    prompt = torch.tensor([1, 2, 3] + list(range(10, 22)) + [7])
    runs = c.find_runs(prompt, "fp", torch.ones(len(prompt), dtype=torch.bool), len(prompt) - 1)
    assert [(s.id, p, o, n) for s, p, o, n in runs] == [(segment.id, 3, 0, 12)]  # by token run, anywhere
    assert c.find_runs(prompt, "other-model", torch.ones(len(prompt), dtype=torch.bool), len(prompt) - 1) == []
    assert c.stats().shared_fetched == 1 and b.stats().shared_fetched == 1



def test_a_prefix_run_is_fetched_only_where_the_caller_can_use_it_and_segments_never_serve_it():
    tier = MemorySegments()
    segment = _segment(12)
    prompt = torch.tensor([1, 2, 3] + list(range(10, 22)) + [7])
    free = torch.ones(len(prompt), dtype=torch.bool)
    publisher = SegmentStore(1 << 20, min_run=4, shared=tier)
    publisher.put(segment)
    store = SegmentStore(1 << 20, min_run=4, shared=tier)
    assert store.prefix_run_through(prompt, "fp", free, len(prompt) - 1, 3, lambda start, length: True) is None
    assert store.stats().shared_fetched == 0  # a segment holds the run, not a prompt
    publisher.put_prefix(prompt, KVBlock.stacked(torch.zeros(1, 1, len(prompt), 2), torch.zeros(1, 1, len(prompt), 2)), "fp")
    assert store.prefix_run_through(prompt, "fp", free, len(prompt) - 1, 3, lambda start, length: length > 15) is None
    assert store.stats().shared_fetched == 0 and len(store) == 0  # nothing fetched for a run dropped
    view, start, _, length = store.prefix_run_through(prompt, "fp", free, len(prompt) - 1, 3, lambda s, n: True)
    assert view.ref.kind == SegmentStore.PREFIX_KIND and (start, length) == (0, len(prompt) - 1)
    assert store.stats().shared_fetched == 1


def test_a_replica_finds_the_longest_prefix_another_published_and_keeps_its_own_when_longer():
    tier = MemorySegments()
    def kv(n: int) -> KVBlock:
        return KVBlock.stacked(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))

    publisher = SegmentStore(1 << 20, shared=tier)
    for ids in ([1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9, 9], [7, 7]):
        publisher.put_prefix(torch.tensor(ids), kv(len(ids)), "fp")
    publisher.put_prefix(torch.tensor([1, 2, 3, 4, 5, 6, 7]), kv(7), "other-model")
    reader = SegmentStore(1 << 20, shared=tier)
    entry, n = reader.longest_prefix(torch.tensor([1, 2, 3, 4, 5, 8]), "fp")
    assert n == 5 and entry.token_ids.tolist() == [1, 2, 3, 4, 5, 6]  # fetched from the tier
    assert reader.stats().shared_fetched == 1
    reader.put_prefix(torch.tensor([1, 2, 9, 9, 9, 9, 9, 9]), kv(8), "fp")  # its own, longer
    entry, n = reader.longest_prefix(torch.tensor([1, 2, 9, 9, 9, 9, 9, 9, 0]), "fp")
    assert n == 8 and reader.stats().shared_fetched == 1  # nothing fetched for a shorter one
    assert reader.longest_prefix(torch.tensor([5, 5]), "fp") is None
    # covered by what the catalog announced: known without fetching it (nor storing it again)
    late = SegmentStore(1 << 20, shared=tier)
    late.longest_prefix(torch.tensor([5, 5]), "fp")  # reads the catalog
    assert late.covers(torch.tensor([1, 2, 9, 9]), "fp") and not late.covers(torch.tensor([1, 2, 8]), "fp")
    assert late.put_prefix(torch.tensor([7]), kv(1), "fp") and late.stats().shared_fetched == 0 and len(late) == 0


def test_an_evicted_entry_comes_back_from_the_tier():
    tier = MemorySegments()
    first, second = _segment(6), _segment(7)
    store = SegmentStore(second.nbytes + 8, shared=tier)  # room for one
    store.put(first)
    store.put(second)  # evicts the first
    assert store.stats().evictions == 1
    assert store.get(first.id) is not None and store.stats().shared_fetched == 1


def test_a_tier_that_is_down_warns_once_and_the_store_serves_on():
    class Down:
        def publish(self, item, blob):
            raise ConnectionError("tier down")

        catalog = fetch = publish

    store = SegmentStore(1 << 20, shared=Down())
    segment = _segment()
    with pytest.warns(SharedTierWarning, match="tier down"):
        store.put(segment)
        assert store.get(segment.id) is segment
        assert store.get("unknown") is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_another_replicas_exact_prefix_gives_dense_output(family, llama, qwen2, tokenizer):
    """Replica B never saw agent A's first turn: it fetches A's exact prefix from the tier and
    its output equals dense prefill."""
    model = {"llama": llama, "qwen2": qwen2}[family]
    tier = MemorySegments()
    replica_a, replica_b = PrefixOnlyRuntime(model, tokenizer, shared=tier), PrefixOnlyRuntime(model, tokenizer, shared=tier)
    first = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}]
    _, reply, _, _, _ = replica_a.run(replica_a.ids(first), "a")
    follow = replica_b.ids(first + [{"role": "assistant", "content": tokenizer.decode(reply)},
                                    {"role": "user", "content": "Give the final answer only."}])
    logits, _, report, claim, _ = replica_b.run(follow, "a")
    assert claim.length >= len(replica_a.ids(first)) and report["reused_tokens"] == claim.length
    assert replica_b.broker.store.stats().shared_fetched >= 1
    torch.testing.assert_close(logits, replica_b.dense_logits(follow), atol=tol(1e-4), rtol=0)


@pytest.mark.parametrize("broken", ["expired", "corrupt"])
def test_a_missing_or_corrupt_blob_costs_speed_not_correctness(broken, llama, tokenizer):
    tier = MemorySegments()
    replica_a, replica_b = PrefixOnlyRuntime(llama, tokenizer, shared=tier), PrefixOnlyRuntime(llama, tokenizer, shared=tier)
    ids = replica_a.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}])
    replica_a.run(ids, "a")
    for item in tier.catalog(None)[0]:
        if broken == "expired":
            tier.drop(item.key)
        else:
            tier._blobs[item.key] = tier._blobs[item.key][:-16]  # truncated in transit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, _, report, claim, _ = replica_b.run(ids, "a")
    assert claim.length == 0 and report["dense_reason"] == "nothing_to_reuse"
    assert replica_b.broker.store.stats().shared_misses >= 1
    assert any(issubclass(w.category, SharedTierWarning) for w in caught) == (broken == "corrupt")
    torch.testing.assert_close(logits, replica_b.dense_logits(ids), atol=tol(1e-4), rtol=0)


def test_engines_share_a_tier(llama, tokenizer):
    """Two engines (two processes of a fleet) on one tier: the second one's call reuses the
    first one's exact prefix and gives the dense reply."""
    tier = MemorySegments()
    config = KVCommConfig(method="rerotate")
    one, two = KVCommEngine(llama, tokenizer, config=config, shared=tier), KVCommEngine(llama, tokenizer, config=config, shared=tier)
    messages = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}]
    first = one.chat(messages, agent="a", max_new_tokens=6)
    follow = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    served = two.chat(follow, agent="a", max_new_tokens=6)
    dense = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense")).chat(follow, agent="a", max_new_tokens=6)
    assert served.stats.prefix_tokens > 0 and served.text == dense.text
    with pytest.raises(ValueError, match="either store= or shared="):
        KVCommEngine(llama, tokenizer, store=SegmentStore(1 << 20), shared=tier)


def test_a_slow_tier_never_blocks_local_lookups():
    """A fetch waiting on the tier holds no store lock: another call's lookups of what this
    store holds return meanwhile, and the fetch completes once the tier answers."""
    import threading

    class Slow(MemorySegments):
        def __init__(self):
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def fetch(self, key):
            self.entered.set()
            assert self.release.wait(30), "the test never released the tier"
            return super().fetch(key)

    tier = Slow()
    remote, local = _segment(9), _segment(11)
    SegmentStore(1 << 20, min_run=4, shared=tier).put(remote)  # another replica's
    store = SegmentStore(1 << 20, min_run=4, shared=tier)
    store.put(local)
    fetched = {}
    worker = threading.Thread(target=lambda: fetched.setdefault("segment", store.get(remote.id)))
    worker.start()
    try:
        assert tier.entered.wait(30)
        # the fetch is in flight and blocked: local lookups answer anyway
        assert store.get(local.id) is local
        prompt = torch.tensor([1] + list(local.token_ids) + [2])
        runs = store.find_runs(prompt, "fp", torch.ones(len(prompt), dtype=torch.bool), len(prompt) - 1)
        assert [(s.id, p, n) for s, p, _, n in runs] == [(local.id, 1, 11)]
        assert len(store) == 1
    finally:
        tier.release.set()
        worker.join(30)
    assert fetched["segment"].ref == remote.ref and store.stats().shared_fetched == 1


def test_what_one_sync_read_is_findable_before_another_sync_returns():
    """Two lookups on one replica: the first reads the tier's catalog; a second lookup of an entry
    that catalog announced must find it, even while the first lookup is still busy (a read
    catalog is merged before the tier is free for the next reader)."""
    import threading

    tier = MemorySegments()
    segment = _segment(8)
    SegmentStore(1 << 20, shared=tier).put(segment)  # another replica's, published
    store = SegmentStore(1 << 20, shared=tier)
    released, resume = threading.Event(), threading.Event()

    class PausingAfterRelease:  # the first lookup pauses right after letting the tier go
        def __init__(self):
            self.inner = threading.Lock()

        def __enter__(self):
            self.inner.acquire()

        def __exit__(self, *exc):
            self.inner.release()
            if threading.current_thread().name == "first":
                released.set()
                assert resume.wait(30)

    store._tier.lock = PausingAfterRelease()
    first = threading.Thread(target=store.get, args=("unknown",), name="first")
    first.start()
    try:
        assert released.wait(30)
        found = store.get(segment.id)
    finally:
        resume.set()
        first.join(30)
    assert found is not None and found.ref == segment.ref


def test_a_plans_lookups_read_the_catalog_once():
    class Counting(MemorySegments):
        reads = 0

        def catalog(self, cursor):
            Counting.reads += 1
            return super().catalog(cursor)

    tier = Counting()
    store = SegmentStore(1 << 20, min_run=4, shared=tier)
    prompt = torch.arange(20)
    free = torch.ones(20, dtype=torch.bool)

    def lookups():
        store.longest_prefix(prompt, "fp")
        store.get("unknown")
        store.find_runs(prompt, "fp", free, 19)

    lookups()
    assert Counting.reads == 3  # one round trip each
    with store.catalog_read_once():
        lookups()
        with store.catalog_read_once():  # nested: read with the outermost
            lookups()
        lookups()
    assert Counting.reads == 4
    SegmentStore(1 << 20, min_run=4, shared=tier).put(_segment(12))  # published meanwhile
    with store.catalog_read_once():
        assert [run[0].id for run in store.find_runs(torch.arange(10, 22), "fp", free[:12], 11)]  # the next plan finds it
    assert Counting.reads == 5


def test_runs_are_looked_up_once_where_the_tier_adds_nothing(monkeypatch):
    import kvcomm_agents.kv.store as store_module

    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return store_module_scan(*args, **kwargs)

    store_module_scan = store_module.scan
    monkeypatch.setattr(store_module, "scan", counting)
    tier = MemorySegments()
    store = SegmentStore(1 << 20, min_run=4, shared=tier)
    local = _segment(12)
    store.put(local)
    prompt = torch.tensor([1, 2, 3] + list(local.token_ids) + [7])
    free = torch.ones(len(prompt), dtype=torch.bool)
    assert [run[0].id for run in store.find_runs(prompt, "fp", free, len(prompt) - 1)] == [local.id]
    assert len(calls) == 1  # nothing of the tier's: the first look-up is the answer
    remote = _segment(9)
    SegmentStore(1 << 20, min_run=4, shared=tier).put(remote)
    prompt = torch.tensor([1] + list(remote.token_ids) + [7])
    assert [run[0].id for run in store.find_runs(prompt, "fp", torch.ones(len(prompt), dtype=torch.bool),
                                                 len(prompt) - 1)] == [remote.id]
    assert len(calls) == 3 and store.stats().shared_fetched == 1  # fetched, then found here


def test_an_engine_on_a_store_built_by_hand_fetches_onto_its_models_layer_devices(llama, tokenizer):
    """Without the engine's devices, a hand-built store decodes fetched KV as published (on the
    CPU, in the publisher's groups) until its own first publish: on a GPU, a device mismatch."""
    segment = _segment()  # three layers published in two device groups (layers 0-1, 2)
    tier = MemorySegments()
    tier.publish(*encode_entry(segment))
    store = SegmentStore(1 << 24, shared=tier)
    KVCommEngine(llama, tokenizer, store=store)  # the tiny Llama: three layers on one device
    store._tier.sync()
    fetched = store._tier.fetch(store._tier.remote[segment.id])
    assert fetched.kv.starts == (0,) and fetched.kv.keys[0].device == llama.device
