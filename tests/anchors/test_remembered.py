"""Re-rotation measurements remembered from one engine to the next (kvcomm_agents.anchors.remembered)."""

from __future__ import annotations

import json
import os

import pytest

from kvcomm_agents import KVCommConfig
from kvcomm_agents.anchors.remembered import FORMAT, MAX_FILES, RememberedMeasurements, remembered
from kvcomm_agents.anchors.tracker import OffsetTracker

SETTINGS = KVCommConfig(remember_measurements=False).model_dump(mode="json")


def _memory(folder, tracker=None, fingerprint="f" * 16, settings=SETTINGS) -> RememberedMeasurements:
    return RememberedMeasurements(folder, fingerprint, settings, tracker or OffsetTracker())


def test_remembered_samples_join_the_pool_but_are_no_receivers_own():
    tracker = OffsetTracker(min_samples=2, window=3)
    tracker.remember([0.01, 0.02, 0.03, 0.04])  # the last window kept
    assert tracker.pooled_rerotation_samples() == [0.02, 0.03, 0.04]
    assert tracker.rerotation_within_budget("new-reader", 0.05)  # trusted before any sample of this engine
    assert tracker.rerotation_samples("new-reader") == [] and tracker.wants_rerotation_sample("new-reader")
    assert not tracker.rerotation_within_budget("new-reader", 0.02)  # their mean (0.03) is over it
    tracker.record_rerotated("new-reader", 0.5)
    assert not tracker.rerotation_within_budget("new-reader", 0.1)  # its own sample over the budget decides
    assert tracker.pooled_rerotation_samples()[-1] == 0.5 and tracker.rerotation_recorded == 1
    tracker.clear()  # weights changed: nothing measured on the old ones is kept
    assert tracker.pooled_rerotation_samples() == [] and not tracker.rerotation_within_budget("new-reader", 1.0)


def test_an_engine_writes_what_it_measured_and_the_next_one_reads_it(tmp_path):
    first = OffsetTracker()
    memory = _memory(tmp_path, first)
    assert memory.load() == 0 and not memory.sync()  # no file, nothing new: nothing written
    first.record_rerotated("reader", 0.004)
    assert memory.sync() and not memory.sync()  # written once per new sample
    data = json.loads(memory.path.read_text())
    assert data["format"] == FORMAT and data["rerotated"] == [0.004] and data["fingerprint"] == "f" * 16
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # written atomically
    second = OffsetTracker()
    assert _memory(tmp_path, second).load() == 1
    assert second.pooled_rerotation_samples() == [0.004] and second.rerotation_within_budget("anyone", 0.015)


def test_a_file_of_another_model_or_other_measuring_settings_is_not_read(tmp_path):
    first = OffsetTracker()
    memory = _memory(tmp_path, first)
    first.record_rerotated("reader", 0.004)
    memory.sync()
    assert _memory(tmp_path, fingerprint="0" * 16).load() == 0  # another model: another file
    other = KVCommConfig(remember_measurements=False, recompute_head=0).model_dump(mode="json")
    stranger = _memory(tmp_path, settings=other)
    assert stranger.path != memory.path and stranger.load() == 0  # measured otherwise: its own file
    memory.path.write_text(json.dumps({**json.loads(memory.path.read_text()), "settings": {
        k: other[k] for k in ("recompute_head", "recompute_tail", "recompute_short_runs", "experimental")}}))
    assert _memory(tmp_path).load() == 0  # a file whose header names other settings


@pytest.mark.parametrize("text", ["{not json", "[" * 200_000, json.dumps({"format": FORMAT, "fingerprint": "f" * 16}),
                                  json.dumps([1, 2])])
def test_a_broken_file_costs_the_samples_never_an_error(tmp_path, text):
    memory = _memory(tmp_path)
    memory.path.write_text(text)
    if text.startswith("{\"format\""):  # the right header, no samples
        memory.path.write_text(json.dumps({"format": FORMAT, "fingerprint": "f" * 16, "settings": memory.settings,
                                           "rerotated": [-1.0]}))
    assert memory.load() == 0 and memory.tracker.pooled_rerotation_samples() == []


