"""The embedded SmolLM2-135M-Instruct: converted offline, three agents reuse each other's KV."""

import pytest

from kvcomm_agents import KVCommEngine

pytestmark = pytest.mark.embedded

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


@pytest.fixture(scope="module")
def engine():
    return KVCommEngine.from_pretrained(device="cpu")


def test_embedded_model_is_smollm2(engine):
    config = engine.model.config
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 30, 3)
    assert "quantization_config" not in config.to_dict()


def test_three_agents_reuse_and_stats_add_up(engine):
    replies = []
    for k in range(3):
        messages = [{"role": "system", "content": f"You are solver {k + 1} of 3. Solve the problem step by step."},
                    {"role": "user", "content": QUESTION}]
        messages += [{"role": "user", "content": f"Solver {j + 1} answered:\n{r}"} for j, r in enumerate(replies)]
        result = engine.chat(messages, agent=f"solver-{k + 1}", max_new_tokens=24)
        stats = result.stats
        assert stats.reused_tokens + stats.computed_tokens == stats.prompt_tokens
        assert stats.generated_tokens == len(result.token_ids) > 0
        if k:
            assert stats.reused_tokens > 0 and stats.mode == "reuse"
            reused_kinds = {d.segment.kind for d in stats.decisions if d.status == "reused"}
            assert ("user", None) in reused_kinds and ("solver-1", "assistant") in reused_kinds
        replies.append(result.text)
