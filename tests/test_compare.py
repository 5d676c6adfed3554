"""``python -m benchmarks.compare``: two runs equal but for timings compare equal; any other
field that differs is reported."""

import json

from benchmarks.compare import compare


def _run(folder, records):
    folder.mkdir()
    (folder / "phase_b.json").write_text(json.dumps({"records": records, "answers": []}))
    return folder


def test_timings_are_left_out_and_a_changed_decision_is_reported(tmp_path, capsys):
    record = {"phase": "b", "workload": "w", "request": 0, "agent_index": 1, "agent": "s1", "strategy": "kvcomm-mean",
              "warmup": False, "reused_tokens": 40, "gate": [{"decision": "reuse"}], "kl": 0.001, "ttft_s": 0.2}
    old = _run(tmp_path / "old", [record])
    assert compare(old, _run(tmp_path / "slower", [{**record, "ttft_s": 0.9, "wall_s": 3.0}])) == 0
    changed = _run(tmp_path / "new", [{**record, "gate": [{"decision": "new_anchor"}]}])
    assert compare(old, changed) == 1
    assert "gate" in capsys.readouterr().out
    assert compare(old, _run(tmp_path / "fewer", [])) == 1  # a record missing counts too
