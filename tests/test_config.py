"""``KVCommConfig`` validation (no model): methods, ranges, unknown and removed fields refused,
the ``experimental`` sub-model, frozen instances, the sampler's argument checks."""

import re

import pytest
from pydantic import ValidationError

from kvcomm_agents import ExperimentalSettings, InvalidRequestError, KVCommConfig
from kvcomm_agents.decoding import TokenSampler


def test_defaults_are_kvcomm_with_the_papers_gate():
    config = KVCommConfig()
    assert (config.method, config.gamma, config.max_anchors, config.reuse) == ("kvcomm", 0.3, 20, True)
    assert config.experimental == ExperimentalSettings()
    assert (config.experimental.estimator, config.experimental.own_text, config.experimental.min_anchors) == (
        "mean", "in_context", 2)


@pytest.mark.parametrize("method", ["kvcomm", "rerotate", "exact_prefix", "dense"])
def test_every_method_is_accepted_and_only_dense_turns_reuse_off(method):
    assert KVCommConfig(method=method).reuse == (method != "dense")


@pytest.mark.parametrize("fields", [
    {"method": "none"}, {"method": "mean"}, {"method": None},
    {"gamma": 1.5}, {"gamma": -0.1}, {"min_match_tokens": 0}, {"max_anchors": 0}, {"store_max_bytes": -1},
    {"audit_every": -1}, {"audit_share": 0.0}, {"audit_share": 1.5},
    # removed settings are refused, not ignored
    {"reuse": False}, {"offsets": "none"}, {"template": "reuse"}, {"segment_reuse": False}, {"gate": "error"},
    {"max_error": 0.5}, {"offset_max_error": 1.0}, {"recompute_share": 0.5}, {"verify_rope": False},
    {"min_anchors": 1},  # moved into experimental
])
def test_invalid_and_unknown_fields_are_refused(fields):
    with pytest.raises(ValidationError):
        KVCommConfig(**fields)


def test_experimental_takes_a_dict_or_the_model_and_validates_it():
    config = KVCommConfig(experimental={"estimator": "weighted", "own_text": "reuse", "min_anchors": 1})
    assert isinstance(config.experimental, ExperimentalSettings)
    assert (config.experimental.estimator, config.experimental.own_text, config.experimental.min_anchors) == (
        "weighted", "reuse", 1)
    assert KVCommConfig(experimental=ExperimentalSettings(eviction_window=3)).experimental.eviction_window == 3
    for bad in ({"estimator": "median"}, {"own_text": "always"}, {"min_anchors": 0}, {"activation_top_p": 0.0},
                {"activation_top_p": 1.5}, {"anchor_temperature": 0.0}, {"min_prefix_tokens": 0},
                {"own_text_max_bytes": -1}, {"eviction_window": 0}, {"gamma": 0.3}):
        with pytest.raises(ValidationError):
            KVCommConfig(experimental=bad)


def test_configs_are_frozen_and_copied_with_updates():
    config = KVCommConfig()
    with pytest.raises(ValidationError):
        config.method = "dense"
    with pytest.raises(ValidationError):
        config.experimental.estimator = "weighted"
    copy = config.model_copy(update={"method": "rerotate", "dense_agents": frozenset({"judge"})})
    assert (copy.method, copy.dense_agents, config.method) == ("rerotate", frozenset({"judge"}), "kvcomm")
    assert KVCommConfig(dense_agents=["a", "b"]).dense_agents == frozenset({"a", "b"})
    assert KVCommConfig.model_validate(KVCommConfig(method="exact_prefix").model_dump()).method == "exact_prefix"


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"temperature": float("inf")}, {"temperature": True}, {"top_p": 0.0}, {"top_p": 1.01},
    {"seed": -1}, {"seed": 2**63}, {"seed": 1.5},
])
def test_sampler_arguments_are_request_errors(kwargs):
    with pytest.raises(InvalidRequestError):
        TokenSampler(**kwargs)


def test_a_setting_that_left_experimental_says_where_it_went():
    with pytest.raises(ValueError, match=r"reply_copies"):
        ExperimentalSettings(framed_replies=False)
    with pytest.raises(ValueError, match=r"removed"):
        KVCommConfig(experimental={"recompute_spread": 0.1})
    assert KVCommConfig(reply_copies=True).reply_copies is True


@pytest.mark.parametrize("settings, says", [
    ({"text_copies_when_cheaper": False}, "use KVCommConfig(copies_when_cheaper=...)"),
    ({"experimental": {"recompute_head": 4}}, "use KVCommConfig(recompute_head=...)"),
])
def test_a_renamed_or_moved_setting_says_what_to_write_instead(settings, says):
    with pytest.raises(ValidationError, match=re.escape(says)):
        KVCommConfig(**settings)
