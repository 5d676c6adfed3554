"""Parallel branches: real LangGraph fan-outs whose branches run at once, the whole graph timed.

LangGraph runs a ``Send`` fan-out's branches (and several edges out of one node) in threads, so
sibling agents call the engine together, each planning while the others decode. The graph
protocol (:mod:`.graph`) runs agents one at a time and cannot show what that costs; this runs the
graph itself through ``ChatKVComm``, each strategy's engine in turn per request (same model, same
inputs, greedy), and measures what a user waits for: the graph's wall time, the tokens forwarded
(counted on the model, :class:`~.graph.ModelMeter`), how many replies equal dense's, and the
first-token KL against dense of every call whose prompt dense saw too (the branches always; the
aggregator where every branch answered as under dense).

Two shapes, four branches then an aggregator, on a reference page of the split (pydoc text of a
standard-library module, about 400-700 tokens):

- ``map``: one instruction and the page to every branch, a different question each (a map over
  questions); the aggregator reads the branches' answers;
- ``roles``: a different role per branch (planner, reviewer, tester, simplifier), the same page
  and coding task; the aggregator (the coder) reads their notes.

Strategies: dense (plain transformers: every call steps its decode alone), dense with the
siblings' decode steps batched (``dense-batched``, :mod:`kvcomm_agents.batched_decode`), exact
prefix, re-rotation only, the default with siblings planned against the store alone
(``kvcomm-mean-no-siblings``, switched off through the engine's seam: close to, not exactly, the
engine before :mod:`kvcomm_agents.in_flight`), the default with every call stepping alone
(``kvcomm-mean-steps-alone``), and the default.

    python -m benchmarks.parallel_branches [--split report] [--requests 4] [--warmup 1]
                                           [--shapes map,roles] [--reply-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import operator
import platform
import statistics
import time
from pathlib import Path
from typing import Annotated, Callable, TypedDict

import torch

from examples.reporting import CallRecorder
from examples.tasks import stdlib_doc
from kvcomm_agents.engines.weight_layout import host_cpu
from kvcomm_agents.fidelity import first_token_kl

from .formats import CODERS, REFERENCE_CHARS, REFERENCE_PAGES
from .graph import ModelMeter
from .graphs import humaneval_rows
from .models import load
from .provenance import device_text, git_commit
from .strategies import build

__all__ = ["STRATEGIES", "run", "summarize", "table", "described"]

QUESTIONS = ("What does this module do, in one sentence?", "Name two functions it offers.",
             "What is one mistake a user of it could make?", "Which function would you use first, and why?")
ROLES = ("planner", "reviewer", "tester", "simplifier")
STRATEGIES = ("dense", "dense-batched", "prefix", "rerotate", "kvcomm-mean-no-siblings", "kvcomm-mean-steps-alone",
              "kvcomm-mean")


class Fan(TypedDict):
    page: str
    task: str
    notes: Annotated[list, operator.add]
    final: str


def _graph(model, shape: str):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    def branch(state: dict):
        k = state["k"]
        if shape == "map":
            messages = [SystemMessage("You answer questions about a Python module from its documentation."),
                        HumanMessage(f"Documentation:\n{state['page']}\n\nQuestion: {QUESTIONS[k]}")]
        else:
            messages = [SystemMessage(CODERS[ROLES[k]]),
                        HumanMessage(f"Reference:\n{state['page']}\n\nTask:\n{state['task']}")]
        return {"notes": [(k, model.invoke(messages).content)]}

    def aggregator(state: Fan):
        notes = "\n\n".join(f"Note {k + 1}: {text}" for k, text in sorted(state["notes"]))
        system = ("You summarize your team's answers in two sentences." if shape == "map"
                  else CODERS["coder"])
        task = "" if shape == "map" else f"Task:\n{state['task']}\n\n"
        reply = model.invoke([SystemMessage(system), HumanMessage(f"{task}Team notes:\n{notes}")])
        return {"final": reply.content}

    graph = StateGraph(Fan)
    graph.add_node("branch", branch)
    graph.add_node("aggregator", aggregator)
    graph.add_conditional_edges(START, lambda s: [Send("branch", {**s, "k": k}) for k in range(4)], ["branch"])
    graph.add_edge("branch", "aggregator")
    graph.add_edge("aggregator", END)
    return graph.compile()


def inputs(split: str, requests: int) -> list[dict]:
    """Per request: a reference page of ``split`` and a coding task of ``split``'s HumanEval range."""
    pages = REFERENCE_PAGES[split]
    tasks = [row["prompt"] for _, row in humaneval_rows(split, 0, requests)]
    return [{"page": stdlib_doc(pages[r % len(pages)], max_chars=2 * REFERENCE_CHARS), "task": tasks[r], "notes": []}
            for r in range(requests)]


