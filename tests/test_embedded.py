"""The embedded SmolLM2-135M-Instruct: converted offline, three agents reuse each other's KV."""

import pytest

from kvcomm_agents import KVCommConfig, KVCommEngine, ReuseSummary
from .conftest import mechanics

pytestmark = pytest.mark.embedded

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


@pytest.fixture(scope="module")
def engine():
    return KVCommEngine.from_pretrained(device="cpu", config=mechanics(method="rerotate"))


def solver_messages(k: int, question: str, replies: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": f"You are solver {k + 1} of 3. Solve the problem step by step."},
                {"role": "user", "content": question}]
    return messages + [{"role": "user", "content": f"Solver {j + 1} answered:\n{r}"} for j, r in enumerate(replies)]


def test_embedded_model_is_smollm2(engine):
    config = engine.model.config
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    assert "quantization_config" not in config.to_dict()


def test_three_agents_reuse_and_stats_add_up(engine):
    replies = []
    for k in range(3):
        result = engine.chat(solver_messages(k, QUESTION, replies), agent=f"solver-{k + 1}", max_new_tokens=24)
        stats = result.stats
        assert stats.reused_tokens + stats.computed_tokens == stats.prompt_tokens
        assert stats.generated_tokens == len(result.token_ids) > 0
        if k:
            assert stats.reused_tokens > 0 and stats.mode == "reuse"
            reused_kinds = {d.segment.kind for d in stats.decisions if d.status == "reused"}
            assert ("user", None) in reused_kinds and ("solver-1", "assistant") in reused_kinds
        replies.append(result.text)


QUESTIONS = [
    "A baker makes 12 loaves in the morning and 9 in the afternoon. He sells 15. How many loaves are left?",
    "Tom has 3 boxes with 8 pencils each. He gives away 5 pencils. How many pencils does he have now?",
    "A ticket costs $7. How much do 6 tickets cost if there is a $4 discount on the total?",
]


def _debates(kvcomm) -> list[list]:
    """Each question's three solver calls' stats."""
    per_question = []
    for question in QUESTIONS:
        replies, calls = [], []
        for k in range(3):
            result = kvcomm.chat(solver_messages(k, question, replies), agent=f"solver-{k + 1}", max_new_tokens=16)
            replies.append(result.text)
            calls.append(result.stats)
        per_question.append(calls)
    return per_question


def _by_kind(stats):
    return {d.segment.kind: d for d in stats.decisions}


def test_default_kvcomm_records_anchors_then_reuses(engine):
    """The default engine (KVCOMM, mean offsets, entropy gate, recorded versions, KL budget,
    framed replies): on the first question solver two reuses the question as it is (its KV was
    computed after the same system-prompt ending) and computes solver one's reply in context (a
    new anchor, recorded; and it teaches solver one how readers frame its replies); solver three
    reuses that reply with solver two's recorded offsets (the same text precedes it). On the
    last question solver one's reply was computed in its readers' framing while it was decoded,
    and both readers reuse it."""
    kvcomm = KVCommEngine(engine.model, engine.tokenizer, config=mechanics())
    assert (kvcomm.config.method, kvcomm.config.experimental.estimator) == ("kvcomm", "mean")
    first, last = (per_question := _debates(kvcomm))[0], per_question[-1]
    second = _by_kind(first[1])
    assert second[("user", None)].gate.offsets == "base"
    assert second[("solver-1", "assistant")].reason == "new_anchor"
    assert _by_kind(first[2])[("solver-1", "assistant")].gate.offsets == "recorded"
    assert last[0].framed_versions >= 1
    assert _by_kind(last[1])[("solver-1", "assistant")].gate.offsets == "framed"
    assert _by_kind(last[2])[("solver-1", "assistant")].gate.offsets in ("framed", "recorded")
    assert ReuseSummary.of(s for s in last[1:]).token_share > 0.5
    assert kvcomm.anchors.anchors(("solver-1", "assistant")) >= 2 and kvcomm.anchors.nbytes() > 0


def test_without_framed_replies_estimates_wait_for_the_kl_budget(engine):
    """Without framed replies, on the third question the gate consults two anchors for solver
    one's reply, but no audit has measured estimated offsets within kl_budget yet, so solver two
    computes it (and records it), and solver three reuses solver two's record."""
    kvcomm = KVCommEngine(engine.model, engine.tokenizer,
                          config=mechanics(reply_copies=False, text_copies=False))
    last = _debates(kvcomm)[-1]
    held = _by_kind(last[1])[("solver-1", "assistant")]
    assert (held.reason, held.gate.anchors) == ("over_kl_budget", 2)
    assert _by_kind(last[2])[("solver-1", "assistant")].gate.offsets == "recorded"
    assert ReuseSummary.of(s for s in last[1:]).token_share > 0.3
