"""Where good offsets come from: a segment's own offsets recorded for another receiver against
KVCOMM's estimate from the receiver's other anchors (docs/anchors.md, "Recorded versions").

For each workload, every call is replayed with the dense references (forced replies) through a
KVCOMM engine that never reuses (``min_anchors`` above any pool size), so every shared segment
is computed in context and its exact offsets recorded for every receiver. Then each anchor's
offsets for each receiver are predicted in turn:

- ``from <receiver>``: the offsets another receiver recorded for the very same segment;
- ``mean``: the mean of the receiver's other anchors at least as long (KVCOMM's ``mean``
  estimate, the paper's length rule);

scored as relative squared error over layers 1..L-1, tokens and channels (0: exact, 1: as far
off as no offsets, i.e. re-rotation only), keys and values apart. Offsets are the model's own,
on the same token ids; no timing is involved.

    python -m benchmarks.offset_sources [--workloads b,e,c,d] [--requests 16,6,4,4]
                                        [--out benchmarks/out/offset_sources.json]

About 7 minutes per workload at the default sizes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvcomm_agents import ExperimentalSettings, KVCommConfig, KVCommEngine

from . import measure
from .models import load
from .workloads import Workload, coding_pipeline, gsm8k_debate, gsm8k_one_message, rag_handoff

__all__ = ["record_all", "score_pools"]

BUILDERS = {"b": lambda n: gsm8k_debate(requests=n), "e": lambda n: gsm8k_one_message(requests=n),
            "c": lambda n: rag_handoff(requests=n), "d": lambda n: coding_pipeline(requests=n)}


def record_all(workload: Workload, refs: dict, model, tokenizer) -> KVCommEngine:
    """An engine whose pools hold every receiver's exact offsets of every shared segment."""
    config = KVCommConfig(audit_every=0, max_anchors=64, anchor_max_bytes=8 << 30, store_max_bytes=8 << 30,
                          experimental=ExperimentalSettings(min_anchors=10_000, recompute_head=0,
                                                            recorded_versions=False))
    engine = KVCommEngine(model, tokenizer, config=config)
    for request in workload.requests:
        replies = refs[request.key]
        for k, agent in enumerate(request.agents):
            messages = request.messages(k, [c["text"] for c in replies[:k]])
            engine.replay(messages, agent=agent, reply_ids=replies[k]["ids"])
    return engine


def _relative(estimate: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    return float((estimate - exact).square().sum()), float(exact.square().sum())


def score_pools(engine: KVCommEngine) -> list[dict]:
    """Per segment kind and receiver: relative squared error of each offset source."""
    rows = []
    for kind in [tuple(k) for k in engine.anchors._pools]:
        pool = engine.anchors.pool(kind)
        stacks = list(pool.placeholder.items())
        for receiver, stack in stacks:
            slots = pool.held_by(stack).nonzero().flatten().tolist()
            sums: dict[str, list[float]] = {}
            for slot in slots:
                length = int(pool.lengths[slot])
                for part in ("keys", "values"):
                    exact = getattr(stack, part)[slot, :, :, :length].float()
                    others = [o for o in slots if o != slot and int(pool.lengths[o]) >= length]
                    sources = {}
                    if len(others) >= 2:
                        sources["mean"] = getattr(stack, part)[torch.tensor(others), :, :, :length].float().mean(0)
                    for name, other in stacks:
                        if name != receiver and bool(pool.held_by(other)[slot]):
                            sources[f"from {name}"] = getattr(other, part)[slot, :, :, :length].float()
                    for source, estimate in sources.items():
                        num, den = _relative(estimate, exact)
                        acc = sums.setdefault(f"{source}|{part}", [0.0, 0.0])
                        acc[0], acc[1] = acc[0] + num, acc[1] + den
            rows.append({"kind": list(kind), "receiver": receiver, "anchors": len(slots),
                         "error": {key: num / den for key, (num, den) in sums.items() if den > 0}})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="b,e,c,d")
    parser.add_argument("--requests", default="16,6,4,4", help="requests per workload, in order")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/offset_sources.json"))
    parser.add_argument("--model", default="embedded", help="embedded | random:<shape> | a local model folder")
    args = parser.parse_args(argv)
    loaded = load(args.model, device="cpu", dtype=torch.float32)
    results = {}
    for name, n in zip(args.workloads.split(","), [int(x) for x in args.requests.split(",")]):
        workload = BUILDERS[name](n)
        refs = measure.references(workload, loaded.model, loaded.tokenizer,
                                  args.out.parent / "refs" / "float32-cpu" / f"{workload.name}.pt")
        rows = score_pools(record_all(workload, refs, loaded.model, loaded.tokenizer))
        results[name] = rows
        print(f"== ({name}) {workload.title}")
        for row in rows:
            cells = " ".join(f"{k}={v:.3f}" for k, v in sorted(row["error"].items()))
            print(f"  {tuple(row['kind'])} -> {row['receiver']} ({row['anchors']} anchors): {cells}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"written {args.out}")
    return results


if __name__ == "__main__":
    main()