def _strategy(name: str, model, tokenizer):
    if name == "kvcomm-mean-no-siblings":
        strategy = build("kvcomm-mean", model, tokenizer)
        strategy.engine._calls.in_flight.share_with = lambda ids: None  # siblings planned against the store alone
        strategy.name = name
    else:
        strategy = build(name, model, tokenizer)
    strategy.first_logits = _recording_first_logits(strategy.engine)
    return strategy


def _recording_first_logits(engine) -> dict:
    """Wrap ``engine``'s token picker to keep each call's first-token logits, by prompt (the
    branches' prompts are the same under every strategy: their KL against dense's is taken on
    the same ids). Reads what the call computed anyway: nothing is forwarded for it."""
    kept: dict = {}
    generate = engine._generate

    def recorded(messages, agent, max_new_tokens, sampler, *rest):
        key = json.dumps(list(messages), sort_keys=True, default=str)

        def pick(logits: torch.Tensor) -> int:
            kept.setdefault(key, logits.detach().float().cpu())
            return sampler(logits)
        return generate(messages, agent, max_new_tokens, pick, *rest)

    engine._generate = recorded
    return kept


def _batcher(strategy):
    """The strategy's engine's decode batcher (None where its calls step alone)."""
    calls = getattr(getattr(strategy, "engine", None), "_calls", None)
    return getattr(getattr(calls, "decoding", None), "batcher", None)


