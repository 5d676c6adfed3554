"""Other decoder families than the Llama and Qwen2 shapes the rest of the suite runs on: each
loads, serves dense as ``generate`` does, and reuses across agents (tiny random models)."""

import pytest
import torch
import transformers

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.fidelity import first_token_kl
from kvcomm_agents.testing import tiny_model

from .conftest import mechanics

pytestmark = pytest.mark.model

#: family -> (model class, config class, config fields beyond tiny_llama's shape)
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"head_dim": None}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {"head_dim": None}),
    "granite": ("GraniteForCausalLM", "GraniteConfig", {"head_dim": None}),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {"head_dim": None, "sliding_window": None}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "head_dim": None,
                                                            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
}
DOCUMENT = "The report says the river rose two meters overnight and the bridge closed at dawn. " * 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_serves_dense_as_generate_does_and_reuses_across_agents(family, tokenizer):
    model_class, config_class, fields = FAMILIES[family]
    model = tiny_model(getattr(transformers, model_class), getattr(transformers, config_class), tokenizer, **fields)
    task = [{"role": "system", "content": "You are the reader."}, {"role": "user", "content": DOCUMENT + "Summarise it."}]
    ids = tokenizer.apply_chat_template(task, add_generation_prompt=True, tokenize=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    assert dense.chat(task, agent="reader", max_new_tokens=12).token_ids == plain.tolist()

    engine = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate"))
    reply = engine.chat(task, agent="reader", max_new_tokens=12)
    critic = [{"role": "system", "content": "You are the critic, be brief."}, task[1],
              {"role": "assistant", "content": reply.text}, {"role": "user", "content": "Check it."}]
    served = engine.greedy(critic, agent="critic", max_new_tokens=1)
    assert served.result.stats.reused_tokens > 0 and all(d.reason for d in served.result.stats.decisions)
    reference = dense.greedy(critic, agent="critic", max_new_tokens=1)
    # the re-rotated text read after another system text: 0.0001-0.043 on these tiny random
    # models, of the order of Llama's (the load-time check is what proves the rotation exact:
    # these models' near-flat logits hardly tell positions apart)
    assert first_token_kl(reference.logits[0], served.logits[0]) < 0.1

    follow_up = task + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Shorter, please."}]
    exact = engine.greedy(follow_up, agent="reader", max_new_tokens=1)  # its own turn: an exact prefix
    assert exact.result.stats.reused_tokens >= ids.shape[1]  # the reply too where its ids re-tokenize alike
    torch.testing.assert_close(exact.logits[0], dense.greedy(follow_up, agent="reader", max_new_tokens=1).logits[0],
                               atol=1e-4, rtol=0)
