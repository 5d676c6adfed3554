"""Linear weights laid out for the CPU (kvcomm_agents.engines.weight_layout): the same function in
either layout, the measured choice follows the timings it is given, engines keep it, and a later
process reads it back instead of measuring again."""

import json

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.engines.weight_layout import (FORMAT, choose_layout, layout_key, linear_weights, pin_layout, set_layout,
                                                 weights_as_loaded)
from kvcomm_agents.identity import weights_digest
from kvcomm_agents.testing import tiny_llama, tiny_qwen2

pytestmark = pytest.mark.model


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf.run_forward(model, ids, hf.new_cache(model), last_logits_only=False)[0]


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2])
def test_transposed_weights_compute_the_same_logits_and_keep_parameters_and_ties(tokenizer, build):
    model = build(tokenizer, tie_word_embeddings=True)
    ids = torch.tensor([tokenizer.encode("the answer is 72 because 48 plus 24")])
    before, digest = _logits(model, ids), weights_digest(model, recompute=True)
    weights = linear_weights(model)
    objects = [id(w) for w in weights]
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert sum(w is model.lm_head.weight for w in weights) == 1  # a tied head counted once

    set_layout(weights, "transposed")
    assert all(w.t().is_contiguous() and not w.is_contiguous() for w in weights)
    assert [id(w) for w in linear_weights(model)] == objects  # the same parameters, new strides
    assert model.lm_head.weight is model.get_input_embeddings().weight
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)
    assert weights_digest(model, recompute=True) == digest  # the same values: the same identity

    set_layout(weights, "as_loaded")
    assert all(w.is_contiguous() for w in weights)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)


def test_subclasses_of_linear_are_left_alone(tokenizer):
    class Quantized(torch.nn.Linear):
        pass

    model = tiny_llama(tokenizer)
    layer = model.model.layers[0].mlp
    layer.down_proj = Quantized(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    assert all(w is not layer.down_proj.weight for w in linear_weights(model))


@pytest.mark.parametrize("faster", [True, False])
def test_the_measured_choice_keeps_the_faster_layout_by_the_margin(tokenizer, faster):
    model = tiny_llama(tokenizer)
    seen = []

    def probe(m):  # the transposed layout takes 0.91x (faster, as on an AVX512 host) or 0.97x (within the margin)
        transposed = all(w.t().is_contiguous() for w in linear_weights(m))
        seen.append(transposed)
        return (0.91 if faster else 0.97) if transposed else 1.0

    choice = choose_layout(model, "measured", probe=probe)
    assert seen == [False, True, True, False]  # in turns, balanced against a load that drifts
    assert choice.reason == "measured" and set(choice.seconds) == {"as_loaded", "transposed"}
    assert choice.layout == ("transposed" if faster else "as_loaded")
    assert all((w.t().is_contiguous() if faster else w.is_contiguous()) for w in linear_weights(model))

    again = choose_layout(model, "measured", probe=lambda m: pytest.fail("measured twice"))
    assert (again.layout, again.reason) == (choice.layout, "chosen before")


def test_a_burst_of_load_during_one_turn_does_not_decide_the_layout(tokenizer):
    """Another process loading the CPU while the first layout is timed makes it look slower than
    it is: each layout's fastest turn is kept, so the burst is outvoted."""
    turns = []

    def probe(m):
        transposed = all(w.t().is_contiguous() for w in linear_weights(m))
        turns.append(transposed)
        slow = 3.0 if len(turns) == 1 else 1.0  # the burst, in the first turn only
        return slow * (0.97 if transposed else 1.0)  # transposed within the margin: not faster

    choice = choose_layout(tiny_llama(tokenizer), "measured", probe=probe)
    assert choice.layout == "as_loaded" and choice.seconds == {"as_loaded": 1.0, "transposed": 0.97}


def test_keep_touches_nothing_and_reports_the_layout_the_model_has(tokenizer):
    model = tiny_llama(tokenizer)
    assert choose_layout(model, "keep").layout == "as_loaded"
    set_layout(linear_weights(model), "transposed")
    assert choose_layout(model, "keep").layout == "transposed"
    assert all(w.t().is_contiguous() for w in linear_weights(model))


def test_an_engine_lays_out_its_model_as_configured_and_answers_as_before(tokenizer):
    plain, relaid = tiny_llama(tokenizer, seed=3), tiny_llama(tokenizer, seed=3)
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April."}]
    keep = KVCommEngine(plain, tokenizer, config=KVCommConfig(weight_layout="keep", draft_tokens=0))
    transposed = KVCommEngine(relaid, tokenizer, config=KVCommConfig(weight_layout="transposed", draft_tokens=0))
    assert keep.weight_layout.layout == "as_loaded" and all(w.is_contiguous() for w in linear_weights(plain))
    assert transposed.weight_layout.layout == "transposed"
    assert keep.fingerprint == transposed.fingerprint  # the same weights: KV may be shared
    a = keep.chat(messages, agent="a", max_new_tokens=12)
    b = transposed.chat(messages, agent="a", max_new_tokens=12)
    assert a.token_ids == b.token_ids


def test_plain_transformers_keeps_the_model_as_given():
    assert KVCommConfig.plain_transformers().weight_layout == "keep"
    assert KVCommConfig().weight_layout == "measured"


def test_weights_as_loaded_undoes_the_choice_so_a_tied_model_saves_and_reloads_equal(tokenizer, tmp_path):
    model = tiny_llama(tokenizer, tie_word_embeddings=True)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    assert choose_layout(model, "transposed").layout == "transposed"
    weights_as_loaded(model)
    assert all(w.is_contiguous() for w in linear_weights(model))
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(before[name], t) for name, t in reloaded.state_dict().items())
    measured = choose_layout(model, "measured", probe=lambda m: 1.0)  # forgotten: measured again
    assert (measured.layout, measured.reason) == ("as_loaded", "measured")


