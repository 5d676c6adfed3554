"""Shared input prefilled ahead for its later readers (kvcomm_vllm.text_ahead): the rule learned
from ids, the copies it gives, and VLLMEngine sending them beside the first reader's request
to a stand-in server (tests_vllm/test_connector.py serves them on vLLM)."""

from __future__ import annotations

import time

from kvcomm_vllm.text_ahead import ALIGN_IDS, MAX_READERS, PrefillAhead
from kvcomm_agents.prompt import render_prompt

HEADER = (7, 8)  # a role header every prompt has before its message


def _prompt(system: tuple[int, ...], *messages: tuple[int, ...]) -> tuple[list[int], list[range]]:
    """Ids of ``system`` then each message after ``HEADER``, and the messages' spans."""
    ids, spans = list(system), []
    for message in messages:
        ids += HEADER
        spans.append(range(len(ids), len(ids) + len(message)))
        ids += message
    return ids, spans


SYS = {agent: tuple(range(1000 * k, 1000 * k + 20)) for k, agent in enumerate(("a", "b", "c", "d"), start=1)}
TASK1, TASK2 = tuple(range(100, 140)), tuple(range(200, 250))


def _graph(book: PrefillAhead, task: tuple[int, ...]) -> dict[str, list]:
    """Agent a reads the task; b and c read it after their own system text. Returns the copies
    each agent's prompt gave."""
    copies = {}
    for agent in ("a", "b", "c"):
        ids, spans = _prompt(SYS[agent], task)
        copies[agent] = book.copies_for(agent, ids, spans)
        book.learn(agent, ids, spans)
    return copies


def test_readers_of_a_task_get_a_copy_of_the_next_task_after_their_own_prefix():
    book = PrefillAhead()
    assert _graph(book, TASK1) == {"a": [], "b": [], "c": []}  # nothing learned before
    copies = _graph(book, TASK2)
    prefix = {agent: _prompt(SYS[agent], TASK2)[0][:-len(TASK2)] for agent in "bc"}
    assert copies["a"] == [("b", prefix["b"] + list(TASK2)), ("c", prefix["c"] + list(TASK2))]
    assert copies["b"] == copies["c"] == []  # the task is no longer new text


def test_no_rule_where_the_text_follows_the_same_ids_or_is_short_or_from_the_same_agent():
    book = PrefillAhead()
    ids, spans = _prompt(SYS["a"], TASK1)
    book.learn("a", ids, spans)
    assert book.learn("a", *_prompt(SYS["a"] + (5,), TASK1)) is None  # the same agent
    assert book.learn("b", *_prompt(SYS["a"], TASK1)) is None  # after the same ids: its base fits
    short = TASK1[:ALIGN_IDS - 1]
    book.learn("a", *_prompt(SYS["a"], short))
    assert book.learn("b", *_prompt(SYS["b"], short)) is None
    assert book.learn("b", *_prompt(SYS["b"], TASK1)).reader == "b"


def test_readers_per_context_are_bounded_and_the_latest_kept():
    book = PrefillAhead()
    book.learn("a", *_prompt(SYS["a"], TASK1))
    readers = [f"r{k}" for k in range(MAX_READERS + 2)]
    for k, reader in enumerate(readers):
        book.learn(reader, *_prompt(tuple(range(5000 + 30 * k, 5020 + 30 * k)), TASK1))
    copies = book.copies_for("a", *_prompt(SYS["a"], TASK2))
    assert [reader for reader, _ in copies] == readers[-MAX_READERS:]


def test_the_client_sends_copies_the_server_then_serves_as_exact_prefixes(tokenizer):
    """VLLMEngine against a stand-in server: from the second graph on, the first agent's request
    comes with one one-token request per later reader, whose prompt is exactly the start of that
    reader's own prompt (its system text, header and the task)."""
    import threading
    from http.server import ThreadingHTTPServer

    from kvcomm_vllm.client import VLLMEngine

    from .test_vllm_fleet import _Replica

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
    server.seen, server.asked = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=tokenizer)
        off = VLLMEngine(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=tokenizer, prefill_ahead=False)
        systems = {"s1": "You are solver one.", "s2": "You are solver two, a careful checker of others."}

        def graph(engine, question):
            for agent, system in systems.items():
                engine.chat([{"role": "system", "content": system}, {"role": "user", "content": question}],
                            agent=agent, max_new_tokens=3)

        graph(engine, "A farmer has 12 cows and buys 7 more. Each gives 9 liters. How much milk in total?")
        assert len(server.seen) == 2
        question = "A baker makes 40 rolls and sells 25 of them. He bakes 10 more. How many rolls are there now?"
        graph(engine, question)
        for _ in range(100):  # the copy is not waited for
            if len(server.seen) == 5:
                break
            time.sleep(0.02)
        layout = render_prompt(tokenizer, [{"role": "system", "content": systems["s2"]},
                                           {"role": "user", "content": question}])
        reader = layout.ids.tolist()
        prompts = [seen[:-3] for seen in server.seen[2:]]  # the stand-in appends 3 reply ids
        copies = [p for p in prompts if len(p) < len(reader) and reader[:len(p)] == p]
        assert len(server.seen) == 5 and len(copies) == 1  # s1's request, the copy for s2, s2's request
        assert len(copies[0]) == layout.tokens_within(*layout.content_spans[-1]).stop  # up to the question's end
        graph(off, "A farmer has 12 cows and buys 7 more. Each gives 9 liters. How much milk in total?")
        graph(off, question + " Twice.")
        assert len(server.seen) == 9  # no copies with prefill_ahead=False
    finally:
        server.shutdown()


def test_a_served_model_whose_tokenizer_is_not_at_hand_is_refused():
    """Rendered with the embedded SmolLM2's tokenizer, another model's prompts would be wrong ids."""
    import pytest

    from kvcomm_agents import InvalidRequestError
    from kvcomm_vllm.client import VLLMEngine

    with pytest.raises(InvalidRequestError, match=r"'Qwen/Qwen2.5-7B-Instruct' is not a local folder.*tokenizer="):
        VLLMEngine("http://127.0.0.1:9", model="Qwen/Qwen2.5-7B-Instruct")  # no request is made
