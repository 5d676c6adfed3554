"""Warm start: anchor pools saved to safetensors and loaded back; foreign and corrupted files
refused without touching the engine; calibration records every shared segment."""

import copy
import json
import struct

import pytest
import torch

from kvcomm_agents import AnchorFileError, KVCommConfig, KVCommEngine
from kvcomm_agents.anchors.persist import measured_alike
from kvcomm_agents.anchors.tracker import OffsetTracker

from ..conftest import REPLY, replayed, solver_messages

pytestmark = pytest.mark.model

KIND = ("s1", "assistant")
CONFIG = KVCommConfig(experimental={"min_anchors": 1})


def _learned(model, tokenizer) -> KVCommEngine:
    """An engine whose pools hold the question and solver 1's reply, with offsets for s2 and s3."""
    engine = KVCommEngine(model, tokenizer, config=CONFIG)
    for system in ("You are solver one.", "You are the first solver."):
        replayed(engine, solver_messages(system), "s1")
        replayed(engine, solver_messages("You are solver two.", REPLY), "s2")
        replayed(engine, solver_messages("You are solver three.", REPLY), "s3")
    assert engine.anchors.anchors(KIND) >= 1
    return engine


def _state(engine: KVCommEngine) -> dict:
    out = {}
    for kind, pool in engine.anchors._pools.items():
        out[kind] = (pool.segment_ids, pool.created, pool.lengths.tolist(), pool.activations.tolist(),
                     [b for base in pool.bases if base is not None for b in base],
                     {r: (sorted(s.parts), [t for slot in sorted(s.parts) for t in s.parts[slot]], s.has.tolist())
                      for r, s in pool.placeholder.items()})
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for kind in a:
        for x, y in zip(a[kind], b[kind]):
            if isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
                assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))
            elif isinstance(x, dict):
                assert x.keys() == y.keys()
                for r in x:
                    assert x[r][0] == y[r][0] and x[r][2] == y[r][2]
                    assert len(x[r][1]) == len(y[r][1]) and all(torch.equal(p, q) for p, q in zip(x[r][1], y[r][1]))
            else:
                assert x == y


def test_saved_anchors_load_back_exactly_and_serve(llama, tokenizer, tmp_path):
    source = _learned(llama, tokenizer)
    path = tmp_path / "anchors.safetensors"
    written = source.save_anchors(path)
    assert written == sum(len(p) for p in source.anchors._pools.values())
    header_length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_length])  # safetensors: JSON header, raw tensors
    meta = json.loads(header["__metadata__"]["kvcomm"])
    assert meta["fingerprint"] == source.fingerprint and meta["library"] and meta["settings"]["method"] == "kvcomm"
    fresh = KVCommEngine(llama, tokenizer, config=CONFIG)
    assert fresh.load_anchors(path) == written
    _assert_same(_state(source), _state(fresh))
    contexts = {k: {r: st.contexts for r, st in p.placeholder.items()} for k, p in source.anchors._pools.items()}
    assert any(c for per in contexts.values() for c in per.values())  # the recorded versions' contexts
    assert contexts == {k: {r: st.contexts for r, st in p.placeholder.items()} for k, p in fresh.anchors._pools.items()}
    # the warm engine's gate consults the loaded anchors at once; a cold one has none
    cold = KVCommEngine(llama, tokenizer, config=CONFIG)
    for engine in (fresh, cold):
        replayed(engine, solver_messages("You are solver 1."), "s1")
    warm_call = replayed(fresh, solver_messages("You are solver two.", REPLY), "s2")
    cold_call = replayed(cold, solver_messages("You are solver two.", REPLY), "s2")
    assert warm_call.stats.anchors_consulted >= 1 and cold_call.stats.anchors_consulted == 0


def test_a_foreign_or_corrupted_file_is_refused_and_the_engine_serves_on(llama, tokenizer, tmp_path):
    source = _learned(llama, tokenizer)
    path = tmp_path / "anchors.safetensors"
    source.save_anchors(path)
    tuned = copy.deepcopy(llama)
    with torch.no_grad():
        tuned.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-2
    other = _learned(tuned, tokenizer)
    before = _state(other)
    with pytest.raises(AnchorFileError, match="another model"):
        other.load_anchors(path)
    corrupted = tmp_path / "corrupted.safetensors"
    data = bytearray(path.read_bytes())
    corrupted.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(AnchorFileError, match="not a readable anchor file"):
        other.load_anchors(corrupted)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AnchorFileError):
        other.load_anchors(tmp_path / "junk.safetensors")
    with pytest.raises(AnchorFileError, match="no such"):
        other.load_anchors(tmp_path / "missing.safetensors")
    _assert_same(before, _state(other))
    assert replayed(other, solver_messages("You are solver two.", REPLY), "s2").stats.reused_tokens > 0


