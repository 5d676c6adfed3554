"""Text copies weighed against the prefill they spare (kvcomm_agents.framing.cost): pure
bookkeeping, no model."""

from __future__ import annotations

import pytest

from kvcomm_agents.framing.cost import MIN_PREFILL_IDS, CopyCost


def test_copies_pay_until_both_rates_are_measured_then_only_when_cheaper_per_id():
    cost = CopyCost(window=4, min_samples=2)
    assert cost.pays() and cost.rates() is None
    cost.record_copies(500, 2.0)
    cost.record_copies(500, 2.0)
    cost.record_prefill(1000, 3.0)
    assert cost.pays()  # one prefill measured: not yet judged
    cost.record_prefill(1000, 3.0)
    assert cost.rates() == pytest.approx((0.004, 0.003))
    assert not cost.pays()
    for _ in range(4):  # copies grown cheaper (recent ones only count)
        cost.record_copies(1000, 1.0)
    assert cost.rates()[0] == pytest.approx(0.001) and cost.pays()


def test_short_prefills_and_empty_measures_are_not_counted():
    cost = CopyCost(min_samples=1)
    cost.record_prefill(MIN_PREFILL_IDS - 1, 5.0)
    cost.record_prefill(1000, 0.0)
    cost.record_copies(0, 1.0)
    cost.record_copies(1000, 1.0)
    assert cost.rates() is None
    cost.record_prefill(MIN_PREFILL_IDS, 0.1)
    assert cost.rates() is not None
    cost.clear()
    assert cost.rates() is None and cost.pays()


@pytest.mark.parametrize("window,min_samples", [(0, 1), (4, 0), (2, 3)])
def test_bad_settings_are_refused(window, min_samples):
    with pytest.raises(ValueError):
        CopyCost(window=window, min_samples=min_samples)


def test_one_slowed_prefill_does_not_decide():
    """Rates are medians: a prefill slowed by something else on the machine is outvoted."""
    cost = CopyCost(window=8, min_samples=2)
    for seconds in (2.0, 2.1, 9.0):  # seconds per 1,000 ids; the last one slowed
        cost.record_prefill(1000, seconds)
    cost.record_copies(1000, 2.5)
    cost.record_copies(1000, 2.5)
    assert cost.rates() == pytest.approx((0.0025, 0.0021)) and not cost.pays()
