"""The rolling-hash token-run index: shared runs found wherever they sit, checked id by id."""

import random

import torch

from kvcomm_agents.kv.run_index import TokenRunIndex, longest_through, scan, window_hashes


def _runs(index, prompt, free=None, upper=None):
    free = torch.ones(prompt.numel(), dtype=torch.bool) if free is None else free
    return list(scan(prompt, free, index, lambda key: True, prompt.numel() if upper is None else upper))


def test_window_hashes_equal_for_equal_windows_only():
    ids = torch.tensor([5, 6, 7, 5, 6, 7, 8])
    hashes = window_hashes(ids, 3).tolist()
    assert len(hashes) == 5 and hashes[0] == hashes[3] and len(set(hashes)) == 4
    assert window_hashes(ids[:2], 3).numel() == 0


def test_every_run_of_min_run_tokens_is_found_at_any_offset():
    rng = random.Random(0)
    for min_run in (1, 4, 8, 13):
        index = TokenRunIndex(min_run)
        source = torch.tensor(rng.sample(range(1000, 2000), 200))  # distinct ids: one place each
        index.add("src", source)
        for start in range(0, 200 - min_run, 7):
            piece = source[start : start + min_run]
            prompt = torch.cat([torch.arange(30), piece, torch.arange(40, 50)])
            assert _runs(index, prompt) == [("src", 30, start, min_run)], (min_run, start)


def test_runs_are_maximal_ordered_and_respect_free_positions_and_upper():
    index = TokenRunIndex(8)
    source = torch.arange(100, 160)
    index.add("a", source)
    prompt = torch.cat([torch.arange(20), source[13:40], torch.arange(500, 510), source[0:9], torch.tensor([1, 2, 3])])
    assert _runs(index, prompt) == [("a", 20, 13, 27), ("a", 57, 0, 9)]
    free = torch.ones(prompt.numel(), dtype=torch.bool)
    free[30:35] = False  # a run may not cover these: split around them
    assert _runs(index, prompt, free) == [("a", 20, 13, 10), ("a", 35, 28, 12), ("a", 57, 0, 9)]
    assert _runs(index, prompt, upper=62) == [("a", 20, 13, 27)]  # the second would end past 62 - 8


def test_the_longest_source_wins_and_removed_entries_are_gone():
    index = TokenRunIndex(4)
    index.add("short", torch.tensor([1, 2, 3, 4, 9]))
    index.add("long", torch.tensor([1, 2, 3, 4, 5, 6]))
    prompt = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0])
    assert _runs(index, prompt) == [("long", 1, 0, 6)]
    index.remove("long")
    assert _runs(index, prompt) == [("short", 1, 0, 4)] and len(index) == 1
    assert list(scan(prompt, torch.ones(8, dtype=torch.bool), index, lambda key: False, 8)) == []


def test_the_longest_run_through_a_position_is_found_wherever_its_entry_was_indexed():
    index = TokenRunIndex(8)  # windows of 4 ids indexed every 5
    text = torch.arange(100, 140)
    index.add("text", text)  # indexed from the text's first id
    index.add("prompt", torch.cat([torch.arange(900, 903), text, torch.arange(200, 230)]))  # the text 3 ids in
    prompt = torch.cat([torch.arange(10), text, torch.arange(200, 230), torch.tensor([7])])
    assert _runs(index, prompt) == [("text", 10, 0, 40), ("prompt", 50, 43, 30)]  # first found at 10 wins
    free = torch.ones(prompt.numel(), dtype=torch.bool)
    anything = lambda start, length: True
    for position in (10, 11, 14, 30):
        assert longest_through(prompt, free, index, lambda key: True, prompt.numel(), position, anything) == \
            ("prompt", 10, 3, 70), position
    # only what the caller can use; only entries allowed
    assert longest_through(prompt, free, index, lambda key: True, prompt.numel(), 10,
                           lambda start, length: start + length <= 50) == ("text", 10, 0, 40)
    assert longest_through(prompt, free, index, lambda key: key == "text", prompt.numel(), 10, anything) == \
        ("text", 10, 0, 40)
    assert longest_through(prompt, free, index, lambda key: True, prompt.numel(), 5, anything) is None


def test_a_run_the_caller_does_not_want_hides_no_run_it_wants():
    index = TokenRunIndex(8)
    index.add("b", torch.cat([torch.arange(5000, 5007), torch.arange(1020, 1360)]))  # prompt 60..400
    index.add("a", torch.arange(1000, 1140))  # prompt 40..180, most recent
    prompt = torch.cat([torch.arange(40), torch.arange(1000, 1360), torch.tensor([7])])
    free = torch.ones(prompt.numel(), dtype=torch.bool)
    assert _runs(index, prompt)[0][:2] == ("a", 40)  # the scan: a from 40, b only after it
    assert longest_through(prompt, free, index, lambda key: True, prompt.numel(), 136,
                           lambda start, length: start + length >= 210) == ("b", 60, 7, 340)
