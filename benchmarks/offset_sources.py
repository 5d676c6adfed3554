"""Where good offsets come from: a segment's own offsets recorded for another receiver against
KVCOMM's estimate from the receiver's other anchors (docs/anchors.md, "Recorded versions").

For each workload, every call is replayed with the dense references (forced replies) through a
KVCOMM engine that never reuses (``min_anchors`` above any pool size), so every shared segment
is computed in context and its exact offsets recorded for every receiver. Then each anchor's
offsets for each receiver are predicted in turn:

- ``from <receiver>``: the offsets another receiver recorded for the very same segment;
- ``mean``: the mean of the receiver's other anchors at least as long (KVCOMM's ``mean``
  estimate, the paper's length rule);
- with ``--regression``, two learned predictors (is a smarter estimate than the mean worth
  building?), each fitted per layer and KV head by ridge regression on the receiver's other
  anchors of the kind, every token of them a sample:
  - ``ridge``: a linear map from the segment's own base KV (key, un-rotated, and value) to its
    offsets;
  - ``probe1``: the same plus the exact offsets of layer 1 (every head) of the very token, as
    if a probe had computed the first layers in context; scored on layers 2..L-1 only (beside
    ``ridge`` on the same layers, ``ridge@2``).

scored as relative squared error over layers 1..L-1, tokens and channels (0: exact, 1: as far
off as no offsets, i.e. re-rotation only), keys and values apart. Offsets are the model's own,
on the same token ids; no timing is involved.

    python -m benchmarks.offset_sources [--workloads b,e,c,d] [--requests 16,6,4,4]
                                        [--regression] [--out benchmarks/out/offset_sources.json]

About 7 minutes per workload at the default sizes on 2 CPU cores (``--regression``: about 15
on (b)).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from kvcomm_agents import ExperimentalSettings, KVCommConfig, KVCommEngine

from . import measure
from .graphs import changing_graph
from .models import load
from .workloads import Workload, coding_pipeline, gsm8k_debate, gsm8k_one_message, rag_handoff

__all__ = ["record_all", "score_pools"]

#: a research script: the development range only (the report range is kept for the figures)
BUILDERS = {"b": lambda n: gsm8k_debate(requests=n, split="dev"), "e": lambda n: gsm8k_one_message(requests=n, split="dev"),
            "c": lambda n: rag_handoff(requests=n, split="dev"), "d": lambda n: coding_pipeline(requests=n, split="dev"),
            "g": lambda n: changing_graph(requests=n, split="dev", reply_tokens=32)}


def record_all(workload: Workload, refs: dict, model, tokenizer) -> KVCommEngine:
    """An engine whose pools hold every receiver's exact offsets of every shared segment."""
    config = KVCommConfig(audit_every=0, max_anchors=64, anchor_max_bytes=8 << 30, store_max_bytes=8 << 30,
                          recompute_head=0, recompute_tail=0, recompute_short_runs=0, recompute_last_run=0,
                          recorded_versions=False,
                          experimental=ExperimentalSettings(min_anchors=10_000))
    engine = KVCommEngine(model, tokenizer, config=config)
    for request in workload.requests:
        replies = refs[request.key]
        for k, agent in enumerate(request.agents):
            messages = request.messages(k, [c["text"] for c in replies[:k]])
            engine.replay(messages, agent=agent, reply_ids=replies[k]["ids"])
    return engine


