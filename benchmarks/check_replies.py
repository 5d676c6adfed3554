"""``python -m benchmarks.check_replies``: regenerate the default profile's dense replies from
scratch, time it, and compare them with the ones shipped in ``benchmarks/replies/``.

What a fresh checkout would pay without the shipped replies, and the evidence that taking them
changes nothing (greedy fp32 replies on the same prompts are reproduced token for token).
Writes ``<out>/check_replies.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import run
from .models import load


def main(argv=None) -> dict:
    args = run.parse_args(["--no-seed-replies", *(argv or [])])
    args.dtype = args.dtype or "float32"
    device = args.device or "cpu"
    loaded = load(args.model, device=device, dtype=getattr(torch, args.dtype))
    scratch = Path(tempfile.mkdtemp(prefix="replies-"))
    ctx = run.Context(args, run.PROFILES[args.profile], loaded, scratch / loaded.tag / args.profile, device=device)
    where = f"{args.dtype}-{device}"
    report = {}
    for phase in ("a", "b", "c", "d"):
        workload, _ = run._workload(ctx, phase)
        started = time.perf_counter()
        replies = run._refs(ctx, workload)
        seconds = time.perf_counter() - started
        shipped_path = run.SEED_REPLIES / loaded.tag / where / f"{workload.name}.json"
        shipped = json.loads(shipped_path.read_text()) if shipped_path.is_file() else {}
        compared = [key for key in replies if key in shipped]
        report[phase] = {"workload": workload.name, "seconds": seconds, "requests": len(replies),
                         "shipped": len(compared), "identical": sum(replies[k] == shipped[k] for k in compared)}
        print(f"{phase}: {report[phase]}", flush=True)
    total = sum(r["seconds"] for r in report.values())
    print(f"all dense replies from scratch: {total / 60:.1f} min")
    out = args.out / loaded.tag / args.profile
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_replies.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