def test_weights_off_the_cpu_are_left_alone_and_the_choice_says_why(tokenizer):
    model = tiny_llama(tokenizer).to("meta")  # stands in for an accelerator or offloaded weights
    for choice in (choose_layout(model, "measured", probe=lambda m: pytest.fail("probed off the CPU")),
                   choose_layout(model, "transposed"), pin_layout(model, "transposed")):
        assert (choice.layout, choice.reason) == ("as_loaded", "not on the CPU")
    assert all(w.is_contiguous() for w in linear_weights(model))



def _transposed_faster(m) -> float:
    return 0.5 if all(w.t().is_contiguous() for w in linear_weights(m)) else 1.0


def test_a_measured_choice_is_remembered_for_the_next_process_and_keyed_on_shapes_not_values(tokenizer, tmp_path):
    first = choose_layout(tiny_llama(tokenizer, seed=1), "measured", probe=_transposed_faster, folder=tmp_path)
    assert (first.layout, first.reason) == ("transposed", "measured")
    (written,) = tmp_path.glob("layout-*.json")
    data = json.loads(written.read_text())
    assert data["format"] == FORMAT and data["layout"] == "transposed" and data["seconds"] == first.seconds

    other_values = tiny_llama(tokenizer, seed=2)  # a new model object, as in a new process
    again = choose_layout(other_values, "measured", probe=lambda m: pytest.fail("measured again"), folder=tmp_path)
    assert (again.layout, again.reason, again.seconds) == ("transposed", "remembered", first.seconds)
    assert all(w.t().is_contiguous() and not w.is_contiguous() for w in linear_weights(other_values))

    other_shapes = tiny_llama(tokenizer, intermediate_size=96)  # another key: measured, written beside the first
    assert choose_layout(other_shapes, "measured", probe=lambda m: 1.0, folder=tmp_path).reason == "measured"
    assert len(list(tmp_path.glob("layout-*.json"))) == 2
    assert layout_key(linear_weights(other_shapes)) != data["key"]


