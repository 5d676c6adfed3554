"""The shared segment tier on Redis (``pip install kvcomm-agents[redis]``): a fleet's replicas
publish what they compute and fetch what others computed (:mod:`.shared`).

Layout under a namespace (default ``kvcomm``):

- ``{ns}:catalog``: a stream of catalog items (JSON: key, model fingerprint, token ids, prefix or
  segment), capped at ``max_catalog`` entries (approximately, oldest first);
- ``{ns}:blob:{key}``: the entry's safetensors blob, expiring after ``ttl_s`` seconds.

An expired or evicted blob is a miss (that replica computes the tokens). Size Redis with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` so that blobs, not the catalog, go first. KV of
the embedded SmolLM2-135M in fp32 is 46 KiB per token (a 400-token prompt with its reply is about
18 MiB); every finished request publishes its exact prefix and its reply segment.
"""

from __future__ import annotations

from typing import Optional

from .shared import CatalogItem

__all__ = ["RedisSegments"]


class RedisSegments:
    """:class:`~.shared.SharedSegments` on a Redis server (the ``redis`` client library).

    Args:
        url: the server, e.g. ``"redis://localhost:6379/0"``.
        namespace: key prefix (several models or fleets can share one server).
        ttl_s: seconds a blob lives (None: until Redis evicts it).
        max_catalog: catalog items kept (the stream is trimmed past this).
        client: an existing ``redis.Redis`` (instead of ``url``).
    """

    def __init__(self, url: str = "redis://localhost:6379/0", *, namespace: str = "kvcomm",
                 ttl_s: Optional[int] = 3600, max_catalog: int = 100_000, client=None):
        if client is None:
            try:
                import redis
            except ImportError as error:
                raise ImportError("RedisSegments needs the redis client: pip install 'kvcomm-agents[redis]'") from error
            client = redis.Redis.from_url(url)
        self.client, self.ttl_s, self.max_catalog = client, ttl_s, max_catalog
        self._catalog, self._blob = f"{namespace}:catalog", f"{namespace}:blob:"

    def publish(self, item: CatalogItem, blob: bytes) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self._blob + item.key, blob, ex=self.ttl_s)
        pipe.xadd(self._catalog, {"item": item.to_json()}, maxlen=self.max_catalog, approximate=True)
        pipe.execute()

    def catalog(self, cursor: Optional[str]) -> tuple[list[CatalogItem], Optional[str]]:
        """Items after stream id ``cursor`` (all for None) and the id of the last one."""
        start = "-" if cursor is None else f"({cursor}"
        rows = self.client.xrange(self._catalog, min=start, max="+")
        if not rows:
            return [], cursor
        items = [CatalogItem.from_json(fields[b"item"]) for _, fields in rows]
        last = rows[-1][0]
        return items, last.decode() if isinstance(last, bytes) else last

    def fetch(self, key: str) -> Optional[bytes]:
        return self.client.get(self._blob + key)
