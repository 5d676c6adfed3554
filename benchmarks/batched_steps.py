"""What one decode forward costs for B calls at once, or for one call checking a draft: the
ground for batching siblings' steps (:mod:`kvcomm_agents.batched_decode`) and for drafts' lengths
(:mod:`kvcomm_agents.drafting`).

For each cached length and batch size, B rows of random ids are prefilled, then decode forwards
of q ids per row are timed (the median of ``--steps``), each cut back to the cached length after
it; per row is that divided by B. Prints a table and writes JSON.

    python -m benchmarks.batched_steps [--model embedded] [--lengths 300,800,1600] [--rows 1,2,4]
                                       [--ids 1] [--device cpu] [--dtype float32]
                                       [--layouts as_loaded,transposed] [--kv concatenated,in_place]

``--layouts``: the whole measure once per layout of the linear weights
(:mod:`kvcomm_agents.engines.weight_layout`), on the same model in turns, and per record the
second layout's forward over the first's. ``--kv``: likewise once per way a step's KV is added to
the cache, concatenated (transformers' ``DynamicCache``) or written in place
(:mod:`kvcomm_agents.engines.growing_cache`).
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
from kvcomm_agents.engines.growing_cache import make_growing
from kvcomm_agents.engines.weight_layout import linear_weights, set_layout

from .models import load

__all__ = ["measure", "table", "pair_table"]


def measure(model, lengths: list[int], rows: list[int], steps: int, vocab: int, seed: int = 0,
            ids: tuple[int, ...] = (1,), kv_in_place: bool = False) -> list[dict]:
    """One record per (cached length, rows, ids per row): the median seconds of a decode forward
    (``kv_in_place``: on a cache whose steps write their KV in place)."""
    generator = torch.Generator().manual_seed(seed)
    device = hf.input_device(model)
    out = []
    for length in lengths:
        for b in rows:
            prompt = torch.randint(100, vocab, (b, length), generator=generator).to(device)
            with torch.inference_mode():
                cache = make_growing(hf.new_cache(model)) if kv_in_place else hf.new_cache(model)
                started = time.perf_counter()
                hf.run_forward(model, prompt, cache)
                hf.wait_for(device)  # the prefill's end, not its launch
                prefill = time.perf_counter() - started
                for q in ids:
                    positions = torch.arange(length, length + q, device=device).expand(b, q)
                    times = []
                    for _ in range(steps):
                        tokens = torch.randint(100, vocab, (b, q), generator=generator).to(device)
                        started = time.perf_counter()
                        hf.run_forward(model, tokens, cache, position_ids=positions, last_logits_only=False)
                        hf.wait_for(device)
                        times.append(time.perf_counter() - started)
                        hf.keep_first(cache, length)
                    step = statistics.median(times)
                    out.append({"cached": length, "rows": b, "ids": q, "step_s": step, "per_row_s": step / b,
                                "prefill_s": prefill})
    return out


def table(records: list[dict]) -> str:
    """Per record: the forward, per row, and one row of one id's forward over the row's (above
    1.00x: a row costs less than stepping it alone)."""
    lines = ["| cached tokens | rows | ids per row | forward ms | per row ms | one row of one id ÷ per row |",
             "|---|---|---|---|---|---|"]
    alone = {r["cached"]: r["per_row_s"] for r in records if r["rows"] == 1 and r.get("ids", 1) == 1}
    for r in records:
        ratio = alone[r["cached"]] / r["per_row_s"] if r["cached"] in alone else float("nan")
        lines.append(f"| {r['cached']} | {r['rows']} | {r.get('ids', 1)} | {1000 * r['step_s']:.1f} | "
                     f"{1000 * r['per_row_s']:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def pair_table(records: list[dict], field: str, first: str, second: str) -> str:
    """Per (cached, rows, ids): the forward with ``field`` (``"layout"`` or ``"kv"``) at
    ``second`` over at ``first``, and the prefill's."""
    lines = [f"| cached tokens | rows | ids per row | {first} ms | {second} ms | {second} ÷ {first} | prefill ÷ |",
             "|---|---|---|---|---|---|---|"]
    by = {(r[field], r["cached"], r["rows"], r["ids"]): r for r in records}
    for r in (r for r in records if r[field] == first):
        other = by.get((second, r["cached"], r["rows"], r["ids"]))
        if other is not None:
            lines.append(f"| {r['cached']} | {r['rows']} | {r['ids']} | {1000 * r['step_s']:.1f} | "
                         f"{1000 * other['step_s']:.1f} | {other['step_s'] / r['step_s']:.2f}x | "
                         f"{other['prefill_s'] / r['prefill_s']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--lengths", default="300,800,1600")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--ids", default="1", help="ids per row of each forward (a draft of q - 1 ids and the token)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--layouts", default="as_loaded", help="comma-separated: as_loaded, transposed")
    parser.add_argument("--kv", default="concatenated", help="comma-separated: concatenated, in_place")
    parser.add_argument("--out", default="benchmarks/out/batched_steps.json")
    args = parser.parse_args(argv)
    loaded = load(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    records, layouts, kvs = [], args.layouts.split(","), args.kv.split(",")
    for layout in layouts:
        set_layout(linear_weights(loaded.model), layout)
        for length in (int(x) for x in args.lengths.split(",")):  # the KV ways in turn per length: drift is shared
            for kv in kvs:
                measured = measure(loaded.model, [length], [int(x) for x in args.rows.split(",")], args.steps,
                                   len(loaded.tokenizer), ids=tuple(int(x) for x in args.ids.split(",")),
                                   kv_in_place=kv == "in_place")
                records += [{**r, "layout": layout, "kv": kv} for r in measured]
                print(f"weights {layout}, KV {kv}:\n{table(measured)}\n")
    if len(layouts) == 2:
        print(pair_table([r for r in records if r["kv"] == kvs[0]], "layout", *layouts))
    if len(kvs) == 2:
        print(pair_table([r for r in records if r["layout"] == layouts[0]], "kv", *kvs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "batched_steps", "model": loaded.tag, "device": args.device, "dtype": args.dtype,
                               "threads": torch.get_num_threads(),
                               "python": platform.python_version(), "torch": torch.__version__,
                               "records": records}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