def _relative(estimate: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    return float((estimate - exact).square().sum()), float(exact.square().sum())


#: Ridge strength, relative to the mean diagonal of each fit's Gram matrix (the best of 0.0001-3
#: on (b)'s pools; the figures move by a few hundredths across 0.03-0.3).
RIDGE = 0.1


def _ridge(features: torch.Tensor, targets: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Fit ``targets [..., n, F_out] ~ [features, 1] @ W`` per leading index (ridge, float64)
    and return ``[query, 1] @ W`` (``query [..., m, F_in]``)."""
    def bias(x):
        return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1).double()

    x, q = bias(features), bias(query)
    gram = x.transpose(-1, -2) @ x
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-12)[..., None, None]
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype)
    weights = torch.cholesky_solve(x.transpose(-1, -2) @ targets.double(), torch.linalg.cholesky(gram + RIDGE * scale * eye))
    return (q @ weights).float()


def _regression_sources(pool, stack, slots: list[int], slot: int, rotator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``ridge``, ``ridge@2`` and ``probe1`` estimates of ``slot``'s offsets from the other
    ``slots``: name -> (keys, values), ``[L', H, T, D]`` in the canonical frame (``ridge@2`` and
    ``probe1`` cover layers 2..L-1, i.e. pool layers 1..)."""
    others = [o for o in slots if o != slot]
    lengths = {o: int(pool.lengths[o]) for o in slots}

    def unrotated(keys: torch.Tensor, n: int) -> torch.Tensor:  # [L, H, n, D] canonical -> position 0
        return rotator.shift(keys[:, :, :n].float(), -torch.arange(n))

    def rows(o: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = lengths[o]
        base_k, base_v = pool.base(o)
        off_k, off_v = (t[0] for t in stack.dense(torch.tensor([o]), n))
        base = torch.cat([unrotated(base_k, n), base_v[:, :, :n].float()], -1)
        offset = torch.cat([unrotated(off_k, n), off_v], -1)
        layers, heads = offset.shape[:2]
        shallow = offset[:1].permute(2, 0, 1, 3).reshape(1, 1, n, -1).expand(layers - 1, heads, n, -1)
        return base, offset, torch.cat([base[1:], shallow], -1)  # [L,H,n,2D], [L,H,n,2D], [L-1,H,n,2D+H*2D]

    train = [rows(o) for o in others]
    base, _, probe = rows(slot)
    n, d = lengths[slot], base.shape[-1] // 2
    offsets = torch.cat([t[1] for t in train], 2)
    found = {
        "ridge": _ridge(torch.cat([t[0] for t in train], 2), offsets, base),
        "probe1": _ridge(torch.cat([t[2] for t in train], 2), offsets[1:], probe),
    }
    found["ridge@2"] = found["ridge"][1:]
    out = {}
    for name, estimate in found.items():
        keys = rotator.shift(estimate[..., :d].contiguous(), torch.arange(n))
        out[name] = (keys, estimate[..., d:])
    return out


def _transferred(pool, stacks, receiver: str, slot: int, length: int, index: int) -> dict[str, torch.Tensor]:
    """Offsets of ``slot`` for ``receiver`` estimated from *other* receivers' anchors of the kind
    (other segments, at least as long, token by token from the segment's start): ``others' mean``
    (an anchor learned for one role serving another), and ``all receivers' mean`` (one pool per
    kind, whoever reads). ``index``: 0 keys, 1 values; each ``[L-1, H, length, D]``."""
    def anchors_of(stack) -> Optional[torch.Tensor]:  # [N, L-1, H, length, D]: the stack's other slots, long enough
        held = [o for o in pool.held_by(stack).nonzero().flatten().tolist()
                if o != slot and int(pool.lengths[o]) >= length]
        return stack.dense(torch.tensor(held), length)[index] if held else None

    theirs = [t for name, other in stacks if name != receiver and (t := anchors_of(other)) is not None]
    if not theirs:
        return {}
    stacked = torch.cat(theirs)
    out = {"others' mean": stacked.mean(0)}
    own = anchors_of(dict(stacks)[receiver])
    if own is not None:
        out["all receivers' mean"] = torch.cat([own, stacked]).mean(0)
    return out


def score_pools(engine: KVCommEngine, regression: bool = False, transfer: bool = False) -> list[dict]:
    """Per segment kind and receiver: relative squared error of each offset source
    (``transfer``: also the other receivers' anchors, :func:`_transferred`)."""
    rows = []
    for kind in [tuple(k) for k in engine.anchors._pools]:
        pool = engine.anchors.pool(kind)
        stacks = list(pool.placeholder.items())
        for receiver, stack in stacks:
            slots = pool.held_by(stack).nonzero().flatten().tolist()
            sums: dict[str, list[float]] = {}
            for slot in slots:
                length = int(pool.lengths[slot])
                for index, part in enumerate(("keys", "values")):
                    exact = stack.dense(torch.tensor([slot]), length)[index][0]
                    others = [o for o in slots if o != slot and int(pool.lengths[o]) >= length]
                    sources = {}
                    if len(others) >= 2:
                        sources["mean"] = stack.dense(torch.tensor(others), length)[index].mean(0)
                    for name, other in stacks:
                        if name != receiver and bool(pool.held_by(other)[slot]):
                            sources[f"from {name}"] = other.dense(torch.tensor([slot]), length)[index][0]
                    if transfer:
                        sources.update(_transferred(pool, stacks, receiver, slot, length, index))
                    for source, estimate in sources.items():
                        num, den = _relative(estimate, exact)
                        acc = sums.setdefault(f"{source}|{part}", [0.0, 0.0])
                        acc[0], acc[1] = acc[0] + num, acc[1] + den
                if regression and len(slots) >= 3:
                    learned = _regression_sources(pool, stack, slots, slot, engine.info.rotator)
                    for source, (keys, values) in learned.items():
                        for index, (part, estimate) in enumerate((("keys", keys), ("values", values))):
                            exact = stack.dense(torch.tensor([slot]), length)[index][0][-estimate.shape[0]:]
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
    parser.add_argument("--regression", action="store_true", help="also score the learned predictors (ridge, probe1)")
    parser.add_argument("--transfer", action="store_true",
                        help="also score other receivers' anchors as the estimate (offsets that transfer across roles)")
    args = parser.parse_args(argv)
    loaded = load(args.model, device="cpu", dtype=torch.float32)
    results = {}
    for name, n in zip(args.workloads.split(","), [int(x) for x in args.requests.split(",")]):
        workload = BUILDERS[name](n)
        refs = measure.references(workload, loaded.model, loaded.tokenizer,
                                  args.out.parent / "refs" / "float32-cpu" / f"{workload.name}.pt")
        rows = score_pools(record_all(workload, refs, loaded.model, loaded.tokenizer), args.regression, args.transfer)
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
