"""LangGraph math debate on GSM8K: fully connected solvers, then a judge that opts out of reuse.

The graph: solver_1 -> solver_2 -> ... -> solver_N -> judge. Every solver sees the question and
every earlier solver's reply (the shared message history of ``MessagesState``); the judge
(``@kvcomm_agent("judge", reuse=False)``, as the KVCOMM paper's setting and arXiv 2601.08343
advise for decision agents) reads them all and states the final number. Agents are named by
their LangGraph nodes; nobody passes KV or references by hand.

The pipeline runs twice per question, with reuse and dense (reuse off, same weights), taking
turns; the output gives each pipeline's whole-graph wall time and the tokens it forwarded through
the model (copies and audits included), then the time to first token per agent, and the final
answers against the dense pipeline's. The first ``--warmup`` questions fill KVCOMM's anchor pools
(each agent prefills what it has not seen enough of, and records it); they are reported apart.

    python -m examples.langgraph_debate [--questions 5] [--warmup 2] [--solvers 3] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import time

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from .tasks import gold_answer, gsm8k_questions, last_number
from kvcomm_agents import ReuseSummary
from kvcomm_langgraph import ChatKVComm, kvcomm_agent

from .reporting import (CallRecorder, add_engine_arguments, config_from, paired_graphs, print_agent_table,
                        print_graph_totals)


def solver_prompt(k: int, n: int, history: list) -> list:
    """Solver k's view: its role, the question, earlier solvers' replies labelled by name."""
    system = SystemMessage(f"You are solver {k} of {n} in a team solving a math word problem. Reason step by "
                           "step, check the other solvers' answers, and end with the final number.")
    return [system, *history]


def build_graph(model: ChatKVComm, solvers: int):
    graph = StateGraph(MessagesState)

    def make_solver(k: int):
        def solver(state: MessagesState):
            reply = model.invoke(solver_prompt(k, solvers, state["messages"]))
            reply.name = f"solver_{k}"
            return {"messages": [reply]}
        return solver

    @kvcomm_agent("judge", reuse=False)
    def judge(state: MessagesState):
        system = SystemMessage("You are the judge. Read the solvers' answers and reply with the final number only.")
        return {"messages": [model.invoke([system, *state["messages"]])]}

    previous = START
    for k in range(1, solvers + 1):
        graph.add_node(f"solver_{k}", make_solver(k))
        graph.add_edge(previous, f"solver_{k}")
        previous = f"solver_{k}"
    graph.add_node("judge", judge)
    graph.add_edge(previous, "judge")
    graph.add_edge("judge", END)
    return graph.compile()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="questions that fill the anchor pools first")
    parser.add_argument("--solvers", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    graphs, recorders = paired_graphs(lambda model: build_graph(model, args.solvers), args)
    warmup = {name: CallRecorder() for name in graphs}
    agree = correct = 0
    graphs_cost = {name: [] for name in graphs}  # per measured question: (wall s, tokens forwarded)
    questions = gsm8k_questions(args.questions)
    print(f"{len(questions)} GSM8K questions, {args.solvers} solvers + judge, greedy, max {args.max_tokens} tokens; "
          f"method={config_from(args).method}")
    for i, row in enumerate(questions, 1):
        finals = {}
        for name, graph in graphs.items():
            recorder = (warmup if i <= args.warmup else recorders)[name]
            before, tick = len(recorder.calls), time.perf_counter()
            out = graph.invoke({"messages": [HumanMessage(row["question"])]}, {"callbacks": [recorder]})
            wall = time.perf_counter() - tick
            if i > args.warmup:
                graphs_cost[name].append((wall, sum(c.forwarded.total for c in recorder.calls[before:])))
            finals[name] = last_number(out["messages"][-1].content)
        gold = gold_answer(row)
        agree += finals["reuse"] == finals["dense"]
        correct += finals["reuse"] == gold
        print(f"question {i}/{len(questions)}: judge says {finals['reuse']} (dense pipeline {finals['dense']}, gold {gold})")
    if args.warmup:
        summary = ReuseSummary.of(warmup["reuse"].calls)
        print(f"\nwarm-up (questions 1-{min(args.warmup, len(questions))}): token share {100 * summary.token_share:.0f}%, "
              f"{sum(d.reason == 'new_anchor' for c in warmup['reuse'].calls for d in c.decisions)} new anchors recorded")
    if recorders["reuse"].calls:
        print(f"\nafter warm-up (questions {args.warmup + 1}-{len(questions)}):")
        print_graph_totals(graphs_cost["reuse"], graphs_cost["dense"])
        print_agent_table(recorders["reuse"].calls, recorders["dense"].calls)
    print(f"final answers equal to the dense pipeline's: {agree}/{len(questions)}; correct: {correct}/{len(questions)} "
          "(SmolLM2-135M solves few GSM8K problems; the point is speed at equal output)")
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
