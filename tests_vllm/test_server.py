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


def test_streaming_yields_the_reply_piece_by_piece_with_the_servers_ttft_and_cache_read(server_url):
    from kvcomm_vllm.client import VLLMEngine

    engine = VLLMEngine(server_url)
    messages = [{"role": "system", "content": "You are solver 7."}, {"role": "user", "content": questions(3)[2]}]
    whole = engine.chat(messages, agent="solver-7", max_new_tokens=12)
    assert 0 < whole.stats.ttft_s < whole.stats.total_s  # the server's first-token time, not the wall time
    follow = messages + [{"role": "assistant", "content": whole.text}, {"role": "user", "content": "Final answer?"}]
    items = list(engine.stream(follow, agent="checker-7", max_new_tokens=12))
    pieces, result = items[:-1], items[-1]
    assert len(pieces) > 1 and "".join(pieces) == result.text
    assert len(result.token_ids) == result.stats.generated_tokens > 1
    assert 0 < result.stats.ttft_s < result.stats.total_s
    # the follow-up starts with the first call's prompt and reply: the connector's exact-prefix claim,
    # read from the usage chunk (vLLM streams no kv_transfer_params)
    assert len(engine.tokenizer(whole.text)["input_ids"]) < result.stats.reused_tokens < result.stats.prompt_tokens
    # greedy: the streamed reply is the one a non-streamed call gives on the same prompt
    assert engine.chat(follow, agent="checker-7", max_new_tokens=12).text == result.text


def test_the_server_command_carries_the_capture_switch():
    import json

    from kvcomm_vllm.serve import server_command

    def transfer(**kwargs):
        command = server_command("model", **kwargs)
        return json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    assert transfer()["background_capture"] is False
    assert transfer(background_capture=True)["background_capture"] is True


def test_a_capture_switch_that_is_not_a_boolean_is_refused():
    from kvcomm_vllm.connector import _background_capture

    assert _background_capture({}) is False and _background_capture({"background_capture": True}) is True
    with pytest.raises(ValueError, match="true or false"):
        _background_capture({"background_capture": "yes"})
