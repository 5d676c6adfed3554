"""Property-based: random message layouts and shared-text placements. Reuse off equals dense
exactly; reuse on never crashes, its token counts add up, and every decision carries a reason."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcomm_agents import KVCommConfig, KVCommEngine

from .conftest import QUESTION, REPLY, first_logits

pytestmark = pytest.mark.model

WORDS = st.sampled_from(["Solver", "said", "check", "the", "answer", "72", "48 plus 24", "again:", "\n", "Note"])
FILLER = st.lists(WORDS, max_size=6).map(" ".join)
ROLES = st.sampled_from(["user", "user", "assistant", "tool"])


@st.composite
def layouts(draw):
    """A system message, then 1-4 messages, each some filler around an earlier shared text (the
    question or a reply, whole or cut) at a random place, sometimes with its segment reference."""
    shared = draw(st.lists(st.sampled_from(["question", "reply", "reply-cut", "none"]), min_size=1, max_size=4))
    messages = [{"role": "system", "content": draw(FILLER) or "You are a solver."}]
    for kind in shared:
        text = {"question": QUESTION, "reply": REPLY, "reply-cut": REPLY[: draw(st.integers(5, len(REPLY)))],
                "none": ""}[kind]
        content = f"{draw(FILLER)} {text} {draw(FILLER)}".strip() or "ok"
        messages.append({"role": draw(ROLES), "content": content, "ref": kind == "reply" and draw(st.booleans())})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "Your turn."})
    return messages


@pytest.fixture(scope="module")
def engines(request):
    llama, tokenizer = request.getfixturevalue("llama"), request.getfixturevalue("tokenizer")
    made = {method: KVCommEngine(llama, tokenizer, config=KVCommConfig(method=method, experimental={"min_anchors": 1}))
            for method in ("dense", "rerotate", "kvcomm", "exact_prefix")}
    refs = {}
    for method, engine in made.items():  # every engine has seen the question and the reply
        first = engine.replay([{"role": "system", "content": "You are solver one."}, {"role": "user", "content": QUESTION}],
                              agent="s1", reply_ids=engine.tokenizer(REPLY)["input_ids"] + [engine.tokenizer.eos_token_id])
        refs[method] = first.result.segment
    return made, refs


def _with_refs(messages, ref):
    out = []
    for message in messages:
        entry = {"role": message["role"], "content": message["content"]}
        if message.get("ref") and ref is not None:
            entry["segment"] = ref
        out.append(entry)
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=layouts(), agent=st.sampled_from(["s2", "s3"]))
def test_reuse_off_is_dense_and_reuse_on_always_explains_itself(engines, messages, agent):
    made, refs = engines
    dense_logits = first_logits(made["dense"], _with_refs(messages, None), agent)
    for method in ("rerotate", "kvcomm", "exact_prefix"):
        engine = made[method]
        call = _with_refs(messages, refs[method])
        off = engine.replay(call, agent=agent, reply_ids=[engine.tokenizer.eos_token_id], reuse=False)
        torch.testing.assert_close(off.first_token_logits, dense_logits, atol=1e-5, rtol=0)
        result = engine.chat(call, agent=agent, max_new_tokens=3)
        stats = result.stats
        assert stats.reused_tokens + stats.computed_tokens == stats.prompt_tokens
        assert stats.computed_tokens >= 1  # the last prompt token is always computed
        for decision in stats.decisions:
            assert decision.reason and decision.status in ("reused", "prefilled")
            assert (decision.status == "reused") == (decision.reused_tokens > 0 and decision.reason in
                                                      ("reference", "content", "exact_prefix"))
        if stats.reused_tokens == 0:
            assert stats.dense_reason is not None
