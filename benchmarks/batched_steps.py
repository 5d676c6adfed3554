"""What one decode forward costs for B calls at once: the ground for batching siblings' steps
(:mod:`kvcomm_agents.batched_decode`).

For each cached length and batch size, B rows of random ids are prefilled, then decode steps of
one token per row are timed (the median of ``--steps``); per row is that divided by B. Prints a
table and writes JSON.

    python -m benchmarks.batched_steps [--model embedded] [--lengths 300,800,1600] [--rows 1,2,4]
                                       [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvcomm_agents.engines import hf

from .models import load

__all__ = ["measure", "table"]


def measure(model, lengths: list[int], rows: list[int], steps: int, vocab: int, seed: int = 0) -> list[dict]:
    """One record per (cached length, rows): the median seconds of a decode forward."""
    generator = torch.Generator().manual_seed(seed)
    device = hf.input_device(model)
    out = []
    for length in lengths:
        for b in rows:
            ids = torch.randint(100, vocab, (b, length), generator=generator).to(device)
            with torch.inference_mode():
                cache = hf.new_cache(model)
                hf.run_forward(model, ids, cache)
                times = []
                for i in range(steps):
                    token = torch.randint(100, vocab, (b, 1), generator=generator).to(device)
                    started = time.perf_counter()
                    hf.run_forward(model, token, cache, position_ids=torch.full((b, 1), length + i, device=device))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
            step = statistics.median(times)
            out.append({"cached": length, "rows": b, "step_s": step, "per_row_s": step / b})
    return out


def table(records: list[dict]) -> str:
    lines = ["| cached tokens | rows | forward ms | per row ms | per row × one row |", "|---|---|---|---|---|"]
    alone = {r["cached"]: r["per_row_s"] for r in records if r["rows"] == 1}
    for r in records:
        ratio = alone[r["cached"]] / r["per_row_s"] if r["cached"] in alone else float("nan")
        lines.append(f"| {r['cached']} | {r['rows']} | {1000 * r['step_s']:.1f} | {1000 * r['per_row_s']:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--lengths", default="300,800,1600")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--out", default="benchmarks/out/batched_steps.json")
    args = parser.parse_args(argv)
    loaded = load(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    records = measure(loaded.model, [int(x) for x in args.lengths.split(",")], [int(x) for x in args.rows.split(",")],
                      args.steps, len(loaded.tokenizer))
    print(table(records))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "batched_steps", "model": loaded.tag, "device": args.device, "dtype": args.dtype,
                               "threads": torch.get_num_threads(),
                               "python": platform.python_version(), "torch": torch.__version__,
                               "records": records}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
