"""The fleet on Ray Serve (kvcomm_vllm.ray_serve): a local Ray cluster, two replicas of the
connector's vLLM server sharing a real Redis tier, the affinity request router, and a replica
killed mid-run. Nothing is mocked; the rule itself is tested without Ray in
tests/integrations/test_affinity_rule.py."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
import urllib.request
from contextlib import ExitStack

import pytest

from .conftest import questions

pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def fleet():
    """``(url, shared store URL)`` of two replicas on a local Ray cluster, one vLLM thread each."""
    from ray import serve

    from kvcomm_vllm.ray_serve import parser, start

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = parser().parse_args(["--replicas", "2", "--threads", "1", "--kv-cache-gib", "1", "--port", str(port),
                                   "--replica-cpus", "0.5", "--stats-period-s", "0.5",
                                   "--health-check-period-s", "2"])
    with ExitStack() as stack:
        try:
            url = start(options, stack)
        except Exception as error:  # noqa: BLE001 - a fleet that does not start fails the module
            pytest.fail(f"the Ray Serve fleet did not start: {error}")
        yield url, options.shared_store
        serve.delete("kvcomm")


def _complete(url: str, tokenizer, messages, agent: str, *, reuse: bool = True, max_tokens: int = 16, ids=None):
    """A completion on token ids as VLLMEngine sends it (``messages`` rendered, or ``ids`` as
    given): ``(answer, replica tag, prompt ids)``."""
    from kvcomm_vllm.client import _body

    if ids is None:
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
    body = _body(_model(url), ids, agent, max_tokens, 0.0, 1.0, None, None, reuse)
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read()), response.headers["x-kvcomm-replica"], ids


@functools.lru_cache(maxsize=None)
def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as response:
        return json.loads(response.read())["data"][0]["id"]


def test_a_follow_up_lands_on_the_replica_holding_its_prefix_and_equals_dense(fleet):
    from kvcomm_vllm.client import VLLMEngine

    url, _ = fleet
    tokenizer = VLLMEngine(url).tokenizer
    first = [{"role": "system", "content": "You are a careful solver."}, {"role": "user", "content": questions(5)[4]}]
    answer, home, _ = _complete(url, tokenizer, first, "solver")
    # prompts sharing no text with anything (not even the chat template) go to both replicas in turn
    others = {_complete(url, tokenizer, None, "other", max_tokens=2, ids=list(range(start, start + 40)))[1]
              for start in (3000, 4000)}
    assert len(others) == 2
    follow = first + [{"role": "assistant", "content": answer["choices"][0]["text"]},
                      {"role": "user", "content": "State the final answer as a number."}]
    served, replica, ids = _complete(url, tokenizer, follow, "solver")
    assert replica == home  # where its first turn ran
    report = served["kv_transfer_params"]["kvcomm"]
    assert report["prefix_tokens"] >= len(ids) // 2, report  # the first turn's prompt and reply, as an exact prefix
    dense, _, _ = _complete(url, tokenizer, follow, "solver", reuse=False)
    assert dense["kv_transfer_params"]["kvcomm"]["dense_reason"] == "reuse_off"
    assert served["choices"][0]["token_ids"] == dense["choices"][0]["token_ids"]  # token for token


def _graph(engine):
    """A solver, then a checker reading its reply: ChatKVComm over VLLMEngine, unchanged."""
    from langgraph.graph import START, MessagesState, StateGraph

    from kvcomm_langgraph import ChatKVComm

    model = ChatKVComm(engine=engine, max_tokens=48)

    def solver(state: MessagesState):
        return {"messages": [model.invoke(state["messages"])]}

    def checker(state: MessagesState):
        return {"messages": [model.invoke(state["messages"] + [("user", "Check the answer above. Final answer?")])]}

    graph = StateGraph(MessagesState)
    graph.add_node("solver", solver)
    graph.add_node("checker", checker)
    graph.add_edge(START, "solver")
    graph.add_edge("solver", "checker")
    return graph.compile()


def test_graphs_complete_when_a_replica_is_killed_mid_run_and_ray_replaces_it(fleet):
    import ray
    import redis
    from ray import serve

    from kvcomm_vllm.client import VLLMEngine

    url, store = fleet
    tier = redis.Redis.from_url(store)
    app = _graph(VLLMEngine(url))
    results, errors = {}, []

    def run(n: int, question: str) -> None:
        try:
            results[n] = app.invoke({"messages": [("user", question)]})
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    runs = [threading.Thread(target=run, args=(n, q)) for n, q in enumerate(questions(8)[6:8])]
    for thread in runs:
        thread.start()
    time.sleep(3)  # both graphs' first calls in flight, one on each replica (nothing held yet)
    published = set(tier.keys())
    victim = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                  if "VLLMReplica" in actor["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    for thread in runs:
        thread.join(timeout=600)
    assert not errors, errors
    for out in results.values():
        solver, checker = out["messages"][1], out["messages"][2]
        assert solver.content and checker.content
        assert checker.response_metadata["kvcomm"]["agent"] == "checker"
    assert len(results) == 2
    # Ray starts a replacement; nothing published to the Redis tier before the kill is lost
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        replicas = serve.status().applications["kvcomm"].deployments["VLLMReplica"].replica_states
        if replicas.get("RUNNING", 0) == 2 and sum(replicas.values()) == 2:
            break
        time.sleep(3)
    else:
        pytest.fail(f"the killed replica was not replaced: {replicas}")
    assert published <= set(tier.keys())
    assert VLLMEngine(url).chat([{"role": "user", "content": questions(1)[0]}], agent="after", max_new_tokens=4).text


def test_build_app_is_an_application_builder_for_serve_run_and_kuberay():
    """Serve's own check of application builders (one parameter, an Application back): what
    ``serve run kvcomm_vllm.ray_serve:build_app key=value`` and a RayService's ``args`` call."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    from kvcomm_vllm.ray_replica import replica_deployment
    from kvcomm_vllm.ray_serve import build_app

    app = call_user_app_builder_with_args_if_necessary(
        build_app, {"replicas": "1-3", "routing": "round-robin", "shared_store": "redis://127.0.0.1:1/0"})
    assert isinstance(app, Application)
    with pytest.raises(SystemExit):  # argparse: not a router
        build_app({"routing": "nearest"})
    with pytest.raises(ValueError, match="routing"):
        replica_deployment(routing="nearest")


def test_the_round_robin_router_takes_replicas_in_turn_and_a_get_takes_no_turn():
    import asyncio
    from types import SimpleNamespace

    from kvcomm_vllm.ray_router import ROUTERS, KVAffinityRouter, RoundRobinRouter

    assert ROUTERS == {"affinity": KVAffinityRouter, "round-robin": RoundRobinRouter}
    router = RoundRobinRouter.__new__(RoundRobinRouter)  # the routing state alone (no Serve controller)
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=tag)) for tag in ("b", "a")]
    post = SimpleNamespace(args=("/v1/completions", {"prompt": [1, 2, 3]}), kwargs={})
    get = SimpleNamespace(args=("/v1/models", None), kwargs={})
    chosen = []
    for request in (post, get, post, post):
        ranks = asyncio.run(router.choose_replicas(replicas, request))
        assert sorted(r.replica_id.unique_id for rank in ranks for r in rank) == ["a", "b"]
        chosen.append(ranks[0][0].replica_id.unique_id)
    assert chosen == ["a", "b", "b", "a"]
    with pytest.raises(TypeError):
        router.initialize_state(min_share=0.5)
