"""``python -m benchmarks.compare OLD_DIR NEW_DIR``: two runs' per-call records compared field by
field, timings left out: a refactor that claims "behaviour unchanged" shows every decision,
reuse count, forwarded token and fidelity figure equal to the digit.

Records are matched by phase file, workload, request, agent, strategy and warm-up flag; what
differs is printed (at most ``--show`` rows) and the exit status is 1 when anything does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: record fields that depend on the clock or the machine's memory, not on what was computed
TIMED = ("ttft_s", "dense_ttft_s", "before_prefill_s", "plan_s", "align_s", "hook_s", "prefill_s", "total_s",
         "framed_s", "wall_s", "call_s", "peak_extra_bytes", "untimed_s", "tpot_s", "decode_s")
KEY = ("phase", "workload", "request", "agent_index", "agent", "strategy", "warmup")


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMED and not k.endswith("_s")}


def _records(path: Path) -> dict[tuple, dict]:
    data = json.loads(path.read_text())
    keyed = {}
    for record in data.get("records", []):
        key = tuple(record.get(k) for k in KEY)
        while key in keyed:  # the same call twice (a repeated request): keep both, in order
            key = key + ("again",)
        keyed[key] = _untimed(record)
    return keyed


def compare(old: Path, new: Path, show: int = 20) -> int:
    """Print the differences between the phase files of two runs; returns how many differ."""
    differ = 0
    for old_file in sorted(old.glob("phase_*.json")):
        new_file = new / old_file.name
        if not new_file.exists():
            print(f"{old_file.name}: missing in {new}")
            differ += 1
            continue
        a, b = _records(old_file), _records(new_file)
        answers = (json.loads(old_file.read_text()).get("answers"), json.loads(new_file.read_text()).get("answers"))
        rows = [f"  only in old: {key}" for key in a.keys() - b.keys()] + [f"  only in new: {key}" for key in b.keys() - a.keys()]
        for key in sorted(a.keys() & b.keys(), key=str):
            fields = sorted(f for f in a[key].keys() | b[key].keys() if a[key].get(f) != b[key].get(f))
            if fields:
                rows.append(f"  {key}: " + "; ".join(f"{f} {a[key].get(f)!r} -> {b[key].get(f)!r}" for f in fields))
        if answers[0] != answers[1]:
            rows.append("  answers differ")
        print(f"{old_file.name}: {len(a)} records, {len(rows)} differ")
        for row in rows[:show]:
            print(row[:400])
        differ += len(rows)
    return differ


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--show", type=int, default=20, help="differences printed per phase")
    args = parser.parse_args(argv)
    return 1 if compare(args.old, args.new, args.show) else 0


if __name__ == "__main__":
    sys.exit(main())
