"""LangGraph RAG hand-off: a retriever passes long documents to an answerer and a critic.

The documents are the Python standard library's own documentation, rendered offline with
``pydoc`` (no network). The retriever (plain code, keyword overlap) puts the two best documents
into the state as one message; the answerer reads them with the question, and the critic reads
the same documents, the question and the answer. The critic's prompt repeats the documents the
answerer already prefilled: with reuse it reads them from the cache.

    python -m examples.langgraph_rag [--questions 4] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import re
import time
from typing import TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, StateGraph

from kvcomm_langgraph import ChatKVComm

from .tasks import stdlib_doc

from .reporting import add_engine_arguments, paired_graphs, print_agent_table

DOCUMENTED = ["json.dumps", "json.loads", "textwrap.shorten", "textwrap.dedent", "itertools.accumulate",
              "itertools.groupby", "os.path.join", "collections.Counter.most_common", "functools.lru_cache",
              "shutil.which", "statistics.median", "bisect.insort"]
QUESTIONS = [
    "What does json.dumps do with the indent argument?",
    "How does textwrap.shorten truncate text that is too long?",
    "What does shutil.which return when the command is not found?",
    "How does statistics.median handle an even number of data points?",
    "What does itertools.accumulate return by default?",
    "What happens in os.path.join when a component is an absolute path?",
]


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z_]{3,}", text.lower()))


class RagState(TypedDict, total=False):
    question: str
    documents: str
    answer: AIMessage
    verdict: AIMessage


def build_graph(model: ChatKVComm, corpus: dict[str, str]):
    def retriever(state: RagState):
        asked = words(state["question"]) | set(re.findall(r"[a-z_]+\.[a-z_.]+", state["question"].lower()))
        ranked = sorted(corpus, key=lambda name: -(3 * (name.lower() in asked) + len(asked & words(corpus[name]))))
        return {"documents": "\n\n".join(corpus[name] for name in ranked[:2])}

    def answerer(state: RagState):
        answer = model.invoke([SystemMessage("Answer the question from the documents in two sentences."),
                               HumanMessage(state["documents"]), HumanMessage(state["question"])])
        return {"answer": answer}

    def critic(state: RagState):
        verdict = model.invoke([SystemMessage("You are the critic. Say whether the answer is supported by the "
                                              "documents, and correct it if not, in two sentences."),
                                HumanMessage(state["documents"]), HumanMessage(state["question"]),
                                HumanMessage(f"Proposed answer: {state['answer'].content}")])
        return {"verdict": verdict}

    graph = StateGraph(RagState)
    for name, node in (("retriever", retriever), ("answerer", answerer), ("critic", critic)):
        graph.add_node(name, node)
    graph.add_edge(START, "retriever")
    graph.add_edge("retriever", "answerer")
    graph.add_edge("answerer", "critic")
    graph.add_edge("critic", END)
    return graph.compile()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    corpus = {name: stdlib_doc(name) for name in DOCUMENTED}
    graphs, recorders = paired_graphs(lambda model: build_graph(model, corpus), args)
    questions = QUESTIONS[: args.questions]
    same = 0
    for i, question in enumerate(questions, 1):
        outs = {name: graph.invoke({"question": question}, {"callbacks": [recorders[name]]}) for name, graph in graphs.items()}
        same += outs["reuse"]["answer"].content == outs["dense"]["answer"].content
        print(f"question {i}/{len(questions)}: {question}\n  answer: {outs['reuse']['answer'].content[:160]!r}")
    print_agent_table(recorders["reuse"].calls, recorders["dense"].calls)
    print(f"answers identical to the dense pipeline's: {same}/{len(questions)} (no gold answers: free text)")
    print(f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
