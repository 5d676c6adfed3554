"""The one-command server and the remote client: a LangGraph graph served by vLLM with the connector."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import questions


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    process = subprocess.Popen([sys.executable, "-m", "kvcomm_vllm.serve", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited ({process.returncode}): {process.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("the server did not start within 10 minutes")
                time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


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
