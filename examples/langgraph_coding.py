"""LangGraph coding pipeline on HumanEval-style problems: planner, coder, tester, reviewer, fixer.

planner -> coder -> tester -> reviewer -> fixer -> final test. The tester is plain code: it runs
the model-written function against the problem's tests with ``examples/sandbox.py`` (``python -I``
with a timeout, capped output, resource limits and, on Linux, an unprivileged uid, no network, a
read-only filesystem but for its working folder and a PID namespace; what each platform gets is
listed there) and returns the output as a ``tool`` message, which the reviewer and the fixer both
read (the fixer reuses it from the cache). Accuracy is the final pass rate; agreement compares the
reuse pipeline's final code with the dense pipeline's.

    python -m examples.langgraph_coding [--problems 3] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import re
import time
import uuid
from typing import TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, StateGraph

from kvcomm_langgraph import ChatKVComm

from .tasks import load_problems

from .reporting import add_engine_arguments, paired_graphs, print_agent_table
from .sandbox import run_isolated, run_sandboxed

def extract_code(problem: dict, reply: str) -> str:
    """The function the model wrote: a fenced block if any, else the reply; the problem's
    signature and docstring are prepended when the model wrote only a body."""
    fenced = re.findall(r"```(?:python)?\n(.*?)```", reply, re.DOTALL)
    code = fenced[0] if fenced else reply
    if f"def {problem['entry_point']}" not in code:
        code = problem["prompt"] + code
    return code


class CodingState(TypedDict, total=False):
    problem: dict
    plan: AIMessage
    code: str
    report: ToolMessage
    review: AIMessage
    passed: bool


def test_code(problem: dict, code: str) -> tuple[bool, ToolMessage]:
    passed, output = run_isolated(code + "\n\n" + problem["test"])
    text = f"Tests {'passed' if passed else 'failed'} for {problem['entry_point']}:\n{output}"
    return passed, ToolMessage(text, tool_call_id=f"run_{uuid.uuid4().hex[:8]}", name="tester")


def build_graph(model: ChatKVComm):
    def task(state: CodingState) -> HumanMessage:
        return HumanMessage(f"Complete this Python function:\n{state['problem']['prompt']}")

    def planner(state: CodingState):
        return {"plan": model.invoke([SystemMessage("You are the planner. Describe the algorithm in two sentences."), task(state)])}

    def coder(state: CodingState):
        reply = model.invoke([SystemMessage("You are the coder. Write the complete function in a ```python block."),
                              task(state), HumanMessage(f"Plan: {state['plan'].content}")])
        return {"code": extract_code(state["problem"], reply.content)}

    def tester(state: CodingState):
        passed, report = test_code(state["problem"], state["code"])
        return {"report": report, "passed": passed}

    def history(state: CodingState) -> list:
        return [task(state), HumanMessage(f"Plan: {state['plan'].content}"),
                HumanMessage(f"Code:\n{state['code']}"), state["report"]]

    def reviewer(state: CodingState):
        return {"review": model.invoke([SystemMessage("You are the reviewer. Explain the test result in one sentence."),
                                        *history(state)])}

    def fixer(state: CodingState):
        if state["passed"]:
            return {}
        reply = model.invoke([SystemMessage("You are the coder. Fix the function; write it in a ```python block."),
                              *history(state), HumanMessage(f"Review: {state['review'].content}")])
        code = extract_code(state["problem"], reply.content)
        passed, report = test_code(state["problem"], code)
        return {"code": code, "passed": passed, "report": report}

    graph = StateGraph(CodingState)
    for name, node in (("planner", planner), ("coder", coder), ("tester", tester), ("reviewer", reviewer), ("fixer", fixer)):
        graph.add_node(name, node)
    graph.add_edge(START, "planner")
    for a, b in (("planner", "coder"), ("coder", "tester"), ("tester", "reviewer"), ("reviewer", "fixer")):
        graph.add_edge(a, b)
    graph.add_edge("fixer", END)
    return graph.compile()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    probe = run_sandboxed("pass", timeout=10)
    print("Model-written code runs on this machine, isolated by: " + "; ".join(probe.isolation)
          + (" (not in effect: " + "; ".join(probe.missing) + ")" if probe.missing else "") + ".")
    graphs, recorders = paired_graphs(build_graph, args)
    problems = load_problems(args.problems)
    same = passed = dense_passed = 0
    for i, problem in enumerate(problems, 1):
        outs = {name: graph.invoke({"problem": problem}, {"callbacks": [recorders[name]]}) for name, graph in graphs.items()}
        same += outs["reuse"]["code"] == outs["dense"]["code"]
        passed += outs["reuse"]["passed"]
        dense_passed += outs["dense"]["passed"]
        print(f"problem {i}/{len(problems)} {problem['name']}: reuse {'pass' if outs['reuse']['passed'] else 'fail'}, "
              f"dense {'pass' if outs['dense']['passed'] else 'fail'}")
    print_agent_table(recorders["reuse"].calls, recorders["dense"].calls)
    print(f"final code identical to the dense pipeline's: {same}/{len(problems)}; tests passed: reuse "
          f"{passed}/{len(problems)}, dense {dense_passed}/{len(problems)}")
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
