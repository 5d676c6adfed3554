"""Soak: many calls of a multi-agent pipeline on a tiny model, memory watched throughout.

Every request is a 4-solver debate on a fresh question (solver k reads the question and every
earlier reply), so the store, the anchor pools and the own-text KV keep receiving new KV and must
stay within their budgets by evicting. Prints the resident memory, the bytes and entries held and the
median time a call spends before its prefill (rendering and planning: what grows with the entries
held when a lookup scans them) every ``--every`` calls, checks the budgets after every call, and
writes the curve as JSON.

    python -m benchmarks.soak [--calls 1000] [--store-mib 8] [--anchor-mib 8] [--out benchmarks/out/soak.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.testing import tiny_llama, tiny_tokenizer

__all__ = ["soak", "resident_bytes"]

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay"]
ITEMS = ["apples", "pencils", "tickets", "boxes", "stamps", "marbles"]


def resident_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    import resource

    return pages * resource.getpagesize()


def _question(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return (f"{rng.choice(NAMES)} has {a} {rng.choice(ITEMS)} and buys {b} more, then gives away "
            f"{rng.randint(1, a)}. How many are left?")


def soak(calls: int = 1000, *, agents: int = 4, store_mib: int = 8, anchor_mib: int = 8, every: int = 50,
         reply_tokens: int = 24, seed: int = 0, progress=print) -> list[dict]:
    """Run ``calls`` agent calls; returns one row per ``every`` calls (and raises AssertionError
    the moment a budget is exceeded)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = tiny_tokenizer()
    engine = KVCommEngine(tiny_llama(tokenizer, seed=seed), tokenizer, config=KVCommConfig(
        store_max_bytes=store_mib * 2**20, anchor_max_bytes=anchor_mib * 2**20,
        reply_copies=True, text_copies=True,  # off by default; on here, so that their versions fill the budgets too
        experimental={"own_text": "reuse", "own_text_max_bytes": 2**20}))
    rows, done, started, planning = [], 0, time.perf_counter(), []
    while done < calls:
        question, replies = _question(rng), []
        for k in range(1, agents + 1):
            messages = [{"role": "system", "content": f"You are solver {k} of {agents}."},
                        {"role": "user", "content": question}]
            messages += [{"role": "user", "content": f"Solver {j} answered: {reply}"} for j, reply in enumerate(replies, 1)]
            result = engine.chat(messages, agent=f"solver-{k}", max_new_tokens=reply_tokens, temperature=0.8, seed=done)
            replies.append(result.text)
            planning.append(result.stats.plan_s)
            done += 1
            store = engine.store.stats()
            assert store.bytes <= store.max_bytes, f"store {store.bytes} > {store.max_bytes} after call {done}"
            assert engine.anchors.nbytes() <= engine.anchors.max_bytes, f"anchors over budget after call {done}"
            assert engine.own_texts.nbytes() <= engine.own_texts.max_bytes, f"own text over budget after call {done}"
            if done % every == 0 or done == calls:
                rows.append({"calls": done, "rss_mib": resident_bytes() / 2**20, "store_mib": store.bytes / 2**20,
                             "store_entries": store.segments + store.prefixes, "evictions": store.evictions,
                             "anchor_mib": engine.anchors.nbytes() / 2**20, "own_text_mib": engine.own_texts.nbytes() / 2**20,
                             "plan_ms": 1000 * statistics.median(planning), "seconds": time.perf_counter() - started})
                planning.clear()
                progress(_row(rows[-1]))
            if done == calls:
                break
    return rows


def _row(r: dict) -> str:
    return (f"{r['calls']:>6} calls  rss {r['rss_mib']:7.1f} MiB  store {r['store_mib']:5.2f} MiB "
            f"({r['store_entries']} entries, {r['evictions']} evicted)  anchors {r['anchor_mib']:5.2f} MiB  "
            f"own text {r['own_text_mib']:5.2f} MiB  planning {r['plan_ms']:5.2f} ms  {r['seconds']:6.0f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--store-mib", type=int, default=8)
    parser.add_argument("--anchor-mib", type=int, default=8)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/soak.json"))
    args = parser.parse_args(argv)
    rows = soak(args.calls, store_mib=args.store_mib, anchor_mib=args.anchor_mib, every=args.every)
    half = [r["rss_mib"] for r in rows if r["calls"] > args.calls // 2]
    print(f"budgets held after every call; resident memory over the second half: {min(half):.1f}-{max(half):.1f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
