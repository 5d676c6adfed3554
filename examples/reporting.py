"""Shared by the LangGraph examples: record every model call of a graph run (a LangChain
callback handler, so the graph code stays plain) and print the per-agent table.

Each example runs its pipeline twice on the same inputs: on a reuse engine and on a dense
engine (reuse off) on its own copy of the same weights, as loaded. The table pairs them per agent: reused share
of the prompt, time to first token with reuse and dense (measured in the same run), and the
reuse decisions; the examples then compare final answers with the dense pipeline's.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any, Callable

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.outputs import LLMResult

from kvcomm_agents import CallStats, KVCommConfig, KVCommEngine, ReuseSummary
from kvcomm_langgraph import ChatKVComm

__all__ = ["CallRecorder", "engines", "paired_graphs", "print_agent_table", "print_graph_totals", "add_engine_arguments", "config_from"]


class CallRecorder(BaseCallbackHandler):
    """Collects the ``CallStats`` of every ``ChatKVComm`` call it sees, in order."""

    def __init__(self) -> None:
        self.calls: list[CallStats] = []
        self._lock = threading.Lock()

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        for generations in response.generations:
            for generation in generations:
                meta = getattr(generation, "message", None)
                kvcomm = (meta.response_metadata or {}).get("kvcomm") if meta is not None else None
                if kvcomm:
                    with self._lock:
                        self.calls.append(CallStats.model_validate(kvcomm["stats"]))


def add_engine_arguments(parser) -> None:
    """``--method``: how the reuse engine reuses shared text (default: the library's)."""
    parser.add_argument("--method", choices=["kvcomm", "rerotate", "exact_prefix"], default=KVCommConfig().method,
                        help="'rerotate' = re-rotation only: reuses from the first call, no anchor warm-up")


def config_from(args) -> KVCommConfig:
    return KVCommConfig(method=args.method)


def engines(config: KVCommConfig | None = None) -> tuple[KVCommEngine, KVCommEngine]:
    """A reuse engine on the embedded model and a dense engine on its own copy of the weights,
    left as loaded: plain transformers, every call prefilling its whole prompt and stepping its
    decode alone (the reuse engine may lay its copy out for the CPU: ``weight_layout``)."""
    reuse = KVCommEngine.from_pretrained(config=config)
    dense = KVCommEngine.from_pretrained(config=KVCommConfig.plain_transformers())
    for engine in (reuse, dense):  # first-call overheads off the measured calls
        engine.chat([{"role": "user", "content": "Say hi."}], agent="warm-up", max_new_tokens=2)
        engine.store.clear()
    return reuse, dense


def paired_graphs(build: Callable[[ChatKVComm], Any], args) -> tuple[dict, dict[str, CallRecorder]]:
    """The example's graph on a reuse engine and on a dense one (:func:`engines`, the method from
    ``args``), keyed ``"reuse"`` and ``"dense"``, with a :class:`CallRecorder` each;
    ``build``: chat model -> compiled graph."""
    reuse_engine, dense_engine = engines(config_from(args))
    graphs = {name: build(ChatKVComm(engine=engine, max_tokens=args.max_tokens))
              for name, engine in (("reuse", reuse_engine), ("dense", dense_engine))}
    return graphs, {name: CallRecorder() for name in graphs}


def _decisions(calls: list[CallStats]) -> str:
    counts = Counter(f"{d.status}:{d.reason}" for call in calls for d in call.decisions)
    return ", ".join(f"{n}x {key}" for key, n in sorted(counts.items())) or "-"


def print_agent_table(reuse_calls: list[CallStats], dense_calls: list[CallStats]) -> None:
    """Per agent, in order of first appearance: calls, prompt tokens, reused share, mean time to
    first token with reuse and dense, the ratio, the reply's ids kept from drafts (generated
    without a decode step of their own), and the reuse decisions."""
    by_agent: dict[str, list[CallStats]] = defaultdict(list)
    dense_by_agent: dict[str, list[CallStats]] = defaultdict(list)
    for call in reuse_calls:
        by_agent[call.agent].append(call)
    for call in dense_calls:
        dense_by_agent[call.agent].append(call)
    head = (f"{'agent':<16} {'calls':>5} {'prompt':>6} {'reused':>6} {'TTFT reuse':>10} {'TTFT dense':>10} "
            f"{'speed-up':>8} {'call reuse':>10} {'call dense':>10} {'drafted':>7}  decisions")
    print("\n" + head)
    for agent, calls in by_agent.items():
        dense = dense_by_agent.get(agent, [])
        prompt = sum(c.prompt_tokens for c in calls) / len(calls)
        share = sum(c.reused_tokens for c in calls) / max(1, sum(c.prompt_tokens for c in calls))
        ttft = 1000 * sum(c.ttft_s for c in calls) / len(calls)
        dense_ttft = 1000 * sum(c.ttft_s for c in dense) / len(dense) if dense else float("nan")
        opted = " (reuse off)" if all(c.opted_out for c in calls) else ""
        drafted = sum(c.accepted_tokens for c in calls) / max(1, sum(c.generated_tokens for c in calls))
        whole = sum(c.total_s for c in calls) / len(calls)
        dense_whole = sum(c.total_s for c in dense) / len(dense) if dense else float("nan")
        print(f"{agent:<16} {len(calls):>5} {prompt:>6.0f} {100 * share:>5.0f}% {ttft:>8.0f}ms {dense_ttft:>8.0f}ms "
              f"{dense_ttft / ttft:>7.2f}x {whole:>9.2f}s {dense_whole:>9.2f}s {100 * drafted:>6.0f}%  "
              f"{_decisions(calls)}{opted}")
    summary = ReuseSummary.of(reuse_calls)
    rate = "-" if summary.reuse_rate is None else f"{100 * summary.reuse_rate:.0f}%"
    print(f"prompt tokens from cache {100 * summary.token_share:.0f}%; calls that computed none of their shared "
          f"text {summary.fully_reused}/{summary.eligible} (reuse rate {rate}; {summary.opted_out} opted out: short "
          "texts are computed on purpose). TTFT and call (the whole call, prompt to last token): means per "
          "agent, the dense pipeline ran on a second engine in the same process. drafted: the replies' ids "
          "kept from drafts (no decode step of their own).")


def print_graph_totals(reuse: list[tuple[float, int]], dense: list[tuple[float, int]]) -> None:
    """What a user waits for and what it costs: per pipeline, the mean whole-graph wall time and
    tokens forwarded through the model per question (``(seconds, tokens)`` per question, the two
    pipelines run in turns on the same questions), and their ratios."""
    if not reuse or not dense:
        return
    wall = [sum(w for w, _ in runs) / len(runs) for runs in (reuse, dense)]
    tokens = [sum(t for _, t in runs) / len(runs) for runs in (reuse, dense)]
    print(f"whole graph per question: reuse {wall[0]:.1f} s, dense {wall[1]:.1f} s ({wall[1] / wall[0]:.2f}x); "
          f"tokens forwarded: reuse {tokens[0]:,.0f}, dense {tokens[1]:,.0f} ({tokens[0] / tokens[1]:.2f} of dense's; "
          "prompt computed + decoded + copies + audits)")
