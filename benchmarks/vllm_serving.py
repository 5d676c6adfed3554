"""Workload (b) on vLLM: plain vLLM against vLLM with the KVCOMM connector, and the HF engine.

    .venv-vllm/bin/python -m benchmarks.vllm_serving --out benchmarks/out/vllm     # all phases
    bash scripts/run.sh test-vllm -k pinned                                        # sets up .venv-vllm

Each strategy's engine runs in a process of its own, and no two run at once (they never share
the CPU). In the ``ttft`` phase the strategies take turns graph by graph (the order rotated per
graph), so a drift of the machine's speed falls on all of them alike (``--sequential``: each
strategy's graphs in one go, one strategy after another); the other phases run one strategy after
another. Speed is reported as ratios to plain vLLM measured in the same invocation.

- ``ttft``: the GSM8K debate (4 solvers, each reading the question and every earlier reply), one
  graph at a time: TTFT per agent index (vLLM's own first-token latency; the HF engine's
  ``stats.ttft_s``), whole-graph wall time (prefill and decode), prompt tokens served from cache
  (vLLM's prefix-cache hits: ``RequestOutput.num_cached_tokens``).
  Strategies: ``vllm-apc`` (vLLM's exact prefix cache, on by default in vLLM: the reference of
  every ratio), ``vllm-apc-copies`` (the prefix cache plus the client's prefill-ahead and reply
  copies, without the connector: the copies are exact-prefix requests, which the prefix cache
  alone serves), ``vllm`` (prefix caching off), ``connector`` (KVCOMM, default settings: no estimated offsets, as nothing audits
  them on vLLM; finished requests kept inline, on the scheduler's path), ``connector-background-capture``
  (the same, kept on the broker's capture thread), ``connector-ahead`` (the connector with the client's prefill-ahead copies,
  ``kvcomm_vllm.text_ahead``: what ``VLLMEngine`` sends by default; each call is stepped as a
  stream and its copies, one token each, are added once its first token is out),
  ``connector-replies`` (those copies and
  the client's reply copies, ``kvcomm_vllm.reply_ahead``: each call is stepped as a stream and
  every 32 new reply ids a ``prefix_only`` one-token request per learned reader is added, as
  ``VLLMEngine`` sends them by default), ``connector-unaudited``
  (``kl_budget=None``: estimated offsets used unmeasured),
  ``hf`` (this SDK's HF engine, default).
- ``batch``: 8 graphs at once (each agent step of all 8 graphs submitted together, so vLLM
  batches them), whole-batch wall time: ``vllm``, ``connector``, and the HF engine serving the
  8 graphs one after the other (it serves one stream at a time).
- ``stream``: 8 graphs served as 8 users send them (each graph's next agent submitted the moment
  its predecessor finishes, graph ``g`` starting ``g * STAGGER`` engine steps after the first), so
  requests finish while others run: the whole set's wall time and each graph's, after a warm-up
  set; vLLM strategies without the client's copies (the copies ride on ``VLLMDriver``'s
  lockstep steps, which this phase does not use).
- ``fidelity``: per receiver call, each connector strategy's first-token distribution against vLLM
  dense on the same ids (full vocabulary).

``--time-hooks``: the ``ttft`` phase also times the connector's hooks per graph (planning,
loading, capture; :data:`HOOKS`), the graph's record holding the milliseconds of each.

Writes ``<out>/vllm_serving.json`` and prints the tables. The first ``--warmup`` graphs of every
strategy are excluded from the figures (anchors, own-text KV and prefixes fill there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.vllm_graphs import HOOKS, STAGGER, hf_graph, report_of, stream_graphs, timed_hooks, ttft_graph, with_hook_times
from benchmarks.vllm_turns import child_command, child_env, interleaved_ttft

AGENTS = 4
STRATEGIES = ("vllm-apc", "vllm-apc-copies", "vllm", "connector", "connector-background-capture", "connector-ahead",
              "connector-replies", "connector-unaudited", "hf")
#: strategies whose client sends copies (``VLLMDriver``'s stepped generate)
COPYING = ("vllm-apc-copies", "connector-ahead", "connector-replies")
#: the reference of every ratio: vLLM as it runs by default (prefix caching on)
REFERENCE = "vllm-apc"


# ---- one strategy, in its own process -------------------------------------------------------
def _workload(requests: int, offset: int, name: str = "b"):
    """(b) the GSM8K debate (the default), or (c) the RAG hand-off (``--workload c``: 3 agents,
    each reading the documents after its own system text)."""
    from benchmarks.workloads import gsm8k_debate, rag_handoff

    if name == "c":
        return rag_handoff(requests=requests, offset=offset).requests
    return gsm8k_debate(requests=requests, offset=offset, agents=AGENTS).requests


def _engine(strategy: str, time_hooks: bool = False):
    """``(engine, one graph's runner)`` for ``strategy``: vLLM in this process, or the HF engine;
    ``time_hooks``: the connector's hooks timed per graph (:func:`timed_hooks`)."""
    if strategy == "hf":
        import torch

        from kvcomm_agents import KVCommEngine

        torch.set_num_threads(2)
        return KVCommEngine.from_pretrained(dtype=torch.float32), hf_graph
    from kvcomm_agents.embedded import embedded_model_dir

    from benchmarks.vllm_driver import VLLMDriver

    if time_hooks and strategy.startswith("connector"):
        totals = timed_hooks()
        return VLLMDriver(strategy, str(embedded_model_dir())), with_hook_times(ttft_graph, totals)
    return VLLMDriver(strategy, str(embedded_model_dir())), ttft_graph


def serve(strategy: str, args) -> None:
    """A child of the interleaved ``ttft`` phase: load ``strategy``'s engine, say ``READY``, then
    run the graph whose index each stdin line names and print its records (``RESULT``), until
    stdin closes. It waits on stdin while the other strategies run: they never share the CPU."""
    engine, graph = _engine(strategy, args.time_hooks)
    requests = _workload(args.requests, args.offset, args.workload)
    print("READY", flush=True)
    for line in sys.stdin:
        index = int(line)
        print("RESULT " + json.dumps(graph(engine, requests[index], index, args.reply_tokens)), flush=True)


def run_vllm(strategy: str, phase: str, args) -> dict:
    engine, graph = _engine(strategy, args.time_hooks)
    requests = _workload(args.requests, args.offset, args.workload)
    records = []
    if phase == "ttft":
        for index, request in enumerate(requests):
            records += graph(engine, request, index, args.reply_tokens)
    elif phase == "batch":
        for group in range(2):  # a warm-up batch, then the measured one
            batch = requests[group * args.batch:(group + 1) * args.batch]
            replies = [[] for _ in batch]
            started = time.perf_counter()
            for k in range(AGENTS):
                prompts = [engine.ids(r.messages(k, replies[i])) for i, r in enumerate(batch)]
                outs = engine.generate(prompts, [r.agents[k] for r in batch], args.reply_tokens)
                for i, out in enumerate(outs):
                    replies[i].append(out.outputs[0].text)
            records.append({"group": group, "graphs": len(batch), "wall_s": time.perf_counter() - started})
    elif phase == "stream":
        for group in range(2):  # a warm-up set, then the measured one
            batch = requests[group * args.batch:(group + 1) * args.batch]
            records.append({"group": group, **stream_graphs(engine, batch, args.reply_tokens)})
    else:  # fidelity: the connector's claim against vLLM dense, same ids, full vocabulary
        import torch

        def first(ids, agent, reuse):
            out = engine.generate([ids], [agent], 1, reuse=reuse, logprobs=-1)[0]
            row = torch.full((len(engine.tokenizer),), float("-inf"), dtype=torch.float64)
            for token, entry in out.outputs[0].logprobs[0].items():
                row[token] = entry.logprob
            return row, report_of(out)

        for index, request in enumerate(requests):
            replies = []
            for k, agent in enumerate(request.agents):
                ids = engine.ids(request.messages(k, replies))
                served, report = first(ids, agent, True)
                dense, _ = first(ids, agent, False)
                finite = torch.isfinite(dense)
                kl = float(torch.sum(dense[finite].exp() * (dense[finite] - served[finite])))
                records.append({"graph": index, "agent_index": k + 1, "kl": kl,
                                "reused_tokens": report.get("reused_tokens", 0), "prompt_tokens": len(ids)})
                replies.append(engine.generate([ids], [agent], args.reply_tokens)[0].outputs[0].text)
    return {"strategy": strategy, "phase": phase, "records": records}


def run_hf(phase: str, args) -> dict:
    engine, graph = _engine("hf")
    requests = _workload(args.requests, args.offset, args.workload)
    records = []
    if phase == "ttft":
        for index, request in enumerate(requests):
            records += graph(engine, request, index, args.reply_tokens)
    elif phase == "batch":
        for group in range(2):
            batch = requests[group * args.batch:(group + 1) * args.batch]
            started = time.perf_counter()
            for i, request in enumerate(batch):
                records += [r for r in graph(engine, request, group * args.batch + i, args.reply_tokens)
                            if "wall_s" not in r]
            records.append({"group": group, "graphs": len(batch), "wall_s": time.perf_counter() - started})
    return {"strategy": "hf", "phase": phase, "records": records}


# ---- orchestration --------------------------------------------------------------------------
def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(results: list[dict], warmup: int) -> dict:
    """Per strategy: TTFT per agent index, graph wall time, token share; batch wall time;
    fidelity. Ratios are to vLLM as it runs by default (:data:`REFERENCE`, prefix caching on) from
    the same invocation."""
    table: dict = {"ttft": {}, "batch": {}, "stream": {}, "fidelity": {}}
    for result in results:
        strategy, phase, records = result["strategy"], result["phase"], result["records"]
        if phase == "ttft":
            calls = [r for r in records if "agent_index" in r and r["graph"] >= warmup]
            graphs = [r["wall_s"] for r in records if "wall_s" in r and r["graph"] >= warmup]
            table["ttft"][strategy] = {
                "ttft_s": {k: _median(r["ttft_s"] for r in calls if r["agent_index"] == k) for k in range(1, AGENTS + 1)},
                "graph_wall_s": _median(graphs),
                "token_share": sum(r["reused_tokens"] for r in calls) / max(sum(r["prompt_tokens"] for r in calls), 1),
            }
            timed = [r["hooks_ms"] for r in records if "hooks_ms" in r and r["graph"] >= warmup]
            if timed:
                table["ttft"][strategy]["hooks_ms"] = {name: _median(t[name] for t in timed) for name in HOOKS}
        elif phase == "batch":
            measured = [r for r in records if r.get("group") == 1]
            table["batch"][strategy] = {"graphs": measured[0]["graphs"], "wall_s": measured[0]["wall_s"]}
        elif phase == "stream":
            measured = [r for r in records if r.get("group") == 1][0]
            table["stream"][strategy] = {"graphs": measured["graphs"], "wall_s": measured["wall_s"],
                                         "graph_median_s": statistics.median(measured["graph_s"])}
        else:
            calls = [r for r in records if r["graph"] >= warmup and r["agent_index"] > 1]
            kls = [r["kl"] for r in calls if r.get("kl") is not None]
            table["fidelity"][strategy] = {"mean_kl": sum(kls) / len(kls) if kls else None, "calls": len(kls),
                                           "token_share": sum(r["reused_tokens"] for r in calls)
                                           / max(sum(r["prompt_tokens"] for r in calls), 1)}
    base = table["ttft"].get(REFERENCE)
    for strategy, row in table["ttft"].items():
        if base:
            row["speedup_vs_vllm"] = {k: (base["ttft_s"][k] / v if v else None) for k, v in row["ttft_s"].items()}
            row["graph_speedup_vs_vllm"] = base["graph_wall_s"] / row["graph_wall_s"]
    stream_base = table["stream"].get(REFERENCE)
    for row in table["stream"].values():
        if stream_base:
            row["speedup_vs_vllm"] = stream_base["wall_s"] / row["wall_s"]
            row["graph_speedup_vs_vllm"] = stream_base["graph_median_s"] / row["graph_median_s"]
    for row in table["batch"].values():
        row["graphs_per_s"] = row["graphs"] / row["wall_s"]
    hf = table["batch"].get("hf")
    for row in table["batch"].values():
        if hf:
            row["throughput_vs_hf"] = row["graphs_per_s"] / hf["graphs_per_s"]
    return table


def print_tables(table: dict, workload: str = "b") -> None:
    print(f"\n({workload}) on vLLM, one graph at a time: median TTFT per agent index (speed-up vs vLLM with its prefix cache)")
    print(f"{'strategy':<11} " + " ".join(f"{'agent ' + str(k):>17}" for k in range(1, AGENTS + 1))
          + f" {'graph wall':>16} {'from cache':>10}")
    for strategy, row in table["ttft"].items():
        cells = []
        for k in range(1, AGENTS + 1):
            ttft, speed = row["ttft_s"][k], row.get("speedup_vs_vllm", {}).get(k)
            cells.append(f"{ttft * 1000:8.0f} ms" + (f" {speed:5.2f}x" if speed else " " * 7) if ttft else " " * 17)
        wall, wall_speed = row["graph_wall_s"], row.get("graph_speedup_vs_vllm")
        share = f"{row['token_share']:.0%}"
        print(f"{strategy:<11} " + " ".join(cells) + f" {wall:7.2f} s {wall_speed or 0:5.2f}x {share:>10}")
    for strategy, row in table["ttft"].items():
        if "hooks_ms" in row:
            print(f"{strategy}: median ms per graph in the connector's hooks: "
                  + ", ".join(f"{name} {ms:.0f}" for name, ms in row["hooks_ms"].items())
                  + f" (graph {row['graph_wall_s'] * 1000:.0f})")
    if table["batch"]:
        print("\n8 graphs at once: wall time and throughput against the HF engine (one stream at a time)")
        for strategy, row in table["batch"].items():
            print(f"{strategy:<11} {row['wall_s']:8.1f} s  {row['graphs_per_s']:.3f} graphs/s"
                  + (f"  {row['throughput_vs_hf']:.2f}x HF" if "throughput_vs_hf" in row else ""))
    if table["stream"]:
        n = next(iter(table["stream"].values()))["graphs"]
        print(f"\n{n} graphs as {n} users send them (staggered by {STAGGER} steps): the set's wall time and the median "
              "graph's (speed-up vs vLLM with its prefix cache)")
        for strategy, row in table["stream"].items():
            print(f"{strategy:<24} {row['wall_s']:8.1f} s {row.get('speedup_vs_vllm') or 0:5.2f}x   "
                  f"graph {row['graph_median_s']:6.1f} s {row.get('graph_speedup_vs_vllm') or 0:5.2f}x")
    if table["fidelity"]:
        print("\nfidelity, receivers (agent index > 1): mean first-token KL against dense on the same ids")
        for strategy, row in table["fidelity"].items():
            kl = row["mean_kl"]
            print(f"{strategy:<11} KL {kl:.4f} over {row['calls']} calls, {row['token_share']:.0%} of prompt tokens from cache"
                  if kl is not None else f"{strategy:<11} no KL measured")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/out/vllm")
    parser.add_argument("--phases", default="ttft,batch,fidelity")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--workload", choices=("b", "c"), default="b",
                        help="b: the GSM8K debate; c: the RAG hand-off (ttft and fidelity phases)")
    parser.add_argument("--hf-python", default=".venv/bin/python", help="interpreter for the HF engine (needs accelerate)")
    parser.add_argument("--summarize", default=None, help="print the tables of an earlier run's JSON")
    parser.add_argument("--time-hooks", action="store_true",
                        help="time the connector's hooks (planning, loading, capture) per graph in the ttft phase")
    parser.add_argument("--sequential", action="store_true",
                        help="ttft phase: each strategy's graphs in a process of its own, one strategy after another "
                             "(by default the strategies take turns graph by graph)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "strategy:phase", run in a child process
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # a strategy: an interleaved ttft child
    args = parser.parse_args(argv)
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        table = summarize(saved["results"], args.warmup)
        saved["summary"] = table
        Path(args.summarize).write_text(json.dumps(saved, indent=1, default=str))
        print_tables(table)
        return
    if args.serve:
        serve(args.serve, args)
        return
    if args.one:
        strategy, phase = args.one.split(":")
        result = run_hf(phase, args) if strategy == "hf" else run_vllm(strategy, phase, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strategies = args.strategies.split(",")
    results = []
    for phase in args.phases.split(","):
        if phase == "ttft" and not args.sequential:
            results += interleaved_ttft(strategies, args, out)
            continue
        if phase in ("batch", "stream"):
            args_requests = max(args.requests, 2 * args.batch)
        for strategy in strategies:
            if phase == "batch" and strategy == "vllm-apc":
                continue
            if phase == "stream" and (strategy == "hf" or strategy in COPYING):
                continue  # the HF engine serves one stream at a time; copies need the lockstep driver
            if phase == "fidelity" and not strategy.startswith("connector"):
                continue  # the HF engine's own fidelity is in benchmarks/LAB.md (its audits)
            requests = args_requests if phase in ("batch", "stream") else args.requests
            print(f"running {strategy} / {phase} ...", flush=True)
            started = time.perf_counter()
            done = subprocess.run(child_command(strategy, args, requests, ["--one", f"{strategy}:{phase}"]),
                                  capture_output=True, text=True, env=child_env())
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{strategy}/{phase} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
            print(f"  {time.perf_counter() - started:.0f} s", flush=True)
    (out / "vllm_serving.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    table = summarize(results, args.warmup)
    (out / "vllm_serving.json").write_text(json.dumps({"args": vars(args), "summary": table, "results": results},
                                                      indent=1, default=str))
    print_tables(table, args.workload)


if __name__ == "__main__":
    main()
