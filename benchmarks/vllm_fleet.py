"""Workload (b) on a fleet of two vLLM replicas with the KVCOMM connector: what routing and a
shared segment tier keep of the reuse one replica gets.

    .venv-vllm/bin/python -m benchmarks.vllm_fleet --out benchmarks/out/fleet

Phases:

- ``routing``: the GSM8K debate (4 solvers, each reading the question and every earlier reply),
  one graph at a time through the SDK's remote clients, under four set-ups, each on fresh
  servers: ``one replica`` (the reference: everything is local), ``round robin`` over two
  replicas without a shared tier (each agent lands on the other replica from its senders),
  ``round robin + tier`` (the same, replicas sharing a Redis tier), ``affinity + tier``
  (:class:`kvcomm_vllm.fleet.FleetEngine`). Reported per agent index: the share of prompt
  tokens served from cache (the servers' own reports), and the graph wall time. The two
  replicas share this machine's cores, so wall times compare set-ups, not a real fleet.
- ``tier``: what a tier fetch costs against computing the same tokens, on the embedded model
  with transformers: dense prefill of N tokens, publishing their KV (safetensors encode + Redis
  SET) and fetching it back (GET + decode), median of 5, for N in 128, 512, 1024.

Writes ``<out>/vllm_fleet.json`` and prints the tables. The first ``--warmup`` graphs of each
set-up are excluded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

AGENTS = 4
SETUPS = ("one replica", "round robin", "round robin + tier", "affinity + tier")


class _RoundRobin:
    """Calls go to the replicas in turn, whatever they hold."""

    def __init__(self, engines):
        self.engines, self.turn = engines, 0

    def chat(self, messages, *, agent, **options):
        engine = self.engines[self.turn % len(self.engines)]
        self.turn += 1
        return engine.chat(messages, agent=agent, **options)


def run_routing(args) -> list[dict]:
    from benchmarks.workloads import gsm8k_debate
    from kvcomm_agents.testing import local_redis
    from kvcomm_vllm.client import VLLMEngine
    from kvcomm_vllm.fleet import FleetEngine
    from kvcomm_vllm.serve import local_server

    requests = gsm8k_debate(requests=args.warmup + args.requests, offset=args.offset, agents=AGENTS).requests
    records = []
    for setup in args.setups:
        with ExitStack() as stack:
            tier = ["--shared-store", stack.enter_context(local_redis())] if "tier" in setup else []
            urls = [stack.enter_context(local_server(*tier)) for _ in range(1 if setup == "one replica" else 2)]
            if setup.startswith("affinity"):
                client = FleetEngine(urls)
            else:
                client = _RoundRobin([VLLMEngine(url) for url in urls])
            print(f"{setup}: {len(urls)} replica(s) up", flush=True)
            for index, request in enumerate(requests):
                replies, started = [], time.perf_counter()
                for k, agent in enumerate(request.agents):
                    result = client.chat(request.messages(k, replies), agent=agent, max_new_tokens=args.reply_tokens)
                    replies.append(result.text)
                    records.append({"setup": setup, "graph": index, "agent_index": k + 1,
                                    "prompt_tokens": result.stats.prompt_tokens,
                                    "reused_tokens": result.stats.reused_tokens})
                records.append({"setup": setup, "graph": index, "wall_s": time.perf_counter() - started})
    return records


def run_tier(args) -> list[dict]:
    import torch

    from transformers import AutoModelForCausalLM

    from kvcomm_agents.embedded import embedded_model_dir
    from kvcomm_agents.engines import hf
    from kvcomm_agents.kv.redis_tier import RedisSegments
    from kvcomm_agents.kv.shared import decode_entry, encode_entry
    from kvcomm_agents.kv.store import PrefixEntry
    from kvcomm_agents.testing import local_redis

    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()
    records = []
    with local_redis() as url:
        tier = RedisSegments(url, namespace="bench")
        for n in (128, 512, 1024):
            ids = torch.randint(100, 40000, (n,))
            times = {"prefill_s": [], "publish_s": [], "fetch_s": []}
            for repeat in range(5):
                with torch.inference_mode():
                    started = time.perf_counter()
                    pre = hf.prefill(model, ids, torch.arange(n))
                    times["prefill_s"].append(time.perf_counter() - started)
                    kv = hf.kv_at_positions(pre.cache, pre.slot_positions, torch.arange(n))
                entry = PrefixEntry(f"bench-{n}-{repeat}", ids, kv, "bench")
                started = time.perf_counter()
                item, blob = encode_entry(entry)
                tier.publish(item, blob)
                times["publish_s"].append(time.perf_counter() - started)
                started = time.perf_counter()
                decode_entry(item, tier.fetch(item.key))
                times["fetch_s"].append(time.perf_counter() - started)
            records.append({"tokens": n, "mib": len(blob) / 2**20,
                            **{k: statistics.median(v) for k, v in times.items()}})
            print(records[-1], flush=True)
    return records


def summarize(routing: list[dict], warmup: int) -> dict:
    table = {}
    for setup in SETUPS:
        calls = [r for r in routing if r["setup"] == setup and "agent_index" in r and r["graph"] >= warmup]
        walls = [r["wall_s"] for r in routing if r["setup"] == setup and "wall_s" in r and r["graph"] >= warmup]
        if not calls:
            continue
        share = {}
        for k in range(1, AGENTS + 1):
            mine = [r for r in calls if r["agent_index"] == k]
            share[k] = sum(r["reused_tokens"] for r in mine) / max(1, sum(r["prompt_tokens"] for r in mine))
        table[setup] = {"share_by_agent": share,
                        "share": sum(r["reused_tokens"] for r in calls) / max(1, sum(r["prompt_tokens"] for r in calls)),
                        "wall_median_s": statistics.median(walls), "graphs": len(walls)}
    return table


def print_tables(table: dict, tier: list[dict]) -> None:
    if table:
        print("\n== workload (b) on two replicas: prompt tokens served from cache ==")
        print(f"{'set-up':22s} {'agent 1':>8s} {'agent 2':>8s} {'agent 3':>8s} {'agent 4':>8s} {'all':>6s} {'graph wall s':>13s}")
        for setup, row in table.items():
            cells = " ".join(f"{row['share_by_agent'][k]:8.0%}" for k in range(1, AGENTS + 1))
            print(f"{setup:22s} {cells} {row['share']:6.0%} {row['wall_median_s']:13.1f}")
    if tier:
        print("\n== a tier fetch against computing the tokens (embedded model, fp32, this CPU) ==")
        print(f"{'tokens':>7s} {'KV MiB':>7s} {'prefill ms':>11s} {'publish ms':>11s} {'fetch ms':>9s} {'prefill/fetch':>14s}")
        for r in tier:
            print(f"{r['tokens']:7d} {r['mib']:7.1f} {r['prefill_s'] * 1e3:11.1f} {r['publish_s'] * 1e3:11.1f} "
                  f"{r['fetch_s'] * 1e3:9.1f} {r['prefill_s'] / r['fetch_s']:13.1f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/fleet"))
    parser.add_argument("--phases", default="routing,tier")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--reply-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    args.setups = [s for s in args.setups.split(",") if s]
    phases = args.phases.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    routing = run_routing(args) if "routing" in phases else []
    tier = run_tier(args) if "tier" in phases else []
    table = summarize(routing, args.warmup)
    (args.out / "vllm_fleet.json").write_text(json.dumps(
        {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "routing": routing, "table": table,
         "tier": tier}, indent=1, default=str))
    print_tables(table, tier)


if __name__ == "__main__":
    main()
