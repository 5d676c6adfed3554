"""The affinity rule shared by FleetEngine's router and the Ray Serve router
(kvcomm_vllm.affinity), without Ray or vLLM: the ranking, and a replica's report of what it
computed as the Ray router reads it."""

from __future__ import annotations

import pytest

from kvcomm_vllm.affinity import AffinityRule, ComputedLog, Holdings, reported_runs


def test_the_replica_holding_most_of_the_prompt_ranks_first_then_the_least_busy():
    rule = AffinityRule(min_share=0.25, max_imbalance=4)
    assert rule.rank([0, 30, 10], [0, 2, 0], prompt_tokens=40) == [1, 2, 0]  # then least busy, holding more
    assert rule.rank([0, 30, 10], [0, 4, 0], prompt_tokens=40)[0] in (0, 2)  # 4 busier: affinity yields
    assert rule.rank([0, 5, 0], [1, 0, 0], prompt_tokens=40, turn=1)[0] == 2  # 5 of 40: below the share
    with pytest.raises(ValueError):
        rule.rank([1, 2], [0], prompt_tokens=4)


def test_ties_go_round_in_turn():
    rule = AffinityRule()
    assert [rule.rank([0, 0, 0], [0, 0, 0], 20, turn)[0] for turn in range(4)] == [0, 1, 2, 0]


def test_holdings_find_runs_anywhere_and_forget_the_oldest():
    held = Holdings(min_run=4, remember=2)
    held.add("a", list(range(100, 160)))
    prompt = [1, 2] + list(range(120, 150)) + [9]
    assert held.covered(prompt) == 30
    held.add("b", [5] * 8)
    held.add("c", [6] * 8)
    assert held.covered(prompt) == 0 and held.keys() == ["b", "c"]
    with pytest.raises(ValueError):
        Holdings(remember=0)


def test_a_replicas_report_syncs_the_routers_holdings_and_keeps_what_the_router_recorded():
    log = ComputedLog(remember=2)
    first = log.add(list(range(100, 140)))
    log.add(list(range(200, 240)))
    held = Holdings(min_run=4)
    held.add("routed:1", list(range(300, 340)))  # recorded by the router when it routed a prompt
    prefix, runs = reported_runs(log.report())
    assert prefix == log.prefix and [key for key, _ in runs][0] == first
    held.sync(prefix, runs)
    assert held.covered(list(range(100, 140)) + [1]) == 40
    log.add(list(range(400, 440)))  # the replica forgets its oldest
    held.sync(*reported_runs(log.report()))
    assert held.covered(list(range(100, 140)) + [1]) == 0
    assert held.covered(list(range(400, 440)) + [1]) == 40
    assert held.covered(list(range(300, 340)) + [1]) == 40  # the router's own record stays
    assert reported_runs({}) == (None, []) and reported_runs(None) == (None, [])


def test_the_log_is_bounded_by_tokens_and_its_keys_never_repeat_across_replicas():
    log = ComputedLog(max_tokens=100)
    for start in range(0, 500, 50):
        log.add(list(range(start, start + 50)))
    _, runs = reported_runs(log.report())
    assert len(runs) == 2
    assert ComputedLog().prefix != log.prefix
    assert log.add([]) is None
