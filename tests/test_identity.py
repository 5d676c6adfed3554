"""A model's identity is its weights: KV of other weights is never used, and changing weights in
place is noticed before the next call."""

import copy

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.identity import WeightsWatch, weights_digest

from .conftest import REPLY, first_logits, replayed, solver_messages
from .conftest import mechanics

pytestmark = pytest.mark.model


def _tuned(model):
    """A copy that differs from ``model`` in one element of a middle layer (a fine-tune step)."""
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-2
    return tuned


def test_a_tuned_copy_never_reuses_the_base_models_kv(llama, tokenizer):
    base = KVCommEngine(llama, tokenizer, config=mechanics(method="rerotate"))
    tuned_model = _tuned(llama)
    tuned = KVCommEngine(tuned_model, tokenizer, config=mechanics(method="rerotate"), store=base.store)
    assert tuned.fingerprint != base.fingerprint
    replayed(base, solver_messages("You are solver one."), "s1")  # the base's prefix, question, reply
    messages = solver_messages("You are solver one.", REPLY)  # extends the base's exact prefix
    result = replayed(tuned, messages, "s1")
    assert result.stats.reused_tokens == 0  # not even the exact prefix
    assert {d.reason for d in result.stats.decisions} <= {"foreign_model"}
    dense = KVCommEngine(tuned_model, tokenizer, config=KVCommConfig(method="dense"))
    torch.testing.assert_close(first_logits(tuned, messages), first_logits(dense, messages), atol=1e-5, rtol=0)


@pytest.mark.parametrize("setting", [{"rms_norm_eps": 1e-2}, {"hidden_act": "gelu"}])
def test_a_model_with_the_same_weights_and_other_settings_never_reuses_the_others_kv(tokenizer, setting):
    from kvcomm_agents.testing import tiny_llama

    base_model, other_model = tiny_llama(tokenizer), tiny_llama(tokenizer, **setting)  # equal weights
    base = KVCommEngine(base_model, tokenizer, config=mechanics(method="exact_prefix"))
    other = KVCommEngine(other_model, tokenizer, config=mechanics(method="exact_prefix"), store=base.store)
    assert other.fingerprint != base.fingerprint
    replayed(base, solver_messages("You are solver one."), "s1")
    messages = solver_messages("You are solver one.", REPLY)  # extends the base's exact prefix
    assert replayed(other, messages, "s1").stats.reused_tokens == 0
    dense = KVCommEngine(other_model, tokenizer, config=KVCommConfig(method="dense"))
    torch.testing.assert_close(first_logits(other, messages), first_logits(dense, messages), atol=1e-5, rtol=0)


def test_settings_a_forward_does_not_read_do_not_split_the_cache(llama, tokenizer):
    from kvcomm_agents.support import model_fingerprint

    before = model_fingerprint(llama, tokenizer)
    quiet = copy.deepcopy(llama)
    quiet.config.output_attentions, quiet.config.use_cache = False, False
    assert model_fingerprint(quiet, tokenizer) == before


def test_an_in_place_weight_change_is_noticed_before_the_next_call(llama, tokenizer):
    model = copy.deepcopy(llama)
    engine = KVCommEngine(model, tokenizer, config=mechanics(method="kvcomm", experimental={"min_anchors": 1}))
    replayed(engine, solver_messages("You are solver one."), "s1")
    replayed(engine, solver_messages("You are solver two.", REPLY), "s2")
    before = engine.fingerprint
    assert not engine._weights.changed()  # calls themselves do not count as weight changes
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.01)  # e.g. an optimiser step
    messages = solver_messages("You are solver one.", REPLY)
    result = replayed(engine, messages, "s1")
    assert engine.fingerprint != before
    assert result.stats.reused_tokens == 0
    dense = KVCommEngine(model, tokenizer, config=KVCommConfig(method="dense"))
    torch.testing.assert_close(first_logits(engine, solver_messages("You are solver three.")),
                               first_logits(dense, solver_messages("You are solver three.")), atol=1e-5, rtol=0)


def test_refresh_drops_anchors_learned_from_other_weights(llama, tokenizer):
    model = copy.deepcopy(llama)
    engine = KVCommEngine(model, tokenizer, config=mechanics(experimental={"min_anchors": 1}))
    replayed(engine, solver_messages("You are solver one."), "s1")
    replayed(engine, solver_messages("You are solver two.", REPLY), "s2")
    assert engine.anchors.nbytes() > 0
    assert engine.refresh_fingerprint() == engine.fingerprint  # unchanged weights: nothing dropped
    assert engine.anchors.nbytes() > 0
    model.model.norm.weight.data[0] += 1.0  # into .data: no version bump, same memory: only refresh can tell
    assert not engine._weights.changed()
    engine.refresh_fingerprint()
    assert engine.anchors.nbytes() == 0
    check = engine._calls.parts.rerotation_check  # its plans must find only KV of the new weights
    assert check.fingerprint == engine.fingerprint


