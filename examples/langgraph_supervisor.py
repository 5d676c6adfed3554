"""LangGraph supervisor team that hands the full history from agent to agent.

A supervisor node routes with ``Command(goto=...)`` through a fixed plan (researcher -> analyst
-> writer; a 135M model cannot be trusted to route, so the route is data, the words are the
model's). Every agent, the supervisor included, sees the whole conversation so far: the user's
problem and every earlier agent's message. That is where KV reuse pays most: each prompt is
almost entirely text other agents already processed.

    python -m examples.langgraph_supervisor [--questions 2] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import time
from typing import Literal

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command

from .tasks import gold_answer, gsm8k_questions, last_number
from kvcomm_langgraph import ChatKVComm

from .reporting import add_engine_arguments, paired_graphs, print_agent_table

ROLES = {
    "researcher": "You are the researcher. List the facts and numbers the problem gives, nothing else.",
    "analyst": "You are the analyst. Using the researcher's facts, compute the answer step by step.",
    "writer": "You are the writer. State the final answer as one sentence ending with the number.",
}
PLAN = ["researcher", "analyst", "writer"]


class TeamState(MessagesState):
    step: int


def build_graph(model: ChatKVComm):
    def supervisor(state: TeamState) -> Command[Literal["researcher", "analyst", "writer", "__end__"]]:
        step = state.get("step", 0)
        if step >= len(PLAN):
            return Command(goto=END)
        worker = PLAN[step]
        note = model.invoke([SystemMessage(f"You are the supervisor. In one short sentence, tell the {worker} "
                                           "what to do next."), *state["messages"]])
        note.name = "supervisor"
        return Command(goto=worker, update={"messages": [note], "step": step + 1})

    def make_worker(role: str):
        def worker(state: TeamState):
            reply = model.invoke([SystemMessage(ROLES[role]), *state["messages"]])
            reply.name = role
            return Command(goto="supervisor", update={"messages": [reply]})
        return worker

    graph = StateGraph(TeamState)
    graph.add_node("supervisor", supervisor)
    for role in PLAN:
        graph.add_node(role, make_worker(role))
    graph.add_edge(START, "supervisor")
    return graph.compile()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    graphs, recorders = paired_graphs(build_graph, args)
    questions = gsm8k_questions(args.questions)
    agree = correct = 0
    for i, row in enumerate(questions, 1):
        finals = {}
        for name, graph in graphs.items():
            out = graph.invoke({"messages": [HumanMessage(row["question"])], "step": 0}, {"callbacks": [recorders[name]]})
            finals[name] = last_number(out["messages"][-1].content)
        gold = gold_answer(row)
        agree += finals["reuse"] == finals["dense"]
        correct += finals["reuse"] == gold
        print(f"question {i}/{len(questions)}: writer says {finals['reuse']} (dense pipeline {finals['dense']}, gold {gold})")
    print_agent_table(recorders["reuse"].calls, recorders["dense"].calls)
    print(f"final numbers equal to the dense pipeline's: {agree}/{len(questions)}; correct: {correct}/{len(questions)}")
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
