"""Copies weighed against the prefill they spare (kvcomm_agents.framing.cost): pure bookkeeping,
no model."""

from __future__ import annotations

from collections import deque

import pytest

from kvcomm_agents.framing.cost import CLEAR_FACTOR, MIN_PREFILL_IDS, CopyCost


def test_copies_pay_until_both_rates_are_measured_then_only_when_cheaper_per_id():
    cost = CopyCost(window=4, min_samples=2)
    assert cost.pays("text") and cost.rates("text") is None
    cost.record_copies("text", 500, 2.0)
    cost.record_copies("text", 500, 2.0)
    cost.record_prefill(1000, 3.0)
    assert cost.pays("text")  # one prefill measured: not yet judged
    cost.record_prefill(1000, 3.0)
    assert cost.rates("text") == pytest.approx((0.004, 0.003))
    assert not cost.pays("text")
    assert cost.pays("reply") and cost.rates("reply") is None  # each kind judged on its own copies
    for _ in range(4):  # copies grown cheaper (recent ones only count)
        cost.record_copies("text", 1000, 1.0)
    assert cost.rates("text")[0] == pytest.approx(0.001) and cost.pays("text")


def test_short_prefills_and_empty_measures_are_not_counted():
    cost = CopyCost(min_samples=1)
    cost.record_prefill(MIN_PREFILL_IDS - 1, 5.0)
    cost.record_prefill(1000, 0.0)
    cost.record_copies("text", 0, 1.0)
    cost.record_copies("text", 1000, 1.0)
    assert cost.rates("text") is None
    cost.record_prefill(MIN_PREFILL_IDS, 0.1)
    assert cost.rates("text") is not None
    cost.clear()
    assert cost.rates("text") is None and cost.pays("text")


@pytest.mark.parametrize("window,min_samples", [(0, 1), (4, 0), (2, 3)])
def test_bad_settings_are_refused(window, min_samples):
    with pytest.raises(ValueError):
        CopyCost(window=window, min_samples=min_samples)


def test_one_slowed_prefill_does_not_decide():
    """Rates are medians: a prefill slowed by something else on the machine is outvoted."""
    cost = CopyCost(window=8, min_samples=2)
    for seconds in (2.0, 2.1, 9.0):  # seconds per 1,000 ids; the last one slowed
        cost.record_prefill(1000, seconds)
    cost.record_copies("text", 1000, 2.5)
    cost.record_copies("text", 1000, 2.5)
    assert cost.rates("text") == pytest.approx((0.0025, 0.0021)) and not cost.pays("text")


def test_reply_copies_riding_on_decode_steps_cost_what_the_steps_took_beyond_plain_ones():
    """Plain steps of 40 ms are the baseline: 100 framed steps taking 4.8 s (8 ms each beyond
    plain) for 200 copy ids, plus 0.4 s after the reply, cost 6 ms per copy id; against a
    prefill of 2 ms per id they do not pay. Framed steps no slower than plain ones cost only
    what came after the reply."""
    cost = CopyCost(window=4, min_samples=2)
    cost.record_riding({"reply": 200}, 100, 4.8, 0.4)  # no plain step seen yet: weighed later
    assert cost.rates("reply") is None and not cost._copies["reply"]
    cost.record_step(0.040)
    assert not cost._copies["reply"]  # one plain step: no baseline yet
    for seconds in (0.040, 0.041, 0.039, 0.040):
        cost.record_step(seconds)
    assert cost._copies["reply"] == deque([(200, pytest.approx(1.2))])  # weighed once the baseline came
    cost.record_prefill(1000, 2.0)
    cost.record_prefill(1000, 2.0)
    cost.record_riding({"reply": 200}, 100, 4.8, 0.4)
    assert cost.rates("reply") == pytest.approx((0.006, 0.002)) and not cost.pays("reply")
    assert cost.pays("text")  # the other kind is not judged by these
    cheap = CopyCost(min_samples=1)
    cheap.record_step(0.040)
    cheap.record_prefill(1000, 2.0)
    cheap.record_riding({"reply": 200}, 100, 3.9, 0.2)  # steps faster than plain: counted as free
    assert cheap.rates("reply") == pytest.approx((0.001, 0.002)) and cheap.pays("reply")
    cheap.record_riding({"reply": 0, "text": 0}, 100, 9.0)  # no copy ids: nothing recorded
    assert len(cheap._copies["reply"]) == 1 and not cheap._copies["text"]


@pytest.mark.parametrize("dearer", [1.5, CLEAR_FACTOR * 1.5])
def test_one_measurement_decides_only_where_copies_are_clearly_dearer(dearer):
    """A graph gives about one measurement of reply copies: one that costs more than
    CLEAR_FACTOR times the prefill per id stops them; a closer one waits for a second."""
    cost = CopyCost(window=4, min_samples=2)
    cost.record_prefill(1000, 2.0)  # 2 ms per id
    cost.record_copies("reply", 100, 0.002 * dearer * 100)
    assert cost.pays("reply") == (dearer <= CLEAR_FACTOR)
    cost.record_prefill(1000, 2.0)
    cost.record_copies("reply", 100, 0.002 * dearer * 100)
    assert not cost.pays("reply")  # two each: the medians decide, dearer is dearer


def test_copies_riding_together_are_measured_together():
    """Text copies riding on CUDA decode steps beside reply copies: the steps' cost beyond plain
    ones is spread over every copy id and counts against both kinds."""
    cost = CopyCost(window=4, min_samples=1)
    cost.record_step(0.040)
    cost.record_prefill(1000, 1.0)  # 1 ms per id
    cost.record_riding({"reply": 100, "text": 300}, 50, 2.0 + 1.2)  # 1.2 s beyond plain, 400 ids
    assert cost.rates("reply") == pytest.approx((0.003, 0.001)) == cost.rates("text")
    assert not cost.pays("reply") and not cost.pays("text")