def test_digest_covers_every_tensor_and_the_active_adapters(llama):
    model = copy.deepcopy(llama)
    digest = weights_digest(model)
    model.model.layers[1].register_buffer("extra", torch.zeros(3))  # e.g. an adapter's state
    assert weights_digest(model) != digest
    watch = WeightsWatch(model)
    model.active_adapters = ["math"]  # PEFT-style adapter switch
    assert watch.changed()
    switched = weights_digest(model)
    model.active_adapters = ["code"]
    assert weights_digest(model) != switched


def test_the_watch_notices_a_replaced_module_or_tensor_and_nothing_else(llama):
    model = copy.deepcopy(llama)
    watch = WeightsWatch(model)
    model(torch.tensor([[1, 2, 3]]))  # a forward reads the weights, it writes none
    assert not watch.changed()
    mlp = model.model.layers[0].mlp
    mlp.up_proj = torch.nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)  # a LoRA-style injection
    assert watch.changed()
    watch.mark()
    layer = model.model.layers[1].mlp.down_proj
    layer.weight = torch.nn.Parameter(layer.weight.detach().clone())  # the same values, another tensor
    assert watch.changed()
    watch.mark()
    first, second = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    first.q_proj.weight, second.q_proj.weight = second.q_proj.weight, first.q_proj.weight  # moved between slots
    assert watch.changed()


def test_the_watch_notices_a_renamed_module_and_reads_a_shared_one_once(llama):
    model = copy.deepcopy(llama)
    watch = WeightsWatch(model)
    layers = model.model.layers
    layers._modules["renamed"] = layers._modules.pop("0")
    assert watch.changed()
    model.model.tied = model.model.layers[1]  # the same module reached twice
    watch.mark()
    assert not watch.changed()


def test_weights_given_new_memory_through_data_are_noticed_before_the_next_call(llama, tokenizer):
    model = copy.deepcopy(llama)
    engine = KVCommEngine(model, tokenizer, config=mechanics(method="exact_prefix"))
    replayed(engine, solver_messages("You are solver one."), "s1")
    before = engine.fingerprint
    weight = model.model.layers[1].mlp.down_proj.weight
    weight.data = weight.data * 1.5  # no version bump, no new parameter: new memory
    messages = solver_messages("You are solver one.", REPLY)  # extends the stored exact prefix
    result = replayed(engine, messages, "s1")
    assert engine.fingerprint != before and result.stats.reused_tokens == 0


def test_weights_laid_out_anew_keep_the_digest_without_reading_it_again(llama, tokenizer, monkeypatch):
    from kvcomm_agents import identity
    from kvcomm_agents.engines.weight_layout import pin_layout, weights_as_loaded

    model = copy.deepcopy(llama)
    engine = KVCommEngine(model, tokenizer, config=mechanics())
    before = engine.fingerprint
    reads, moved = [], []
    monkeypatch.setattr(identity, "_compute_digest", lambda m: reads.append(m) or "read again")
    for layout in ("transposed", "as_loaded"):
        pin_layout(model, layout)  # the same values in another memory order
        moved.append(engine._weights.changed())
        replayed(engine, solver_messages("You are solver one."), "s1")
        assert engine.fingerprint == before
    assert any(moved)
    weights_as_loaded(model)
    replayed(engine, solver_messages("You are solver two."), "s2")
    assert engine.fingerprint == before and reads == []


@pytest.mark.parametrize("relay", ["weights_as_loaded", "pin_layout"])
def test_a_weight_change_then_a_new_layout_is_still_noticed(llama, tokenizer, relay):
    from kvcomm_agents.engines import weight_layout

    model = copy.deepcopy(llama)
    engine = KVCommEngine(model, tokenizer, config=mechanics(method="exact_prefix"))
    replayed(engine, solver_messages("You are solver one."), "s1")
    before = engine.fingerprint
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.5)  # a fine-tune step
    if relay == "pin_layout":
        weight_layout.pin_layout(model, "transposed")
    else:
        weight_layout.weights_as_loaded(model)  # before save_pretrained, as its docs ask
    result = replayed(engine, solver_messages("You are solver one.", REPLY), "s1")
    assert engine.fingerprint != before and result.stats.reused_tokens == 0
