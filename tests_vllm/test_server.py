"""The one-command server and the remote client: a LangGraph graph served by vLLM with the connector."""

from __future__ import annotations

import pytest

from .conftest import questions, serving


@pytest.fixture(scope="module")
def server_url():
    with serving() as url:
        yield url


def test_a_langgraph_graph_runs_against_the_server(server_url):
    from langgraph.graph import START, MessagesState, StateGraph

    from kvcomm_langgraph import ChatKVComm
    from kvcomm_vllm.client import VLLMEngine

    engine = VLLMEngine(server_url)
    model = ChatKVComm(engine=engine, max_tokens=24)

    def solver(state: MessagesState):
        return {"messages": [model.invoke(state["messages"])]}

    def checker(state: MessagesState):
        return {"messages": [model.invoke(state["messages"] + [("user", "Check the answer above. Final answer?")])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solver", solver)
    graph.add_node("checker", checker)
    graph.add_edge(START, "solver")
    graph.add_edge("solver", "checker")
    app = graph.compile()
    out = app.invoke({"messages": [("user", questions(1)[0])]})
    solver_msg, checker_msg = out["messages"][1], out["messages"][2]
    assert solver_msg.response_metadata["kvcomm"]["agent"] == "solver"
    assert checker_msg.response_metadata["kvcomm"]["agent"] == "checker"
    assert solver_msg.content and checker_msg.content
    # the checker's prompt starts with the solver's prompt and reply: an exact prefix on the server
    prompt = checker_msg.response_metadata["kvcomm"]["stats"]["prompt_tokens"]
    read = checker_msg.usage_metadata["input_token_details"]["cache_read"]
    assert read > 0 and read < prompt
    assert checker_msg.response_metadata["kvcomm"]["stats"]["mode"] in ("prefix", "reuse")
    assert model.model_name.startswith("kvcomm-vllm:")


def test_reuse_off_is_reported_by_the_server(server_url):
    from kvcomm_vllm.client import VLLMEngine

    engine = VLLMEngine(server_url)
    result = engine.chat([{"role": "user", "content": questions(2)[1]}], agent="judge", reuse=False, max_new_tokens=4)
    assert result.stats.reused_tokens == 0 and result.stats.dense_reason == "reuse_off" and result.stats.opted_out
    assert len(result.token_ids) == result.stats.generated_tokens > 0
