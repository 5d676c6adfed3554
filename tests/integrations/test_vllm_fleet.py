"""The fleet's request router (kvcomm_vllm.fleet), without vLLM: the affinity rule, and
FleetEngine over stand-in HTTP servers that answer as vLLM's completions API does (the seam);
tests_vllm/test_fleet.py runs it against real vLLM replicas sharing a Redis tier."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcomm_vllm.fleet import AffinityRouter, FleetEngine


def test_a_prompt_goes_to_the_replica_that_computed_its_text():
    router = AffinityRouter(3, min_run=4)
    router.record(2, list(range(100, 160)))  # a sender's prompt and reply, on replica 2
    router.record(0, list(range(500, 520)))
    prompt = [1, 2, 3] + list(range(120, 150)) + [7, 8] + list(range(500, 510)) + [9]
    assert router.held_tokens(prompt) == [10, 0, 30]
    assert router.pick(prompt) == 2


def test_ties_go_to_the_replica_with_fewest_requests_in_flight_then_in_turn():
    router = AffinityRouter(3, min_run=4)
    fresh = list(range(1000, 1040))
    with router.serving(0), router.serving(1):
        assert router.pick(fresh) == 2
    assert [router.pick(fresh) for _ in range(3)] == [1, 2, 0]  # in turn once all are idle


def test_affinity_yields_to_load_and_to_small_overlaps():
    router = AffinityRouter(2, min_run=4, min_share=0.5, max_imbalance=2)
    router.record(1, list(range(100, 140)))
    prompt = list(range(100, 130)) + [5]
    assert router.pick(prompt) == 1
    with router.serving(1):
        assert router.pick(prompt) == 1  # one more in flight: still worth it
        with router.serving(1):
            assert router.pick(prompt) == 0  # two more: the idle replica
    small = list(range(100, 110)) + list(range(900, 930))  # 10 of 40 held: below min_share
    assert router.pick(small) == router.pick(small) ^ 1  # in turn, as if nothing were held


def test_replicas_forget_their_oldest_requests():
    router = AffinityRouter(2, min_run=4, remember=2)
    for start in (0, 100, 200):
        router.record(1, list(range(start, start + 20)))
    assert router.held_tokens(list(range(0, 20)) + [5]) == [0, 0]  # forgotten
    assert router.held_tokens(list(range(200, 220)) + [5]) == [0, 20]
    with pytest.raises(ValueError):
        AffinityRouter(0)


class _Replica(BaseHTTPRequestHandler):
    """Answers /v1/models and /v1/completions like vLLM with the connector; the reply's ids are
    the prompt's last 3 ids, the report says the prompt tokens this replica saw before."""

    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"data": [{"id": "tiny", "max_model_len": 64}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.asked.append(body["max_tokens"])
        seen = self.server.seen
        ids = body["prompt"]
        reused = max((sum(1 for a, b in zip(old, ids) if a == b) for old in seen), default=0)
        seen.append(ids + ids[-3:])
        metrics = {"time_to_first_token_ms": 40.0, "queue_time_ms": 2.0}
        if body.get("stream"):  # one event per reply token, then usage (+ metrics), as vLLM streams
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if body["kv_transfer_params"]["agent"] == "broken":  # a failure reported inside the stream
                self._event({"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}})
                return
            for k, token in enumerate(ids[-3:]):
                self._event({"choices": [{"text": f"w{k} ", "token_ids": [token],
                                          "finish_reason": "stop" if k == 2 else None}]})
            self._event({"choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": 3,
                                                  "prompt_tokens_details": {"cached_tokens": reused}},
                         "metrics": metrics})
            self.wfile.write(b"data: [DONE]\n\n")
            return
        self._send({"choices": [{"text": "ok", "token_ids": ids[-3:], "finish_reason": "stop"}], "metrics": metrics,
                    "kv_transfer_params": {"kvcomm": {"agent": body["kv_transfer_params"]["agent"],
                                                      "reused_tokens": reused, "prefix_tokens": reused}}})

    def _event(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def replicas():
    servers = []
    for _ in range(2):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
        server.seen, server.asked = [], []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()


def test_a_fleet_serves_an_agents_follow_up_where_its_first_turn_ran(replicas, tokenizer):
    fleet = FleetEngine([f"http://127.0.0.1:{s.server_address[1]}" for s in replicas], tokenizer=tokenizer)
    question = "A farmer has 12 cows and buys 7 more. Each cow gives 9 liters of milk. How much milk in total?"
    first = [{"role": "system", "content": "You are a careful solver."}, {"role": "user", "content": question}]
    fleet.chat(first, agent="solver", max_new_tokens=3)
    other = fleet.chat([{"role": "user", "content": "Something unrelated to the farm, entirely."}], agent="x",
                       max_new_tokens=3)
    follow = fleet.chat(first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Final answer?"}],
                        agent="checker", max_new_tokens=3)
    hosts = [len(s.seen) for s in replicas]
    assert sorted(hosts) == [1, 2] and fleet.served == hosts
    both = replicas[hosts.index(2)].seen  # the follow-up joined its first turn there
    assert both[1][:20] == both[0][:20] and follow.stats.reused_tokens > 20
    assert other.stats.agent == "x" and other.stats.reused_tokens == 0
    assert fleet.model_name == "kvcomm-vllm:tiny"


def test_a_call_naming_no_reply_budget_asks_for_what_the_served_context_leaves(replicas, tokenizer):
    """As the local engine: 256 tokens, or fewer where the served model's context (its card's
    ``max_model_len``) ends first; a budget the call names is sent as given."""
    from kvcomm_vllm.client import VLLMEngine

    server = replicas[0]
    engine = VLLMEngine(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=tokenizer, model="tiny")
    engine.complete(list(range(5, 45)), agent="a")
    engine.complete(list(range(5, 45)), agent="a", max_new_tokens=7)
    list(engine.stream_ids(list(range(5, 15)), agent="a"))
    assert server.asked == [64 - 40, 7, 64 - 10]


def test_the_clients_stats_read_a_brokers_report_with_decisions(llama, tokenizer):
    """The report a connector sends back (the broker's, here on transformers) becomes CallStats
    on the client, shared segments' decisions included."""
    from kvcomm_agents.testing import PrefixOnlyRuntime
    from kvcomm_vllm.client import _stats

    runtime = PrefixOnlyRuntime(llama, tokenizer, method="rerotate")
    question = "Tom has 3 apples and buys 5 more bags of 4 apples each. How many apples does he have now?"
    runtime.run(runtime.ids([{"role": "system", "content": "You solve."}, {"role": "user", "content": question}]), "a")
    ids = runtime.ids([{"role": "system", "content": "You check."}, {"role": "user", "content": question}])
    _, out, report, _, _ = runtime.run(ids, "b")
    report = json.loads(json.dumps(report))  # as it crosses HTTP
    stats = _stats("b", len(ids), len(out), 0.5, 0.5, report, None)
    assert stats.decisions and [d.model_dump(mode="json") for d in stats.decisions] == report["decisions"]
    assert stats.decisions[0].reason == "after_hole"  # found, cut by the claim: its reason arrives


def test_streamed_answers_arrive_piece_by_piece_with_the_servers_ttft_and_cache_read(replicas, tokenizer):
    fleet = FleetEngine([f"http://127.0.0.1:{s.server_address[1]}" for s in replicas], tokenizer=tokenizer)
    question = [{"role": "user", "content": "A farmer has 12 cows and buys 7 more. How many cows now?"}]
    first = fleet.chat(question, agent="solver", max_new_tokens=3)
    assert first.stats.ttft_s == pytest.approx(0.042)  # the server's queue wait + first token, not wall time
    items = list(fleet.stream(question + [{"role": "assistant", "content": "ok"}], agent="checker",
                              max_new_tokens=3))
    pieces, result = items[:-1], items[-1]
    assert pieces == ["w0 ", "w1 ", "w2 "] and result.text == "w0 w1 w2 " and len(result.token_ids) == 3
    assert result.stats.ttft_s == pytest.approx(0.042) and result.finish_reason == "stop"
    # cache_read from the usage chunk: the follow-up went where its first turn ran and read it
    assert result.stats.reused_tokens > 10 and result.stats.mode == "reuse" and not result.stats.decisions
    assert sorted(fleet.served) == [0, 2]

    with pytest.raises(RuntimeError, match="engine dead"):  # a failure inside the stream is an error, not a reply
        list(fleet.stream(question, agent="broken", max_new_tokens=3))


def test_a_fleet_sends_reply_copies_to_the_senders_replica_and_routes_the_reader_there(tokenizer):
    """Replies ahead on a fleet (kvcomm_vllm.reply_ahead): learned over the fleet, each reply's
    copies go to the replica serving the sender and are recorded there, so the router sends the
    reader to that replica, not back to the one that served its own start before."""
    from examples.tasks import debate_messages

    from kvcomm_agents.prompt import render_prompt

    from .test_vllm_reply_ahead import QUESTIONS, _reply, _Streamer

    servers, graph = [], [0]
    for _ in range(2):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
        server.bodies = []
        server.reply = lambda agent: _reply(graph[0], int(agent.split("-")[1]) - 1)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)

    def served(reader, replica, **flags):
        return [b for b in servers[replica].bodies if b["kv_transfer_params"]["agent"] == reader
                and bool(b["kv_transfer_params"].get("prefix_only")) == flags.get("copy", False)]

    try:
        fleet = FleetEngine([f"http://127.0.0.1:{s.server_address[1]}" for s in servers], tokenizer=tokenizer,
                            prefill_ahead=False)
        replies: list[str] = []
        for k in range(2):  # graph 0: the rule is learned
            replies.append(fleet.chat(debate_messages(k + 1, 4, QUESTIONS[0], replies), agent=f"solver-{k + 1}",
                                      max_new_tokens=64).text)
        home = 0 if served("solver-2", 0) else 1  # where the reader's own start is held
        other = 1 - home
        graph[0] = 1
        first = debate_messages(1, 4, QUESTIONS[1], [])
        fleet.router.record(other, render_prompt(tokenizer, first).ids.tolist())  # the sender goes elsewhere
        reply = fleet.chat(first, agent="solver-1", max_new_tokens=64).text
        time.sleep(0.2)  # the copies are not waited for
        assert served("solver-1", other) and served("solver-2", other, copy=True)
        fleet.chat(debate_messages(2, 4, QUESTIONS[1], [reply]), agent="solver-2", max_new_tokens=64)
        assert len(served("solver-2", other)) == 1 and len(served("solver-2", home)) == 1  # followed its copies
    finally:
        for server in servers:
            server.shutdown()