def test_a_folder_keeps_the_newest_files_as_weights_change(tmp_path):
    """Weights that change as a process runs (online fine-tuning) each get a file: the folder
    keeps the MAX_FILES most recently written, and leaves other files there alone."""
    (tmp_path / "layout-0123456789ab.json").write_text("{}")
    (tmp_path / "notes.json").write_text("{}")
    paths = []
    for version in range(MAX_FILES + 5):
        tracker = OffsetTracker()
        memory = _memory(tmp_path, tracker, fingerprint=f"{version:016x}")
        tracker.record_rerotated("reader", 0.004)
        assert memory.sync()
        os.utime(memory.path, (version, version))  # written in this order, whatever the clock's grain
        paths.append(memory.path)
    kept = {p for p in tmp_path.iterdir()}
    assert kept == set(paths[-MAX_FILES:]) | {tmp_path / "layout-0123456789ab.json", tmp_path / "notes.json"}


def test_a_folder_that_cannot_be_written_costs_the_memory_never_an_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    tracker = OffsetTracker()
    memory = _memory(blocked / "measurements", tracker)  # a folder under a file: cannot be made
    tracker.record_rerotated("reader", 0.004)
    assert not memory.sync() and not memory.sync()


def test_the_setting_picks_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMM_CACHE_DIR", str(tmp_path / "cache"))

    def folder(**settings):
        memory = remembered(KVCommConfig(**settings), "f" * 16, OffsetTracker())
        return None if memory is None else memory.folder

    assert folder(remember_measurements=False) is None
    assert folder(remember_measurements=True) == tmp_path / "cache" / "measurements"
    assert folder(remember_measurements=str(tmp_path / "here")) == tmp_path / "here"
    for nothing_trusts_samples in ({"method": "rerotate"}, {"kl_budget": None}, {"audit_every": 0},
                                   {"measured_rerotation": False}):
        assert folder(remember_measurements=True, **nothing_trusts_samples) is None
    monkeypatch.setenv("KVCOMM_REMEMBER_MEASUREMENTS", "0")
    assert KVCommConfig().remember_measurements is False
    monkeypatch.setenv("KVCOMM_REMEMBER_MEASUREMENTS", "1")
    assert KVCommConfig().remember_measurements is True


def test_the_setting_reads_paths_and_switches_and_refuses_an_empty_folder(tmp_path):
    from pydantic import ValidationError

    assert KVCommConfig(remember_measurements=tmp_path).remember_measurements == str(tmp_path)
    assert KVCommConfig(remember_measurements="false").remember_measurements is False
    assert KVCommConfig(remember_measurements="1").remember_measurements is True
    with pytest.raises(ValidationError, match="empty"):
        KVCommConfig(remember_measurements=" ")


def test_new_samples_replace_remembered_ones_and_an_anchor_files_measurements_replace_them_all(tmp_path):
    tracker = OffsetTracker(min_samples=2, window=8)
    tracker.remember([0.5, 0.5])  # an earlier engine measured re-rotation over the budget
    assert tracker.rerotation_unconfirmed()  # remembered samples confirm nothing of this engine's
    tracker.record_rerotated("a", 0.001)
    tracker.record_rerotated("b", 0.001)
    assert tracker.pooled_rerotation_samples() == [0.001, 0.001]  # this engine's measures supersede
    assert tracker.rerotation_within_budget("c", 0.015) and not tracker.rerotation_unconfirmed()
    tracker.remember([0.002])
    tracker.restore(OffsetTracker.parse_measurements({"rerotated": {"a": [0.003]}}))
    assert tracker.pooled_rerotation_samples() == [0.003]  # never counted twice


def test_non_finite_samples_are_not_written_and_nothing_is_written_while_frozen(tmp_path):
    tracker = OffsetTracker()
    memory = _memory(tmp_path, tracker)
    tracker.record_rerotated("reader", float("nan"))
    tracker.record_rerotated("reader", 0.004)
    assert not memory.sync(frozen=True) and not memory.path.exists()
    assert memory.sync()
    assert json.loads(memory.path.read_text())["rerotated"] == [0.004]


def test_a_cache_dir_given_to_from_pretrained_holds_the_measurements_too(tmp_path):
    from kvcomm_agents.anchors.remembered import under_cache_dir

    remembering = KVCommConfig(remember_measurements=True)
    assert under_cache_dir(remembering, tmp_path).remember_measurements == str(tmp_path / "measurements")
    assert under_cache_dir(None, tmp_path).remember_measurements is False  # the suite's default: off
    assert under_cache_dir(KVCommConfig(remember_measurements=True), None).remember_measurements is True
    assert under_cache_dir(KVCommConfig(remember_measurements=False), tmp_path).remember_measurements is False
    elsewhere = str(tmp_path / "elsewhere")
    assert under_cache_dir(KVCommConfig(remember_measurements=elsewhere), tmp_path).remember_measurements == elsewhere
