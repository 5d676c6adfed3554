"""KVCommConnector on vLLM's CPU build, embedded SmolLM2-135M, float32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .conftest import kl, questions

SYSTEM_A = "You are agent A. Solve the math problem step by step."
SYSTEM_B = "You are agent B. Check agent A's solution and give the final answer."


def test_the_pinned_vllm_is_the_installed_one():
    from kvcomm_vllm import SUPPORTED_VLLM, check_vllm_version

    assert check_vllm_version().startswith("0.32"), SUPPORTED_VLLM


def test_exact_prefix_claim_gives_vllms_own_greedy_output(client):
    first = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": questions(1)[0]}]
    reply = client.generate(client.ids(first), "prefix_a", max_tokens=32).outputs[0].text
    follow = client.ids(first + [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": "State the final answer as a number."}])
    served = client.generate(follow, "prefix_a", max_tokens=32)
    report = served.kv_transfer_params["kvcomm"]
    assert report["reused_tokens"] >= len(client.ids(first)) and report["computed_tokens"] < 32
    dense = client.generate(follow, "prefix_a", reuse=False, max_tokens=32)
    assert dense.kv_transfer_params["kvcomm"]["dense_reason"] == "reuse_off"
    assert served.outputs[0].token_ids == dense.outputs[0].token_ids  # token for token


def test_a_capture_kept_off_the_scheduler_serves_the_next_request_exactly(client, broker, monkeypatch):
    """``background_capture=True``: the finished request's KV is copied out of its blocks and kept
    on the broker's capture thread; the follow-up, planned after, waits for it and claims it."""
    from kvcomm_vllm.connector import runtimes

    (runtime,) = runtimes()
    monkeypatch.setattr(runtime, "background_capture", True)
    queued = []
    submit = broker._captures.submit
    monkeypatch.setattr(broker._captures, "submit", lambda touch, job: (queued.append(touch), submit(touch, job)))
    first = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": questions(3)[2]}]
    reply = client.generate(client.ids(first), "background_a", max_tokens=32).outputs[0].text
    follow = client.ids(first + [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": "State the final answer as a number."}])
    served = client.generate(follow, "background_a", max_tokens=32)
    assert len(queued) == 2  # both requests kept in the background
    assert served.kv_transfer_params["kvcomm"]["reused_tokens"] >= len(client.ids(first))
    dense = client.generate(follow, "background_a", reuse=False, max_tokens=32)
    assert served.outputs[0].token_ids == dense.outputs[0].token_ids
    broker.settle()
    assert broker.pending_captures == 0


def test_kvcomm_claims_match_the_reference_runtime_and_its_fidelity(client, model_dir):
    """A two-agent debate (B reads A's reply) for several questions: every claim the connector
    makes equals the claim of the same broker on transformers (PrefixOnlyRuntime) fed the same
    ids, and its first-token KL against vLLM dense is comparable to that runtime's KL against
    transformers dense. Some claims go past the agents' exact prefixes (shared text re-rotated)."""
    from transformers import AutoModelForCausalLM

    from kvcomm_agents.testing import PrefixOnlyRuntime

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = PrefixOnlyRuntime(model, client.tokenizer, kl_budget=None)  # as the session's engine
    kls_vllm, kls_reference, claims, beyond_prefix = [], [], [], 0
    for question in questions(5):
        a_ids = client.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": question}])
        a_out = client.generate(a_ids, "a", max_tokens=40)
        reference.run(a_ids, "a", forced=list(a_out.outputs[0].token_ids))
        b_ids = client.ids([{"role": "system", "content": SYSTEM_B},
                            {"role": "user", "content": f"{question}\n\nAgent A said: {a_out.outputs[0].text}"}])
        served, report = client.first_token_logprobs(b_ids, "b")
        dense, _ = client.first_token_logprobs(b_ids, "b", reuse=False)
        logits, _, ref_report, _, _ = reference.run(b_ids, "b", forced=[int(served.argmax())])
        ref_dense = reference.dense_logits(b_ids)
        reference.run(b_ids, "b", reuse=False, forced=[int(dense.argmax())])
        claims.append((report["reused_tokens"], ref_report["reused_tokens"]))
        beyond_prefix += any(d["status"] == "reused" and d["reason"] == "tokens" for d in report["decisions"])
        kls_vllm.append(kl(dense, served))
        kls_reference.append(kl(torch.log_softmax(ref_dense.double(), -1), torch.log_softmax(logits.double(), -1)))
    print(f"claims (vLLM, reference): {claims}; first-token KL vLLM {kls_vllm}; reference {kls_reference}")
    assert beyond_prefix >= 1, claims
    assert sum(a == b for a, b in claims) >= len(claims) - 1, claims  # one gate verdict may flip on numerics
    mean_vllm, mean_reference = sum(kls_vllm) / len(kls_vllm), sum(kls_reference) / len(kls_reference)
    assert mean_vllm <= 2 * mean_reference + 0.01, (kls_vllm, kls_reference)


def test_a_missing_segment_falls_back_to_dense_with_a_reason(client, broker):
    ids = client.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": questions(7)[6]}])
    client.generate(ids, "missing", max_tokens=8)
    broker.store.clear()  # evicted, or a restarted server
    served, report = client.first_token_logprobs(ids, "missing")
    assert report["reused_tokens"] == 0 and report["dense_reason"] == "nothing_to_reuse"
    dense, _ = client.first_token_logprobs(ids, "missing", reuse=False)
    assert kl(dense, served) < 1e-6


def test_a_failed_load_is_recomputed_by_vllm(client, llm, monkeypatch):
    from kvcomm_vllm.connector import runtimes

    (runtime,) = runtimes()
    ids = client.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": questions(8)[7]}])
    baseline = client.generate(ids, "load_fail", reuse=False, max_tokens=16)

    def broken(*args, **kwargs):
        raise RuntimeError("injected load failure")

    monkeypatch.setattr(runtime.paged, "write", broken)
    served = client.generate(ids, "load_fail", max_tokens=16)
    assert served.kv_transfer_params["kvcomm"]["reused_tokens"] > 0  # it was claimed, and the load failed
    assert served.outputs[0].token_ids == baseline.outputs[0].token_ids


def test_approximate_kv_never_reaches_a_later_dense_request(client):
    """vLLM's prefix cache is off: a dense request after an approximate one of the same prompt
    gives exactly what it gave before any reuse."""
    question = questions(9)[8]
    b_ids = client.ids([{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": question}])
    before, _ = client.first_token_logprobs(b_ids, "pollution", reuse=False)
    for agent in ("pollution_a", "pollution_b"):  # a few reused requests of the same text
        client.generate(client.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": question}]),
                        agent, max_tokens=4)
        client.first_token_logprobs(b_ids, agent)
    after, report = client.first_token_logprobs(b_ids, "pollution", reuse=False)
    assert report["dense_reason"] == "reuse_off"
    assert torch.equal(before, after)


def _config(**overrides):
    base = dict(cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"),
                parallel_config=SimpleNamespace(world_size=1))
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("overrides, message", [
    ({"cache_config": SimpleNamespace(enable_prefix_caching=True, cache_dtype="auto")}, "prefix caching off"),
    ({"parallel_config": SimpleNamespace(world_size=2)}, "one worker"),
    ({"cache_config": SimpleNamespace(enable_prefix_caching=False, cache_dtype="fp8")}, "kv_cache_dtype='auto'"),
])
def test_unsafe_engine_settings_are_refused_at_start(overrides, message, model_dir):
    from transformers import AutoConfig

    from kvcomm_agents.errors import UnsupportedModelError
    from kvcomm_vllm.connector import _check_supported

    with pytest.raises(UnsupportedModelError, match=message):
        _check_supported(_config(**overrides), AutoConfig.from_pretrained(model_dir))


def test_unsupported_models_are_refused_at_start(model_dir):
    from transformers import AutoConfig

    from kvcomm_agents.errors import UnsupportedModelError
    from kvcomm_vllm.connector import _check_supported

    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e5, "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="supported"):
        _check_supported(_config(), config)


def test_prefill_ahead_copies_serve_the_shared_question_to_a_later_reader_exactly(client):
    """The client's prefill-ahead (kvcomm_vllm.text_ahead, what VLLMEngine sends by default): once
    B was seen reading A's question after its own system text, A's next question comes with a
    one-token copy of B's prefix and that question. B's request is then claimed up to the end of
    the question (an exact prefix), and its greedy output is vLLM dense's token for token; a
    question sent without the copy is claimed no further than B's own prefix."""
    from kvcomm_vllm.text_ahead import PrefillAhead
    from kvcomm_agents.prompt import render_prompt

    book = PrefillAhead()
    systems = {"ahead_a": SYSTEM_A, "ahead_b": SYSTEM_B}

    def prompt(agent, question):
        layout = render_prompt(client.tokenizer, [{"role": "system", "content": systems[agent]},
                                                  {"role": "user", "content": question}])
        return layout.ids.tolist(), [layout.tokens_within(*s) for s in layout.content_spans if s is not None]

    def step(agent, question, *, ahead=True):
        ids, spans = prompt(agent, question)
        if ahead:
            for reader, copy in book.copies_for(agent, ids, spans):
                client.generate(copy, reader, max_tokens=1)
            book.learn(agent, ids, spans)
        return client.generate(ids, agent, max_tokens=16), spans[-1].stop

    first, second, third = questions(23)[20:23]  # questions no other test sends
    step("ahead_a", first)
    step("ahead_b", first)
    step("ahead_a", second)  # with the copy for B
    served, question_end = step("ahead_b", second)
    assert served.kv_transfer_params["kvcomm"]["reused_tokens"] >= question_end
    ids, _ = prompt("ahead_b", second)
    dense = client.generate(ids, "ahead_b", reuse=False, max_tokens=16)
    assert served.outputs[0].token_ids == dense.outputs[0].token_ids
    step("ahead_a", third, ahead=False)  # no copy
    unserved, question_end = step("ahead_b", third, ahead=False)
    assert unserved.kv_transfer_params["kvcomm"]["reused_tokens"] < question_end


def test_reply_copies_serve_the_newest_reply_to_its_reader_exactly(client):
    """The client's reply copies (kvcomm_vllm.reply_ahead, what VLLMEngine sends by default while
    a sender streams): once B was seen reading A's reply, A's next reply is copied into B's
    prompt every CHUNK ids as prefix_only one-token requests. Each copy claims exact prefixes
    only; B's own request is then claimed up to the reply's last chunk, and its greedy output is
    vLLM dense's token for token. Without the copies the claim ends before the reply."""
    from examples.tasks import debate_messages
    from kvcomm_vllm.reply_ahead import CHUNK, HOLD, ReplyAhead, copy_prompt

    book = ReplyAhead()
    encode = lambda text: client.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    def graph(question, *, copies=True):
        a_ids = client.ids(debate_messages(1, 2, question, []))
        book.learn("reply_a", a_ids)
        bases = book.bases("reply_a", a_ids)
        reply = client.generate(a_ids, "reply_a", max_tokens=48).outputs[0].text
        ids = encode(reply)
        book.finished("reply_a", a_ids, ids)
        claims = []
        for end in range(CHUNK, len(ids) + 1, CHUNK) if copies else ():  # as the stream sends them
            for reader, base in bases:
                copy = client.generate(copy_prompt(base, ids[:end]), reader, max_tokens=1, prefix_only=True)
                report = copy.kv_transfer_params["kvcomm"]
                claims.append(report["reused_tokens"] == report["prefix_tokens"])
        b_ids = client.ids(debate_messages(2, 2, question, [reply]))
        book.learn("reply_b", b_ids)
        return b_ids, client.generate(b_ids, "reply_b", max_tokens=16), claims, bases

    first, second, third = questions(26)[23:26]  # questions no other test sends
    graph(first)
    b_ids, served, claims, bases = graph(second)
    assert [reader for reader, _ in bases] == ["reply_b"] and claims and all(claims)  # exact prefixes only
    reply_start = len(bases[0][1])
    assert served.kv_transfer_params["kvcomm"]["reused_tokens"] >= len(b_ids) - (CHUNK + HOLD + 8) > reply_start
    dense = client.generate(b_ids, "reply_b", reuse=False, max_tokens=16)
    assert served.outputs[0].token_ids == dense.outputs[0].token_ids
    b_ids, unserved, _, bases = graph(third, copies=False)
    assert unserved.kv_transfer_params["kvcomm"]["reused_tokens"] <= len(bases[0][1])