@pytest.mark.parametrize("content", ["{not json", "[" * 200_000, json.dumps({"format": "other", "layout": "transposed"}),
                                     json.dumps({"format": FORMAT, "key": {"cpu": "another"}, "layout": "transposed"})])
def test_an_unreadable_or_foreign_layout_file_costs_a_measurement_not_an_error(tokenizer, tmp_path, content):
    model = tiny_llama(tokenizer)
    choose_layout(tiny_llama(tokenizer), "measured", probe=lambda m: 1.0, folder=tmp_path)
    (path,) = tmp_path.glob("layout-*.json")
    path.write_text(content)
    choice = choose_layout(model, "measured", probe=_transposed_faster, folder=tmp_path)
    assert (choice.layout, choice.reason) == ("transposed", "measured")
    assert json.loads(path.read_text())["layout"] == "transposed"  # measured, and written over it


def test_a_remembered_choice_is_decided_again_under_the_margin_given(tokenizer, tmp_path):
    choose_layout(tiny_llama(tokenizer), "measured", probe=lambda m: 1.0, folder=tmp_path)
    (path,) = tmp_path.glob("layout-*.json")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "layout": "as_loaded", "seconds": {"as_loaded": 1.0, "transposed": 0.92}}))
    strict = choose_layout(tiny_llama(tokenizer), "measured", margin=0.9, folder=tmp_path,
                           probe=lambda m: pytest.fail("measured again"))
    loose = choose_layout(tiny_llama(tokenizer), "measured", margin=0.95, folder=tmp_path,
                          probe=lambda m: pytest.fail("measured again"))
    assert (strict.layout, loose.layout) == ("as_loaded", "transposed")  # 0.92 is within 0.95, not 0.9
    assert strict.reason == loose.reason == "remembered"


def test_a_weight_contiguous_both_ways_does_not_hide_the_layout(tokenizer):
    model = tiny_llama(tokenizer)
    model.model.gate = torch.nn.Linear(model.config.hidden_size, 1, bias=False)  # [1, H]: either order
    assert choose_layout(model, "transposed").layout == "transposed"
    assert choose_layout(model, "keep").layout == "transposed"  # the choice, not a re-detection
    fresh = tiny_llama(tokenizer)
    fresh.model.gate = torch.nn.Linear(fresh.config.hidden_size, 1, bias=False)
    set_layout(linear_weights(fresh), "transposed")
    assert choose_layout(fresh, "keep").layout == "transposed"


def test_an_engine_remembers_its_layout_where_it_remembers_measurements(tokenizer, tmp_path):
    config = KVCommConfig(remember_measurements=str(tmp_path), draft_tokens=0)
    first = KVCommEngine(tiny_llama(tokenizer), tokenizer, config=config)
    assert first.weight_layout.reason == "measured" and len(list(tmp_path.glob("layout-*.json"))) == 1
    second = KVCommEngine(tiny_llama(tokenizer), tokenizer, config=config)
    assert (second.weight_layout.reason, second.weight_layout.layout) == ("remembered", first.weight_layout.layout)
    off = KVCommEngine(tiny_llama(tokenizer), tokenizer, config=config.model_copy(update={"remember_measurements": False}))
    assert off.weight_layout.reason == "measured"


@pytest.mark.parametrize("slow_after, forwards", [(60.0, 8), (0.0, 4)])
def test_the_probe_times_a_slow_model_once_per_shape(tokenizer, monkeypatch, slow_after, forwards):
    from kvcomm_agents.engines import weight_layout

    calls = []
    run_forward = hf.run_forward
    monkeypatch.setattr(weight_layout.hf, "run_forward", lambda *a, **k: calls.append(1) or run_forward(*a, **k))
    monkeypatch.setattr(weight_layout, "SLOW_FORWARD_S", slow_after)
    assert weight_layout._probe_seconds(tiny_llama(tokenizer)) > 0
    assert len(calls) == forwards  # per shape (1 id, 5 ids): a warm-up, then 3 timed or 1
