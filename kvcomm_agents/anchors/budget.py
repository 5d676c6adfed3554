"""The anchor pools' byte budget: which anchors go when the pools hold more than it.

The pool holding the most bytes among those that can spare an anchor gives up its oldest ones
(the least-activated of its ``eviction_window`` oldest, :meth:`~.pool.AnchorPool.evict_one`),
never its newest nor a segment just recorded, as many as bring all pools to :data:`HEADROOM` of
the budget at its mean bytes per anchor (an evicted anchor's tensors go at once), then drops the
emptied slots. Where no pool can spare one, the largest
pool goes whole, the kinds just recorded into last. Before (measured in benchmarks/LAB.md,
"Shared text framed for its later readers"): the least recently recorded pool gave anchors up,
which emptied small pools of replies while one pool of long documents held the budget.
"""

from __future__ import annotations

import math
from typing import Collection, MutableMapping, Optional

from ..kv.segments import Kind
from .pool import AnchorPool

__all__ = ["fit_budget", "HEADROOM"]

#: Share of the budget the pools are brought down to when they exceed it, so that a few more
#: records fit before the next eviction (a named heuristic).
HEADROOM = 0.9


def _total(pools: MutableMapping[Kind, AnchorPool]) -> int:
    return sum(pool.nbytes for pool in pools.values())


def fit_budget(pools: MutableMapping[Kind, AnchorPool], max_bytes: int,
               protect: Collection[tuple[Kind, str]] = ()) -> Optional[tuple[Kind, int]]:
    """Evict from ``pools`` (in place) until they hold at most ``max_bytes``; ``protect``:
    ``(kind, segment id)`` pairs just recorded. Returns ``(kind, bytes)`` of a pool deleted
    though it was protected (one anchor alone over the budget), else None."""
    forced = None
    stuck: set = set()  # pools that freed nothing this time
    guarded = {kind for kind, _ in protect}
    while pools and _total(pools) > max_bytes:
        shared = [(k, p) for k, p in pools.items() if len(p) > 1 and k not in stuck]
        if not shared:
            spare = [(k, p) for k, p in pools.items() if k not in guarded]
            kind, pool = max(spare or list(pools.items()), key=lambda item: item[1].nbytes)
            if not spare and forced is None:
                forced = (kind, pool.nbytes)
            del pools[kind]
            continue
        kind, pool = max(shared, key=lambda item: item[1].nbytes)
        before = pool.nbytes
        per_anchor = before / max(1, len(pool))
        wanted = math.ceil((_total(pools) - HEADROOM * max_bytes) / max(1.0, per_anchor))
        keep = {segment_id for k, segment_id in protect if k == kind}
        for _ in range(max(1, min(wanted, len(pool) - 1))):
            if pool.evict_one(keep_newest=True, protect=keep) is None:
                break
        pool.compact()
        if pool.nbytes >= before:
            stuck.add(kind)
    return forced