def test_calibrating_records_every_shared_segment_then_reuse_resumes(llama, tokenizer):
    # kl_budget=None: calibration records anchors; under the default budget their estimates
    # (in a context other than the one recorded) still wait for audits (tests/anchors/test_tracker.py)
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(kl_budget=None, recompute_short_runs=0, recompute_last_run=0,
                                                                   experimental={"min_anchors": 1}))
    with engine.calibrating():
        replayed(engine, solver_messages("You are solver one."), "s1")
        calibrated = replayed(engine, solver_messages("You are solver two.", REPLY), "s2")
    reasons = {d.reason for d in calibrated.stats.decisions}
    assert reasons == {"calibration"} and calibrated.stats.mode != "reuse"
    assert engine.anchors.anchors(("user", None)) == 1 and engine.anchors.anchors(KIND) == 1
    results = engine.calibrate([(solver_messages("You are the first solver."), "s1")], max_new_tokens=4)
    assert len(results) == 1
    after = replayed(engine, solver_messages("You are the second solver.", REPLY), "s2")
    assert after.stats.mode == "reuse"


def _rewritten(path, tmp_path, change) -> object:
    """A copy of an anchor file whose JSON header went through ``change(meta)``."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["kvcomm"])
    change(meta)
    out = tmp_path / "rewritten.safetensors"
    save_file(load_file(str(path)), str(out), metadata={"kvcomm": json.dumps(meta)})
    return out


def test_a_file_from_before_recorded_versions_loads_and_a_malformed_context_is_refused(llama, tokenizer, tmp_path):
    source = _learned(llama, tokenizer)
    path = tmp_path / "anchors.safetensors"
    written = source.save_anchors(path)

    def drop(meta):
        for pool in meta["pools"]:
            pool.pop("contexts")

    fresh = KVCommEngine(llama, tokenizer, config=CONFIG)
    assert fresh.load_anchors(_rewritten(path, tmp_path, drop)) == written  # no versions, anchors intact
    assert all(not st.contexts for p in fresh.anchors._pools.values() for st in p.placeholder.values())

    def malform(meta):
        for pool in meta["pools"]:
            pool["contexts"] = ["not a mapping" for _ in pool["contexts"]]

    with pytest.raises(AnchorFileError, match="corrupted"):
        fresh.load_anchors(_rewritten(path, tmp_path, malform))


def test_an_old_format_file_and_offsets_of_an_empty_slot_are_refused(llama, tokenizer, tmp_path):
    """A kvcomm-anchors/1 file (dense stacks) is refused with a message saying to write it again;
    a file whose offsets sit in an empty slot is refused as corrupted (never a later TypeError)."""
    source = _learned(llama, tokenizer)
    path = tmp_path / "anchors.safetensors"
    source.save_anchors(path)
    fresh = KVCommEngine(llama, tokenizer, config=CONFIG)

    def old_format(meta):
        meta["format"] = "kvcomm-anchors/1"

    with pytest.raises(AnchorFileError, match="write it again"):
        fresh.load_anchors(_rewritten(path, tmp_path, old_format))

    def emptied(meta):
        for pool in meta["pools"]:
            pool["segment_ids"] = [None for _ in pool["segment_ids"]]

    with pytest.raises(AnchorFileError, match="corrupted"):
        fresh.load_anchors(_rewritten(path, tmp_path, emptied))
    assert not fresh.anchors._pools  # nothing changed


def test_what_was_measured_travels_with_the_anchors(llama, tokenizer, tmp_path):
    """The tracker's samples (audits' paired KL, re-rotation checks) are saved with the anchors
    and loaded with them: a warm engine serves a reader new to the graph re-rotated from its
    first call where re-rotation was measured within the KL budget. An engine whose head
    recompute differs takes none of them (they measured another serving), and a file whose
    measurements are malformed is refused without any change."""
    source = _learned(llama, tokenizer)
    for kl in (0.001, 0.002):
        source.anchors.tracker.record_rerotated("s2", kl)
    source.anchors.tracker.record("s3", KIND, 0.01, 0.02)
    path = tmp_path / "anchors.safetensors"
    source.save_anchors(path)
    warm = KVCommEngine(llama, tokenizer, config=CONFIG)
    warm.load_anchors(path)
    measured = source.anchors.tracker.measurements()
    assert measured["rerotated"]["s2"][-2:] == [0.001, 0.002] and warm.anchors.tracker.measurements() == measured
    other = KVCommEngine(llama, tokenizer, config=CONFIG.model_copy(update={"recompute_head": 4}))
    other.load_anchors(path)
    assert other.anchors.tracker.measurements() == {"paired": [], "rerotated": {}}

    def offsets(engine) -> set:
        replayed(engine, solver_messages("You are solver 1."), "s1")
        call = replayed(engine, solver_messages("You are solver four.", REPLY), "s4")
        return {d.gate.offsets for d in call.stats.shared_decisions if d.gate is not None}

    assert "rerotated" in offsets(warm)
    assert "rerotated" not in offsets(other)

    def malform(meta):
        meta["measurements"]["rerotated"]["s2"] = [-1.0]

    before = _state(other)
    with pytest.raises(AnchorFileError, match="malformed measurements"):
        other.load_anchors(_rewritten(path, tmp_path, malform))
    _assert_same(before, _state(other))


def test_measurements_keep_a_kind_without_detail_and_drop_what_cannot_be_saved():
    """A kind whose detail is None comes back as None (not "None", which no live kind matches);
    a NaN sample (NaN logits) is left out of the file instead of making it unloadable; an empty
    list of samples or a kind of another length is malformed; a header without settings as a
    mapping measured unlike any engine."""
    tracker = OffsetTracker()
    tracker.record("s2", ("user", None), 0.01, 0.02)
    tracker.record("s2", ("s1", "assistant"), float("nan"), 0.02)
    tracker.record_rerotated("s3", float("nan"))
    tracker.record_rerotated("s3", 0.001)
    saved = tracker.measurements()
    assert [entry[1] for entry in saved["paired"]] == [["user", None]] and saved["rerotated"] == {"s3": [0.001]}
    parsed = OffsetTracker.parse_measurements(json.loads(json.dumps(saved)))
    assert list(parsed.paired) == [("s2", ("user", None))]
    for bad in ({"paired": [["s2", ["user", None], []]]}, {"rerotated": {"s3": []}},
                {"paired": [["s2", ["user"], [[0.1, 0.2]]]]}, {"paired": [["s2", "us", [[0.1, 0.2]]]]}):
        with pytest.raises((ValueError, TypeError)):
            OffsetTracker.parse_measurements(bad)
    assert not measured_alike({"settings": "recompute_head=16"}, {"recompute_head": 16, "experimental": {}})
    assert not measured_alike({}, {"recompute_head": 16, "experimental": {}})


def test_a_file_saved_before_the_tail_setting_counts_as_measured_without_one():
    settings = {"recompute_head": 16, "recompute_cut_head": 0, "recompute_tail": 0, "recompute_short_runs": 64,
                "recompute_last_run": 0, "experimental": {}}
    old = {"settings": {"recompute_head": 16, "recompute_short_runs": 64, "experimental": {}}}
    assert measured_alike(old, settings)
    assert not measured_alike(old, {**settings, "recompute_tail": 16})
    assert not measured_alike(old, {**settings, "recompute_last_run": 256})
    assert not measured_alike(old, {**settings, "recompute_cut_head": 64})
    assert measured_alike({"settings": {**old["settings"], "recompute_tail": 16}}, {**settings, "recompute_tail": 16})


def test_saving_anchors_to_a_folder_says_so_and_leaves_nothing_behind(llama, tokenizer, tmp_path):
    source = _learned(llama, tokenizer)
    with pytest.raises(IsADirectoryError, match="is a folder; save anchors to a file in it"):
        source.save_anchors(tmp_path)
    assert list(tmp_path.parent.glob(f"{tmp_path.name}*")) == [tmp_path] and not any(tmp_path.iterdir())