def run(shape: str, strategies: list, requests: list[dict], warmup: int, reply_tokens: int,
        meter: ModelMeter, progress: Callable[[str], None] = print, at_once: int = 1) -> list[dict]:
    """Each request through every strategy's graph in turn; one record per (request, strategy).
    ``at_once`` > 1: each group of that many requests runs at once (``graph.batch``: LangGraph
    runs the graphs in threads, as a server answering several users does); a record per group."""
    from kvcomm_langgraph import ChatKVComm

    graphs = {s.name: _graph(ChatKVComm(engine=s.engine, max_tokens=reply_tokens), shape) for s in strategies}
    records = []
    for r in range(len(requests) // at_once):
        group = [dict(state, notes=[]) for state in requests[r * at_once:(r + 1) * at_once]]
        replies = {}
        for s in strategies:
            recorder = CallRecorder()
            s.first_logits.clear()
            batcher = _batcher(s)
            missed = batcher.missed_windows if batcher is not None else 0
            with meter.measuring() as tokens:
                started = time.perf_counter()
                outs = (graphs[s.name].batch(group, config={"callbacks": [recorder]}) if at_once > 1
                        else [graphs[s.name].invoke(group[0], config={"callbacks": [recorder]})])
                wall = time.perf_counter() - started
            texts = [text for out in outs for text in [t for _, t in sorted(out["notes"])] + [out["final"]]]
            replies[s.name] = texts
            calls = recorder.calls
            dense_logits = strategies[0].first_logits  # this request's: dense runs first
            kl = [first_token_kl(dense_logits[key], logits) for key, logits in s.first_logits.items() if key in dense_logits]
            records.append({
                "shape": shape, "request": r, "warmup": r < warmup, "strategy": s.name, "wall_s": wall,
                "branch_kl": kl,
                "tokens": tokens[0], "equal_to_dense": sum(a == b for a, b in zip(texts, replies["dense"])),
                "replies": len(texts), "prompt_tokens": sum(c.prompt_tokens for c in calls),
                "reused_tokens": sum(c.reused_tokens for c in calls),
                "branch_ttft_s": [c.ttft_s for c in calls if c.agent == "branch"],
                # calls a batching leader waited its whole window for in vain (batched_decode)
                "missed_windows": (batcher.missed_windows - missed) if batcher is not None else 0,
            })
            progress(f"{shape} request {r} {s.name}: {wall:.2f} s, {tokens[0]} tokens")
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per shape and strategy over the timed requests: wall and tokens as ratios to dense's on the
    same requests (the median of per-request ratios), replies equal to dense's."""
    out = []
    timed = [r for r in records if not r["warmup"]]
    for shape in dict.fromkeys(r["shape"] for r in timed):
        dense = {r["request"]: r for r in timed if r["shape"] == shape and r["strategy"] == "dense"}
        for name in dict.fromkeys(r["strategy"] for r in timed if r["shape"] == shape):
            rows = [r for r in timed if r["shape"] == shape and r["strategy"] == name]
            out.append({
                "shape": shape, "strategy": name, "requests": len(rows),
                "dense_wall_s": statistics.median(dense[r["request"]]["wall_s"] for r in rows),
                "speedup_vs_dense": statistics.median(dense[r["request"]]["wall_s"] / r["wall_s"] for r in rows),
                "tokens_vs_dense": sum(r["tokens"] for r in rows) / sum(dense[r["request"]]["tokens"] for r in rows),
                "from_cache": sum(r["reused_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows)),
                "equal_to_dense": f"{sum(r['equal_to_dense'] for r in rows)}/{sum(r['replies'] for r in rows)}",
                "branch_ttft_median_s": statistics.median(t for r in rows for t in r["branch_ttft_s"]),
                "missed_windows": sum(r.get("missed_windows", 0) for r in rows),
                "kl_mean": statistics.fmean(k for r in rows for k in r["branch_kl"]),
                "kl_calls": sum(len(r["branch_kl"]) for r in rows),
            })
    return out


def table(summary: list[dict]) -> str:
    lines = ["| shape | strategy | graph × dense | tokens × dense | prompt from cache | first-token KL (calls) | "
             "replies equal to dense | branches' median TTFT s |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['shape']} | {s['strategy']} | {s['speedup_vs_dense']:.2f}x | {s['tokens_vs_dense']:.2f}x | "
                     f"{s['from_cache']:.0%} | {s['kl_mean']:.4f} ({s['kl_calls']}) | {s['equal_to_dense']} | "
                     f"{s['branch_ttft_median_s']:.2f} |")
    return "\n".join(lines)


def described(summary: dict) -> str:
    """The run's sample, then :func:`table` (what ``benchmarks.tables`` puts in the docs)."""
    k = summary.get("at_once", 1)
    at_once = f", {k} requests' graphs at once (a request here: a group of {k})" if k > 1 else ""
    return (f"Run: commit `{(summary['commit'] or '?')[:12]}`, {summary['model']} model, float32, "
            f"{device_text(summary)}, {summary['split']} range, {summary['requests']} timed requests per "
            f"shape after {summary['warmup']}{at_once}, replies of at most {summary['reply_tokens']} tokens.\n\n"
            + table(summary["summary"]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--split", choices=["dev", "report"], default="report")
    parser.add_argument("--requests", type=int, default=4, help="timed requests per shape")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shapes", default="map,roles")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--at-once", type=int, default=1,
                        help="requests whose graphs run at once (graph.batch), as a server answering several users")
    parser.add_argument("--out", default="benchmarks/out/parallel_branches.json")
    args = parser.parse_args(argv)
    loaded = load(args.model, device="cpu", dtype=torch.float32)
    meter = ModelMeter(loaded.model)
    names = [n for n in args.strategies.split(",") if n]
    if names[0] != "dense":
        raise SystemExit("the first strategy must be dense (the others are compared with it)")
    requests = inputs(args.split, (args.warmup + args.requests) * args.at_once)
    records = []
    for shape in args.shapes.split(","):
        strategies = [_strategy(n, loaded.model, loaded.tokenizer) for n in names]  # fresh per shape
        records += run(shape, strategies, requests, args.warmup, args.reply_tokens, meter, at_once=args.at_once)
    summary = summarize(records)
    print(table(summary))
    commit = git_commit()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "parallel_branches", "commit": commit, "model": loaded.tag, "split": args.split,
                               "threads": torch.get_num_threads(), "cpu": host_cpu(), "python": platform.python_version(),
                               "torch": torch.__version__, "requests": args.requests, "warmup": args.warmup,
                               "reply_tokens": args.reply_tokens, "at_once": args.at_once, "summary": summary,
                               "records": records}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
