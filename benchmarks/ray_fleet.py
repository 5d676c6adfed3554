"""Workload (b) through the fleet on Ray Serve (kvcomm_vllm.ray_serve): many graphs at once, one
replica or two, the affinity request router against round robin.

    .venv-vllm/bin/python -m benchmarks.ray_fleet --out benchmarks/out/ray_fleet
    .venv-vllm/bin/python -m benchmarks.ray_fleet --sizes 8 --reply-tokens 24   # a small run

Each set-up is one Serve application on a local Ray cluster, started afresh (its replicas start
empty): ``1 replica``; ``2 replicas, round robin`` (``--routing round-robin``: the same
replicas, requests in turn whatever the replicas hold) and ``2 replicas, affinity`` (the default
router), each with and without the Redis segment tier (flushed between set-ups). In each, one
warm-up graph (excluded), then for every size in ``--sizes`` that many GSM8K debates (4 solvers,
each reading the question and every earlier reply) started at once, each graph's agents called
in order through one shared :class:`kvcomm_vllm.client.VLLMEngine` against the fleet's URL.
Questions come from the report range (GSM8K rows 250-499; ``--offset`` within it): fresh ones per
batch, the same ones in every set-up.

Reported per set-up and size: the median and longest whole-graph wall time, the batch's wall
time and throughput (graphs per minute), the share of prompt tokens served from cache (the
replicas' own reports: from the replica's memory or fetched from the tier), per agent too, and
the tier's traffic during the set-up (Redis ``GET`` calls: entries fetched by a replica that did
not compute them; bytes Redis sent). Copies (prefill ahead, replies ahead) are off unless
``--copies``: the comparison is about where requests land.

Writes ``<out>/ray_fleet.json`` (with every call's counts), ``--summary PATH`` (the figures
alone, with the command and commit) and prints the table. Two replicas on a 2-core machine
share the cores: wall times there compare set-ups on this machine only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.provenance import git_commit

#: set-up (``--setups``) -> (its label, replicas, routing, Redis tier)
SETUPS = {"one": ("1 replica", "1", "affinity", True),
          "round-robin": ("2 replicas, round robin", "2", "round-robin", True),
          "affinity": ("2 replicas, affinity", "2", "affinity", True),
          "round-robin-no-tier": ("2 replicas, round robin, no tier", "2", "round-robin", False),
          "affinity-no-tier": ("2 replicas, affinity, no tier", "2", "affinity", False)}
AGENTS = 4
SPLIT = "report"


def run_graph(engine, request, reply_tokens: int) -> dict:
    """One debate, agent after agent: its wall time and per-agent token counts."""
    replies, calls, started = [], [], time.perf_counter()
    for k, agent in enumerate(request.agents):
        result = engine.chat(request.messages(k, replies), agent=agent, max_new_tokens=reply_tokens)
        replies.append(result.text)
        calls.append({"agent_index": k + 1, "prompt_tokens": result.stats.prompt_tokens,
                      "reused_tokens": result.stats.reused_tokens})
    return {"wall_s": time.perf_counter() - started, "calls": calls}


def run_batch(engine, requests, reply_tokens: int) -> dict:
    """``requests`` started at once, one thread per graph."""
    graphs: list = [None] * len(requests)
    errors: list = []

    def one(n: int) -> None:
        try:
            graphs[n] = run_graph(engine, requests[n], reply_tokens)
        except Exception as error:  # noqa: BLE001 - reported with the batch
            errors.append(repr(error)[:500])

    threads = [threading.Thread(target=one, args=(n,)) for n in range(len(requests))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"batch_wall_s": time.perf_counter() - started, "graphs": [g for g in graphs if g], "errors": errors}


def _share(calls: list[dict]) -> float:
    return sum(c["reused_tokens"] for c in calls) / max(1, sum(c["prompt_tokens"] for c in calls))


def summarize(batch: dict) -> dict:
    walls = [g["wall_s"] for g in batch["graphs"]]
    calls = [c for g in batch["graphs"] for c in g["calls"]]
    return {"graphs": len(walls), "errors": len(batch["errors"]),
            "graph_wall_median_s": statistics.median(walls) if walls else None,
            "graph_wall_max_s": max(walls) if walls else None, "batch_wall_s": batch["batch_wall_s"],
            "graphs_per_min": 60 * len(walls) / batch["batch_wall_s"],
            "prompt_tokens": sum(c["prompt_tokens"] for c in calls), "cache_share": _share(calls),
            "cache_share_by_agent": {k: _share([c for c in calls if c["agent_index"] == k])
                                     for k in range(1, AGENTS + 1)}}


def tier_traffic(client) -> dict:
    """Redis's counters since the last reset: GET calls (entries fetched) and bytes sent."""
    gets = client.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
    return {"tier_gets": int(gets), "tier_sent_mib": client.info("stats")["total_net_output_bytes"] / 2**20}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/ray_fleet"))
    parser.add_argument("--summary", type=Path, default=None, help="also write the figures alone here")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of: " + ", ".join(SETUPS))
    parser.add_argument("--sizes", default="8,16", help="graphs started at once, one batch per size")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--offset", type=int, default=0,
                        help="the first question, within the report range (GSM8K rows 250-499)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per replica")
    parser.add_argument("--copies", action="store_true", help="the client's prefill-ahead and reply-ahead copies on")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        parser.error(f"unknown set-ups {sorted(unknown)}; of: {', '.join(SETUPS)}")

    import ray
    import redis
    from ray import serve

    from benchmarks.workloads import gsm8k_debate
    from kvcomm_agents.paged import local_redis
    from kvcomm_vllm.client import VLLMEngine
    from kvcomm_vllm.ray_serve import APP_NAME, build_app, parser as fleet_parser

    requests = gsm8k_debate(requests=1 + sum(sizes), split=SPLIT, offset=args.offset, agents=AGENTS).requests
    records = []
    with local_redis() as store:
        tier = redis.Redis.from_url(store)
        ray.init(num_cpus=4, include_dashboard=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": 8000})
            url = "http://127.0.0.1:8000"
            for setup in setups:
                label, replicas, routing, shared = SETUPS[setup]
                tier.flushdb()
                tier.config_resetstat()
                argv_fleet = ["--replicas", replicas, "--routing", routing, "--threads", str(args.threads),
                              "--kv-cache-gib", "1", "--replica-cpus", "1"]
                if shared:
                    argv_fleet += ["--shared-store", store]
                started = time.perf_counter()
                serve.run(build_app(fleet_parser().parse_args(argv_fleet)), name=APP_NAME, route_prefix="/")
                up_s = time.perf_counter() - started
                print(f"{label}: up in {up_s:.0f} s", flush=True)
                engine = VLLMEngine(url, prefill_ahead=args.copies, reply_ahead=args.copies)
                run_batch(engine, requests[:1], args.reply_tokens)  # warm-up, excluded
                first = 1
                for size in sizes:
                    before = tier_traffic(tier)
                    batch = run_batch(engine, requests[first:first + size], args.reply_tokens)
                    after = tier_traffic(tier)
                    first += size
                    records.append({"setup": label, "size": size, "up_s": up_s, **summarize(batch),
                                    **{k: after[k] - before[k] for k in after}, "raw": batch})
                    row = records[-1]
                    print(f"  {size} graphs: {row['batch_wall_s']:.1f} s, cache {row['cache_share']:.0%}, "
                          f"tier GETs {row['tier_gets']}, errors {row['errors']} {batch['errors'][:1]}", flush=True)
                serve.delete(APP_NAME)
        finally:
            serve.shutdown()
            ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items()}
    (args.out / "ray_fleet.json").write_text(json.dumps({"settings": settings, "results": records}, indent=1))
    if args.summary is not None:
        summary = {"command": " ".join([Path(sys.executable).as_posix(), "-m", "benchmarks.ray_fleet",
                                        *(sys.argv[1:] if argv is None else argv)]),
                   "commit": git_commit(), "split": SPLIT, "args": settings,
                   "summary": [{k: v for k, v in r.items() if k != "raw"} for r in records]}
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print_table(records)


def print_table(records: list[dict]) -> None:
    print("\n== workload (b) through Ray Serve: graphs started at once ==")
    print(f"{'set-up':34s} {'graphs':>6s} {'median s':>9s} {'max s':>7s} {'batch s':>8s} {'graphs/min':>10s} "
          f"{'from cache':>10s} {'agents 1-4 from cache':>22s} {'tier GETs':>9s}")
    for r in records:
        agents = " ".join(f"{r['cache_share_by_agent'][k]:4.0%}" for k in range(1, AGENTS + 1))
        print(f"{r['setup']:34s} {r['size']:6d} {r['graph_wall_median_s'] or 0:9.1f} {r['graph_wall_max_s'] or 0:7.1f} "
              f"{r['batch_wall_s']:8.1f} {r['graphs_per_min']:10.1f} {r['cache_share']:10.0%} {agents:>22s} "
              f"{r['tier_gets']:9d}")


if __name__ == "__main__":
    main()
