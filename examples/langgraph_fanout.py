"""LangGraph fan-out: analysts read one document in parallel branches, then a writer sums up.

``Send`` gives every analyst the same instruction and the same documentation page, with a
question each; LangGraph runs the branches at once, in threads, so the analysts call the shared
engine together. The first to plan computes the page; the others, planned while it still
answers, read it from that call (an exact prefix: their prompts begin alike), so the page is
computed once per graph instead of once per analyst. Each pipeline runs in turn on the same
pages: the output gives its whole-graph time, the tokens it forwarded, and each agent's reuse.

    python -m examples.langgraph_fanout [--pages 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import operator
import time
from typing import Annotated, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from kvcomm_langgraph import ChatKVComm

from .reporting import add_engine_arguments, paired_graphs, print_agent_table, print_graph_totals
from .tasks import stdlib_doc

QUESTIONS = ("What does this module do, in one sentence?", "Name two functions it offers.",
             "What is one mistake a user of it could make?", "Which function would you use first?")
PAGES = ("json", "shutil", "pathlib", "itertools", "functools")


class Fan(TypedDict):
    page: str
    answers: Annotated[list, operator.add]
    summary: str


def build_graph(model: ChatKVComm, questions=QUESTIONS):
    def analyst(state: dict):
        reply = model.invoke([SystemMessage("You answer questions about a Python module from its documentation."),
                              HumanMessage(f"Documentation:\n{state['page']}\n\nQuestion: {state['question']}")])
        return {"answers": [(state["question"], reply.content)]}

    def writer(state: Fan):
        notes = "\n".join(f"- {answer}" for _, answer in sorted(state["answers"]))
        reply = model.invoke([SystemMessage("You sum up your analysts' answers in two sentences."), HumanMessage(notes)])
        return {"summary": reply.content}

    graph = StateGraph(Fan)
    graph.add_node("analyst", analyst)
    graph.add_node("writer", writer)
    graph.add_conditional_edges(START, lambda s: [Send("analyst", {"page": s["page"], "question": q}) for q in questions],
                                ["analyst"])
    graph.add_edge("analyst", "writer")
    graph.add_edge("writer", END)
    return graph.compile()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    graphs, recorders = paired_graphs(build_graph, args)
    cost = {name: [] for name in graphs}  # per page: (wall s, tokens forwarded)
    same = 0
    pages = [PAGES[i % len(PAGES)] for i in range(args.pages)]
    for i, name in enumerate(pages, 1):
        summaries = {}
        for pipeline, graph in graphs.items():
            recorder = recorders[pipeline]
            before, tick = len(recorder.calls), time.perf_counter()
            out = graph.invoke({"page": stdlib_doc(name, max_chars=3000), "answers": []}, {"callbacks": [recorder]})
            cost[pipeline].append((time.perf_counter() - tick, sum(c.forwarded.total for c in recorder.calls[before:])))
            summaries[pipeline] = out["summary"]
        same += summaries["reuse"] == summaries["dense"]
        print(f"page {i}/{len(pages)} ({name}): summary {'equal to' if summaries['reuse'] == summaries['dense'] else 'differs from'} "
              "the dense pipeline's")
    print_graph_totals(cost["reuse"], cost["dense"])
    print_agent_table(recorders["reuse"].calls, recorders["dense"].calls)
    print(f"summaries equal to the dense pipeline's: {same}/{len(pages)}")
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
