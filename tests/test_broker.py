"""KVCommBroker: KVCOMM for a runtime that computes prompts itself, driven here by a minimal
runtime on transformers (claims loaded as a plain prefix, the rest computed, greedy decode), on
both tiny families. The vLLM connector drives the same broker (tests_vllm/)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from kvcomm_agents import KVCommConfig
from kvcomm_agents.paged.broker import for_runtime
from kvcomm_agents.engines import hf
from kvcomm_agents.testing import PrefixOnlyRuntime

from .conftest import QUESTION, tol


SYSTEM_A = "You are agent A. Solve the problem step by step."
SYSTEM_B = "You are agent B. Check the answer of the other agent."


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exact_prefix_claim_gives_dense_output(family, llama, qwen2, tokenizer):
    model = {"llama": llama, "qwen2": qwen2}[family]
    runtime = PrefixOnlyRuntime(model, tokenizer)
    first = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}]
    _, reply_ids, report, claim, _ = runtime.run(runtime.ids(first), "a")
    assert claim.length == 0 and report["dense_reason"] == "nothing_to_reuse"
    follow = runtime.ids(first + [{"role": "assistant", "content": tokenizer.decode(reply_ids)},
                                  {"role": "user", "content": "Give the final answer only."}])
    logits, _, report, claim, _ = runtime.run(follow, "a")
    assert claim.length >= len(runtime.ids(first))  # the whole first prompt at least, exactly
    assert report["reused_tokens"] == claim.length and report["computed_tokens"] == len(follow) - claim.length
    torch.testing.assert_close(logits, runtime.dense_logits(follow), atol=tol(1e-4), rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_shared_run_after_an_agents_own_prefix_is_claimed_rerotated(family, llama, qwen2, tokenizer):
    """The second request of agent B: its own prefix is exact (its first request), the question
    another agent computed is re-rotated into place; layer 0 of re-rotated KV is exact."""
    model = {"llama": llama, "qwen2": qwen2}[family]
    runtime = PrefixOnlyRuntime(model, tokenizer, method="rerotate")
    runtime.run(runtime.ids([{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "Hello there."}]), "b")
    # long enough that the part of it before the prompt's dense tail (claims.DENSE_TAIL) is claimed
    question = QUESTION + " Then say how many are left after a week, and check the arithmetic twice, step by step."
    runtime.run(runtime.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": question}]), "a")
    prompt = runtime.ids([{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": question}])
    _, _, report, claim, pre = runtime.run(prompt, "b")
    found = [d for d in report["decisions"] if d["status"] == "reused"]
    assert found and found[0]["reason"] == "tokens"
    assert claim.length > found[0]["span"][0]  # past B's exact prefix, into the question
    with torch.inference_mode():
        dense = hf.prefill(model, torch.tensor(prompt), torch.arange(len(prompt)))
    claimed = torch.arange(claim.length)
    served = hf.kv_at_positions(pre.cache, pre.slot_positions, claimed)
    exact = hf.kv_at_positions(dense.cache, dense.slot_positions, claimed)
    torch.testing.assert_close(served.layer(0)[0], exact.layer(0)[0], atol=tol(1e-4), rtol=0)  # keys
    torch.testing.assert_close(served.layer(0)[1], exact.layer(0)[1], atol=tol(1e-5), rtol=0)  # values


def test_reuse_off_runs_dense_and_is_still_kept(llama, tokenizer):
    runtime = PrefixOnlyRuntime(llama, tokenizer)
    ids = runtime.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}])
    _, _, report, claim, _ = runtime.run(ids, "a", reuse=False)
    assert claim.length == 0 and report["dense_reason"] == "reuse_off"
    _, _, report, claim, _ = runtime.run(ids, "a")
    assert claim.length == len(ids) - 1  # its prompt was kept: an exact prefix now


def test_a_missing_segment_costs_speed_not_correctness(llama, tokenizer):
    runtime = PrefixOnlyRuntime(llama, tokenizer)
    ids = runtime.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}])
    runtime.run(ids, "a")
    runtime.broker.store.clear()  # evicted, or a restarted server
    logits, _, report, claim, _ = runtime.run(ids, "a")
    assert claim.length == 0 and report["dense_reason"] == "nothing_to_reuse"
    torch.testing.assert_close(logits, runtime.dense_logits(ids), atol=tol(1e-4), rtol=0)


def test_requests_are_planned_once_and_forgotten_when_finished(llama, tokenizer):
    runtime = PrefixOnlyRuntime(llama, tokenizer)
    ids = list(range(5, 60))
    first = runtime.broker.plan("x", ids, "a")
    assert runtime.broker.plan("x", ids, "a") is first  # the scheduler may ask again
    assert runtime.broker.claim("x") is first
    assert runtime.broker.report("x")["prompt_tokens"] == len(ids)
    runtime.broker.drop("x")
    assert runtime.broker.report("x") == {} and runtime.broker.finish("x", [1, 2], None) == {}
    assert runtime.broker.claim("x") is None
    with pytest.raises(KeyError):  # the connector's worker turns this into blocks vLLM recomputes
        runtime.broker.aligned("x")


def test_runtime_settings_never_make_holes():
    config = for_runtime(KVCommConfig(reply_copies=True))
    assert config.recompute_head == 0 and config.experimental.own_text == "reuse"
    assert not config.reply_copies  # copies ride on the HF engine's decode steps
    assert config.audit_every == 0 and config.method == "kvcomm"


def test_without_audits_estimated_offsets_are_held_back_unless_asked_for(llama, tokenizer):
    """A runtime cannot audit, so the KL budget is never measured: by default the broker serves
    exact prefixes and versions only and prefills what would need estimated offsets (reason
    over_kl_budget); kl_budget=None serves the estimates unmeasured."""
    def debate(runtime):
        gates = []
        for q in range(6):
            question = f"{QUESTION} Round {q}: what is {q} times {q + 3}?"
            a_ids = runtime.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": question}])
            _, reply, _, _, _ = runtime.run(a_ids, "a")
            b_ids = runtime.ids([{"role": "system", "content": SYSTEM_B},
                                 {"role": "user", "content": f"{question}\nAgent A said: {tokenizer.decode(reply)}"}])
            _, _, report, _, _ = runtime.run(b_ids, "b")
            gates += [(d["reason"], (d.get("gate") or {}).get("offsets")) for d in report["decisions"]]
        return gates

    held = debate(PrefixOnlyRuntime(llama, tokenizer))
    unmeasured = debate(PrefixOnlyRuntime(llama, tokenizer, kl_budget=None))
    assert not any(offsets == "estimated" for _, offsets in held), held
    assert any(reason == "over_kl_budget" for reason, _ in held), held
    assert any(offsets == "estimated" for _, offsets in unmeasured), unmeasured


def test_a_prefix_only_request_claims_its_exact_prefix_only_and_is_kept_as_one(llama, tokenizer):
    """The client's copies (kvcomm_vllm.reply_ahead) ask for exact prefixes only: where the same
    prompt would be claimed past B's own prefix with a re-rotated run, a prefix_only request
    claims B's exact prefix and computes the rest; what it computed then serves as an exact
    prefix of the same ids (the reader's own request)."""
    runtime = PrefixOnlyRuntime(llama, tokenizer, method="rerotate")
    question = QUESTION + " Then say how many are left after a week, and check the arithmetic twice, step by step."
    runtime.run(runtime.ids([{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "Hello there."}]), "b")
    runtime.run(runtime.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": question}]), "a")
    prompt = runtime.ids([{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": question}])
    _, _, report, claim, _ = runtime.run(prompt, "b", new_tokens=1, prefix_only=True)
    assert report["reused_tokens"] == report["prefix_tokens"] == claim.length > 0
    assert not [d for d in report["decisions"] if d["status"] == "reused" and d["reason"] != "exact_prefix"]
    _, _, report, claim, _ = runtime.run(prompt, "b", new_tokens=1)
    assert report["prefix_tokens"] == claim.length == len(prompt) - 1  # the copy's prompt, exact


def _slowed(runtime, seconds: float):
    """Every capture of ``runtime``'s broker starts ``seconds`` late, before it takes the broker's
    lock (a capture thread busy with earlier ones)."""
    keep = runtime.broker._keep

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return keep(*args, **kwargs)

    runtime.broker._keep = slow


def _decided(report):
    """A report without its segment ids (drawn per store)."""
    return {**report, "decisions": [(d["span"], d["status"], d["reason"], d["found_by"], d["reused_tokens"],
                                      d["segment"]["kind"]) for d in report["decisions"]]}


def test_a_capture_kept_in_the_background_serves_the_next_request_as_an_inline_one(llama, tokenizer):
    """The connector may keep finished requests on the broker's capture thread; a request planned
    after another finished waits for the capture it could read, so it claims and decides what the
    inline capture gives it, however late the capture runs: the same agent following up, and
    another agent quoting the reply after a system text no request had."""
    inline = PrefixOnlyRuntime(llama, tokenizer)
    background = PrefixOnlyRuntime(llama, tokenizer, background_capture=True)
    _slowed(background, 0.3)
    first = [{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}]
    for runtime in (inline, background):
        _, reply_ids, _, _, _ = runtime.run(runtime.ids(first), "a")
        if runtime is background:
            assert runtime.broker.pending_captures == 1  # finish returned before keeping
        reply = tokenizer.decode(reply_ids)
        follow = runtime.ids(first + [{"role": "assistant", "content": reply},
                                      {"role": "user", "content": "Give the final answer only."}])
        quote = runtime.ids([{"role": "system", "content": SYSTEM_B},
                             {"role": "user", "content": f"{QUESTION}\nAgent A said: {reply}"}])
        runtime.results = [runtime.run(quote, "b"), runtime.run(follow, "a")]
    for (logits_i, reply_i, report_i, claim_i, _), (logits_b, reply_b, report_b, claim_b, _) in zip(
            inline.results, background.results):
        assert claim_b.length == claim_i.length and reply_b == reply_i
        assert _decided(report_b) == _decided(report_i)
        torch.testing.assert_close(logits_b, logits_i, atol=0, rtol=0)
    quoted, followed = inline.results[0][2], inline.results[1][2]
    assert any(d["segment"]["kind"] == ["a", "assistant"] for d in quoted["decisions"])  # A's reply found: captured
    assert followed["reused_tokens"] > 0
    background.broker.settle()
    assert background.broker.pending_captures == 0


def test_a_failed_background_capture_costs_reuse_not_the_output(llama, tokenizer, caplog):
    runtime = PrefixOnlyRuntime(llama, tokenizer, background_capture=True)

    def broken(*args, **kwargs):
        raise RuntimeError("paged KV unreadable")

    runtime.broker.capture.keep_call = broken
    ids = runtime.ids([{"role": "system", "content": SYSTEM_A}, {"role": "user", "content": QUESTION}])
    with caplog.at_level(logging.ERROR, logger="kvcomm_agents.capture"):
        runtime.run(ids, "a")
        logits, _, report, claim, _ = runtime.run(ids, "a")
    assert "capture failed" in caplog.text
    assert claim.length == 0 and report["dense_reason"] == "nothing_to_reuse"
    torch.testing.assert_close(logits, runtime.dense_logits(ids), atol=tol(1e-4), rtol=0)
