"""A short soak (the long one is ``python -m benchmarks.soak``): a debate pipeline on a tiny model
keeps its store, anchor pools and own-text KV within their budgets while evicting."""

import pytest

from benchmarks.soak import soak

pytestmark = pytest.mark.model


def test_a_pipeline_stays_within_its_budgets_while_evicting():
    rows = soak(60, store_mib=1, anchor_mib=1, every=20, reply_tokens=8, progress=lambda line: None)
    assert [r["calls"] for r in rows] == [20, 40, 60]
    assert rows[-1]["evictions"] > 0  # the budget was reached and entries went, not the run
    assert all(r["store_mib"] <= 1 and r["anchor_mib"] <= 1 for r in rows)
