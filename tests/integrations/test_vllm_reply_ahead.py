"""Replies prefilled ahead in their readers' prompts (kvcomm_vllm.reply_ahead): the rule learned
from one graph's ids gives, in the next graph, copies that are exact starts of each reader's
real prompt, in three prompt formats; and VLLMEngine streams a sender's call and sends the
copies to a stand-in server while the reply is generated (tests_vllm serves them on vLLM)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcomm_agents.prompt import render_prompt
from kvcomm_vllm.reply_ahead import ALIGN_IDS, CHUNK, HOLD, MAX_SENDERS, ReplyAhead, copy_prompt, learn_copy_rule

AGENTS = 4
QUESTIONS = ["A farmer has 12 cows and buys 7 more. Each cow gives 9 liters of milk a day. How much milk is that?",
             "A baker makes 40 rolls, sells 25 of them, then bakes 10 more. How many rolls does the baker have?"]


def _reply(graph: int, k: int) -> str:
    return (f"Solver {k + 1} thinks about question {graph} step by step: first we add the numbers, then we "
            f"multiply by the daily amount, which gives {graph * 37 + k} in the end. So the answer is {k + graph}.")


def _history(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """(f) one growing message list: own system text, the task, every earlier turn as an assistant message."""
    return [{"role": "system", "content": f"You are agent {k} of {agents}, keep it short."},
            {"role": "user", "content": question}] + [{"role": "assistant", "content": r} for r in replies]


def debate_messages(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """Solver ``k``'s prompt: its system text, the question, each earlier reply as a message."""
    system = f"You are solver {k} of {agents} in a team solving a math word problem. End with the final number."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return messages + [{"role": "user", "content": f"Solver {j} answered:\n{reply}"}
                       for j, reply in enumerate(replies, start=1)]


def one_message_prompt(k: int, agents: int, question: str, replies: list[str]) -> list[dict]:
    """Solver ``k``'s prompt as one user message embedding the task and every earlier reply."""
    parts = [f"Solve this math word problem with the other solvers.\n\nProblem: {question}"]
    parts += [f"Solution from solver {j}:\n{reply}" for j, reply in enumerate(replies, start=1)]
    parts.append("Check the solutions above, then give your own answer.")
    return [{"role": "system", "content": f"You are solver {k} of {agents}. Be concise."},
            {"role": "user", "content": "\n\n".join(parts)}]


FORMATS = {"debate": debate_messages, "one_message": one_message_prompt, "history": _history}


def _ids(tokenizer, messages) -> list[int]:
    return render_prompt(tokenizer, messages).ids.tolist()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_copies_learned_in_one_graph_are_exact_starts_of_the_next_graphs_readers(tokenizer, fmt):
    build, book = FORMATS[fmt], ReplyAhead()
    bases: dict[int, list] = {}
    prompts: dict[int, list[int]] = {}
    for graph, question in enumerate(QUESTIONS):
        replies: list[str] = []
        for k in range(AGENTS):
            agent = f"solver-{k + 1}"
            ids = _ids(tokenizer, build(k + 1, AGENTS, question, replies))
            book.learn(agent, ids)
            if graph == 1:
                bases[k], prompts[k] = book.bases(agent, ids), ids
            replies.append(_reply(graph, k))
            book.finished(agent, ids, _encode(tokenizer, replies[-1]))
    for k in range(AGENTS - 1):  # every later agent reads sender k's reply
        assert sorted(reader for reader, _ in bases[k]) == [f"solver-{j + 1}" for j in range(k + 1, AGENTS)]
        reply = _encode(tokenizer, _reply(1, k))
        for reader, base in bases[k]:
            real = prompts[int(reader.split("-")[1]) - 1]
            copy = copy_prompt(base, reply)
            assert real[:len(copy)] == copy  # an exact start of the reader's real prompt
            assert len(copy) == len(base) + len(reply) - HOLD  # reaching into the reply's end
    assert bases[AGENTS - 1] == []  # nobody reads the last agent


def test_no_rule_without_the_reply_or_the_repeated_text_and_no_base_for_another_own_start(tokenizer):
    question, reply = QUESTIONS[0], _reply(0, 0)
    sender = _ids(tokenizer, debate_messages(1, AGENTS, question, []))
    reader = _ids(tokenizer, debate_messages(2, AGENTS, question, [reply]))
    ids = _encode(tokenizer, reply)
    rule = learn_copy_rule("s1", sender, ids, "s2", reader)
    assert rule is not None and rule.reader == "s2"
    assert learn_copy_rule("s1", sender, ids, "s2", _ids(tokenizer, debate_messages(2, AGENTS, question, []))) is None
    other = _ids(tokenizer, debate_messages(2, AGENTS, QUESTIONS[1], [reply]))  # the reply after another question
    assert learn_copy_rule("s1", sender, ids, "s2", other) is None
    assert learn_copy_rule("s1", sender, ids[:ALIGN_IDS - 1], "s2", reader) is None
    assert rule.base(_ids(tokenizer, debate_messages(3, AGENTS, QUESTIONS[1], []))) is None  # another sender's start
    assert rule.base(_ids(tokenizer, debate_messages(1, AGENTS, QUESTIONS[1], []))) is not None


