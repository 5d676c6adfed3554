"""Real LangGraph graphs on a tiny model: node names become agents, replies are reused by the
next node, reuse off is dense, Send fan-out equals serial, checkpoints survive a fresh engine."""

import functools
import operator
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import Command, Send

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_langgraph import ChatKVComm, kvcomm_agent

from .conftest import ScriptedEngine
from ..conftest import mechanics

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
REPLY = "The answer is 72 because 48 plus 24 equals 72."


def kv(message: AIMessage) -> dict:
    return message.response_metadata["kvcomm"]


def two_solver_graph(model: ChatKVComm, checkpointer=None):
    def solver_1(state: MessagesState):
        return {"messages": [model.invoke([SystemMessage("You are solver one.")] + state["messages"])]}

    def solver_2(state: MessagesState):
        return {"messages": [model.invoke([SystemMessage("You are solver two.")] + state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solver_1", solver_1)
    graph.add_node("solver_2", solver_2)
    graph.add_edge(START, "solver_1")
    graph.add_edge("solver_1", "solver_2")
    graph.add_edge("solver_2", END)
    return graph.compile(checkpointer=checkpointer)


def test_second_node_reuses_the_first_nodes_reply(engine):
    model = ChatKVComm(engine=ScriptedEngine(engine, [REPLY, "I agree with 72."]))
    out = two_solver_graph(model).invoke({"messages": [HumanMessage(QUESTION)]})
    first, second = out["messages"][1], out["messages"][2]
    assert (kv(first)["agent"], kv(second)["agent"]) == ("solver_1", "solver_2")
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0
    kinds = {tuple(d["segment"]["kind"]): d["status"] for d in kv(second)["stats"]["decisions"]}
    assert kinds == {("user", None): "reused", ("solver_1", "assistant"): "reused"}


@pytest.mark.parametrize("how", ["streaming=True", "stream=True"])
def test_nodes_are_named_when_langchain_streams_an_invoke(engine, how):
    """LangChain streams such an invoke without a run manager: the node's name comes from the
    config the node runs under, as it does from the run manager otherwise."""
    if how == "streaming=True":
        model = ChatKVComm(engine=engine, max_tokens=3, streaming=True)
    else:
        model = ChatKVComm(engine=engine, max_tokens=3).bind(stream=True)
    out = two_solver_graph(model).invoke({"messages": [HumanMessage(QUESTION)]})
    assert [kv(m)["agent"] for m in out["messages"][1:]] == ["solver_1", "solver_2"]


def test_reuse_off_graph_equals_dense(llama, tokenizer):
    def run(config):
        model = ChatKVComm(engine=KVCommEngine(llama, tokenizer, config=config), max_tokens=12)
        return [m.content for m in two_solver_graph(model).invoke({"messages": [HumanMessage(QUESTION)]})["messages"]]

    engine = KVCommEngine(llama, tokenizer, config=mechanics())
    off = ChatKVComm(engine=engine, max_tokens=12, reuse=False)
    dense = run(KVCommConfig(method="dense"))
    assert [m.content for m in two_solver_graph(off).invoke({"messages": [HumanMessage(QUESTION)]})["messages"]] == dense


class FanOut(TypedDict):
    question: str
    answers: Annotated[list, operator.add]


def fan_out(branch, questions: list[str]):
    """A compiled graph sending each question to ``branch`` at once (a ``Send`` fan-out)."""
    graph = StateGraph(FanOut)
    graph.add_node("branch", branch)
    graph.add_conditional_edges(START, lambda s: [Send("branch", {"question": q}) for q in questions])
    graph.add_edge("branch", END)
    return graph.compile()


def test_send_fan_out_equals_serial_with_reuse_on_and_off(llama, tokenizer):
    systems = ["You are solver one.", "You are solver two.", "You are solver three."]
    for reuse in (True, False):
        engine = KVCommEngine(llama, tokenizer, config=mechanics(method="rerotate" if reuse else "dense"))
        engine.add_segment(QUESTION, kind=("user", None))  # the shared input, registered before the fan-out
        model = ChatKVComm(engine=engine, max_tokens=8)

        def branch(state: dict):
            reply = model.invoke([SystemMessage(state["system"]), HumanMessage(state["question"])])
            return {"answers": [(state["system"], reply.content, reply.usage_metadata["input_token_details"]["cache_read"])]}

        graph = StateGraph(FanOut)
        graph.add_node("branch", branch)
        graph.add_conditional_edges(START, lambda s: [Send("branch", {"system": x, "question": s["question"]}) for x in systems])
        graph.add_edge("branch", END)
        with engine.freeze_anchors():
            fanned = sorted(graph.compile().invoke({"question": QUESTION, "answers": []})["answers"])
            serial = sorted((x, *_serial(model, x)) for x in systems)
        assert [(x, text) for x, text, _ in fanned] == [(x, text) for x, text, _ in serial]
        assert all(read > 0 for _, _, read in fanned) == reuse  # (serial reads more: exact prefixes)


def test_parallel_branches_reading_one_document_compute_it_once_and_answer_as_dense(llama, tokenizer):
    document = ("The library opens at nine and closes at five on weekdays. On Saturdays it opens at ten "
                "and closes at two. It is closed on Sundays and on public holidays.")
    questions = ["When does it open on Saturdays?", "When is it closed?", "When does it close on weekdays?"]

    def run(engine):
        model = ChatKVComm(engine=engine, max_tokens=8)

        def branch(state: dict):
            reply = model.invoke([SystemMessage("You answer from the document."),
                                  HumanMessage(f"{document}\n\nQuestion: {state['question']}")])
            return {"answers": [(state["question"], reply.content, kv(reply)["stats"]["prefix_tokens"])]}

        return sorted(fan_out(branch, questions).invoke({"question": "", "answers": []})["answers"])

    shared = run(KVCommEngine(llama, tokenizer, config=mechanics(method="rerotate")))
    dense = run(KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense")))
    assert [(q, text) for q, text, _ in shared] == [(q, text) for q, text, _ in dense]
    # whichever branch plans first computes the document; the others read it as an exact prefix,
    # from the store or from a branch still answering (LangGraph runs the branches in threads)
    assert sorted(n > len(tokenizer(document)["input_ids"]) for _, _, n in shared) == [False, True, True]


def _serial(model, system):
    reply = model.invoke([SystemMessage(system), HumanMessage(QUESTION)])
    return reply.content, reply.usage_metadata["input_token_details"]["cache_read"]


def test_checkpointed_graph_resumes_on_a_fresh_engine(llama, tokenizer):
    saver = InMemorySaver()
    config = {"configurable": {"thread_id": "t1"}}
    first = ScriptedEngine(KVCommEngine(llama, tokenizer, config=mechanics()), [REPLY, "I agree with 72."])
    two_solver_graph(ChatKVComm(engine=first), saver).invoke({"messages": [HumanMessage(QUESTION)]}, config)
    # a restart: new engine, empty store; the state holds only references
    fresh = ScriptedEngine(KVCommEngine(llama, tokenizer, config=mechanics()), ["Still 72.", "Yes, 72."])
    out = two_solver_graph(ChatKVComm(engine=fresh), saver).invoke({"messages": [HumanMessage("Check again.")]}, config)
    assert len(out["messages"]) == 6
    reasons = {d["reason"] for d in kv(out["messages"][4])["stats"]["decisions"]}
    assert "not_found" in reasons  # the old replies' refs point to KV the new engine never had


def critic_subgraph(model: ChatKVComm):
    """A compiled graph of one node, ``critic``, that answers its messages."""
    def critic(state: MessagesState):
        return {"messages": [model.invoke(state["messages"])]}

    inner = StateGraph(MessagesState)
    inner.add_node("critic", critic)
    inner.add_edge(START, "critic")
    return inner.compile()


def test_subgraph_nodes_are_named_with_their_path_and_command_hands_off(engine):
    model = ChatKVComm(engine=engine, max_tokens=2)

    def router(state: MessagesState):
        return Command(goto="review", update={"messages": [model.invoke(state["messages"])]})

    outer = StateGraph(MessagesState)
    outer.add_node("router", router)
    outer.add_node("review", critic_subgraph(model))
    outer.add_edge(START, "router")
    out = outer.compile().invoke({"messages": [HumanMessage(QUESTION)]})
    assert [kv(m)["agent"] for m in out["messages"][1:]] == ["router", "review/critic"]


def test_a_decorated_node_names_its_own_calls_not_those_of_a_subgraph_it_runs(engine):
    model = ChatKVComm(engine=engine, max_tokens=2)
    inner = critic_subgraph(model)

    @kvcomm_agent("judge", reuse=False)
    def review(state: MessagesState):
        verdict = model.invoke(state["messages"])
        out = inner.invoke({"messages": state["messages"] + [verdict]})
        return {"messages": out["messages"][len(state["messages"]):]}

    outer = StateGraph(MessagesState)
    outer.add_node("review", review)
    outer.add_edge(START, "review")
    out = outer.compile().invoke({"messages": [HumanMessage(QUESTION)]})
    verdict, critique = (kv(m) for m in out["messages"][1:])
    assert verdict["agent"] == "judge" and verdict["stats"]["opted_out"]
    assert critique["agent"] == "review/critic" and not critique["stats"]["opted_out"]


def test_a_decorated_node_keeps_its_name_when_a_call_brings_its_own_config(engine):
    from langchain_core.callbacks import BaseCallbackHandler

    model = ChatKVComm(engine=engine, max_tokens=2)

    @kvcomm_agent("judge", reuse=False)
    def review(state: MessagesState):
        config = {"metadata": {"purpose": "verdict"}, "callbacks": [BaseCallbackHandler()]}
        return {"messages": [model.invoke(state["messages"], config=config)]}

    graph = StateGraph(MessagesState)
    graph.add_node("review", review)
    graph.add_edge(START, "review")
    verdict = kv(graph.compile().invoke({"messages": [HumanMessage(QUESTION)]})["messages"][-1])
    assert verdict["agent"] == "judge" and verdict["stats"]["opted_out"]


def test_a_function_decorated_outside_any_graph_does_not_rename_a_graph_it_runs(engine):
    model = ChatKVComm(engine=engine, max_tokens=2)
    inner = critic_subgraph(model)

    @kvcomm_agent("judge", reuse=False)
    def review(messages):
        return model.invoke(messages), inner.invoke({"messages": messages})["messages"][-1]

    verdict, critique = review([HumanMessage(QUESTION)])
    assert kv(verdict)["agent"] == "judge" and kv(critique)["agent"] == "critic"
    assert not kv(critique)["stats"]["opted_out"]


def test_an_async_callable_object_can_be_a_decorated_node(engine):
    import asyncio

    model = ChatKVComm(engine=engine, max_tokens=2)

    class Critic:
        async def __call__(self, state: MessagesState):
            return {"messages": [await model.ainvoke(state["messages"])]}

    async def answer(state: MessagesState, prefix: str):
        return {"messages": [await model.ainvoke(state["messages"])]}

    for node, agent in ((kvcomm_agent("critic")(Critic()), "critic"), (kvcomm_agent(Critic()), "Critic"),
                        (kvcomm_agent(functools.partial(answer, prefix="x")), "answer")):
        graph = StateGraph(MessagesState)
        graph.add_node("node", node)
        graph.add_edge(START, "node")
        out = asyncio.run(graph.compile().ainvoke({"messages": [HumanMessage(QUESTION)]}))
        assert kv(out["messages"][-1])["agent"] == agent


def test_functional_api_tasks_and_decorated_nodes(engine):
    model = ChatKVComm(engine=engine, max_tokens=2)

    @task
    def draft(question: str):
        return model.invoke([HumanMessage(question)])

    @kvcomm_agent("final-judge", reuse=False)
    def judge(question: str, answer: AIMessage):
        return model.invoke([HumanMessage(question), answer])

    @entrypoint()
    def workflow(question: str):
        answer = draft(question).result()
        return [answer, judge(question, answer)]

    answer, verdict = workflow.invoke(QUESTION)
    assert kv(answer)["agent"] == "workflow/draft"  # a task inside the entrypoint, like a subgraph node
    assert kv(verdict)["agent"] == "final-judge" and kv(verdict)["stats"]["opted_out"]


def test_an_async_fan_out_steps_its_branches_together_and_answers_as_plain_transformers(llama, tokenizer):
    """``ainvoke``: LangGraph runs the branches as tasks, LangChain runs each chat call in an
    executor thread, so the branches decode at once and their steps batch
    (kvcomm_agents/batched_decode.py); replies are those of plain transformers."""
    import asyncio

    questions = ["When does it open?", "Who may borrow books, and how many?", "Is it open on Sundays?",
                 "What are the hours on Saturday?"]

    def run(engine):
        model = ChatKVComm(engine=engine, max_tokens=16)

        async def branch(state: dict):
            reply = await model.ainvoke([SystemMessage(f"You are analyst {state['question'][:4]}."),
                                         HumanMessage(f"Question: {state['question']}")])
            return {"answers": [(state["question"], reply.content, kv(reply)["stats"]["batched_steps"])]}

        return sorted(asyncio.run(fan_out(branch, questions).ainvoke({"question": "", "answers": []}))["answers"])

    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense"))
    batched = run(engine)
    plain = run(KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense", batched_decode=False)))
    assert [(q, text) for q, text, _ in batched] == [(q, text) for q, text, _ in plain]
    assert engine._calls.decoding.batcher.rows > 0  # the branches stepped together
    assert sum(n for _, _, n in batched) == engine._calls.decoding.batcher.rows  # every batched row is some call's
    assert all(n == 0 for _, _, n in plain)
