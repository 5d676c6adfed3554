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


def test_kvcomm_with_copies_records_anchors_then_reuses(engine):
    """The default's method (KVCOMM, mean offsets, entropy gate, recorded versions, KL budget)
    with reply and text copies switched on (tests/conftest.py, MECHANICS): on the first question solver two computes the question (in
    solver one's prompt it followed another system text, inside the context window) as a new
    anchor, and solver one's reply after it; that call teaches solver one where its readers put
    the question and its reply. On the last question solver one computed the question after each
    reader's system text while it decoded, both readers reuse it, and solver three reuses solver
    two's reply, computed in its framing."""
    kvcomm = KVCommEngine(engine.model, engine.tokenizer, config=mechanics())
    assert (kvcomm.config.method, kvcomm.config.experimental.estimator) == ("kvcomm", "mean")
    first, last = (per_question := _debates(kvcomm))[0], per_question[-1]
    second = _by_kind(first[1])
    assert second[("user", None)].reason == "new_anchor" and second[("user", None)].gate.offsets is None
    assert second[("solver-1", "assistant")].status == "prefilled"
    assert last[0].framed_versions >= 1
    for reader in last[1:]:
        assert _by_kind(reader)[("user", None)].gate.offsets == "framed"
    third = [d for d in last[2].decisions if d.segment.kind == ("solver-2", "assistant") and d.status == "reused"]
    assert third and third[0].gate.offsets == "framed"
    assert ReuseSummary.of(s for s in last[1:]).token_share > 0.5
    assert kvcomm.anchors.anchors(("user", None)) >= 2 and kvcomm.anchors.nbytes() > 0


def test_without_framed_replies_estimates_wait_for_the_kl_budget(engine):
    """Without copies, on the third question the gate consults two anchors for the question
    (readers put it after their own system texts), but no audit has measured estimated offsets
    within kl_budget yet: both readers compute it, and what follows it."""
    kvcomm = KVCommEngine(engine.model, engine.tokenizer,
                          config=mechanics(reply_copies=False, text_copies=False))
    last = _debates(kvcomm)[-1]
    for reader in last[1:]:
        held = _by_kind(reader)[("user", None)]
        assert (held.reason, held.gate.anchors) == ("over_kl_budget", 2)
        assert all(d.status == "prefilled" for d in reader.decisions if d.segment.kind[1] == "assistant")