# ---- the client, against a stand-in streaming server ---------------------------------------
class _Streamer(BaseHTTPRequestHandler):
    """Streams ``server.reply(agent)`` word by word (token ids as the tokenizer gives them);
    a one-token request is answered with one word. Keeps every request's body."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        data = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        agent = body["kv_transfer_params"]["agent"]
        words = self.server.reply(agent).split(" ") if body["max_tokens"] > 1 else ["x"]
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        if not body.get("stream"):
            data = json.dumps({"choices": [{"text": "".join(pieces), "token_ids": [1], "finish_reason": "stop"}],
                               "kv_transfer_params": {"kvcomm": {"agent": agent, "reused_tokens": 0}}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, piece in enumerate(pieces):
            event = {"choices": [{"text": piece, "token_ids": [1], "finish_reason": "stop" if i == len(pieces) - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 1}})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_the_client_streams_a_senders_call_and_sends_each_readers_copies_as_prefix_only_requests(tokenizer):
    from kvcomm_vllm.client import VLLMEngine

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Streamer)
    server.bodies, graph = [], [0]
    server.reply = lambda agent: _reply(graph[0], int(agent.split("-")[1]) - 1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=tokenizer, prefill_ahead=False)
        real = {}
        for graph[0], question in enumerate(QUESTIONS):
            replies: list[str] = []
            for k in range(3):
                messages = debate_messages(k + 1, AGENTS, question, replies)
                real[k] = _ids(tokenizer, messages)
                replies.append(engine.chat(messages, agent=f"solver-{k + 1}", max_new_tokens=64).text)
            if graph[0] == 0:
                assert not any(b.get("stream") or b["kv_transfer_params"].get("prefix_only") for b in server.bodies)
        time.sleep(0.2)  # copies are not waited for
        copies = [b for b in server.bodies if b["kv_transfer_params"].get("prefix_only")]
        assert copies and all(b["max_tokens"] == 1 for b in copies)
        for k, reader in ((1, "solver-2"), (2, "solver-3")):
            mine = [b["prompt"] for b in copies if b["kv_transfer_params"]["agent"] == reader]
            assert mine and all(real[k][:len(p)] == p for p in mine)  # exact starts of the real prompt
            assert max(map(len, mine)) >= len(real[k]) - (CHUNK + HOLD + 12)  # up to the reply's last chunk
    finally:
        server.shutdown()


def test_a_rule_is_dropped_when_its_reader_stops_reading_the_senders_reply(tokenizer):
    book = ReplyAhead()
    sender = _ids(tokenizer, debate_messages(1, AGENTS, QUESTIONS[0], []))
    book.finished("s1", sender, _encode(tokenizer, _reply(0, 0)))
    book.learn("s2", _ids(tokenizer, debate_messages(2, AGENTS, QUESTIONS[0], [_reply(0, 0)])))
    nxt = _ids(tokenizer, debate_messages(1, AGENTS, QUESTIONS[1], []))
    assert [reader for reader, _ in book.bases("s1", nxt)] == ["s2"]
    book.finished("s1", nxt, _encode(tokenizer, _reply(1, 0)))
    # another graph's reader, without this call's reply (graphs run at once): the rule stays
    book.learn("s2", _ids(tokenizer, debate_messages(2, AGENTS, QUESTIONS[0], [])))
    assert [reader for reader, _ in book.bases("s1", nxt)] == ["s2"]
    book.learn("s2", _ids(tokenizer, debate_messages(2, AGENTS, QUESTIONS[1], [])))  # s2 no longer reads s1
    assert book.bases("s1", nxt) == []


def test_senders_named_per_request_keep_rules_for_the_senders_remembered_only(tokenizer):
    """A client whose agents are named per request meets senders without end: the rules go with
    the sender calls they were learned from."""
    book = ReplyAhead()
    question, reply = QUESTIONS[0], _reply(0, 0)
    sender = _ids(tokenizer, debate_messages(1, AGENTS, question, []))
    reader = _ids(tokenizer, debate_messages(2, AGENTS, question, [reply]))
    for request in range(3 * MAX_SENDERS):
        book.finished(f"solver-{request}", sender, _encode(tokenizer, reply))
        book.learn(f"checker-{request}", reader)
    assert len(book._rules) <= MAX_SENDERS
    assert [r for r, _ in book.bases(f"solver-{3 * MAX_SENDERS - 1}", sender)] == [f"checker-{3 * MAX_SENDERS - 1}"]

