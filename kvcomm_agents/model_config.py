"""What the engine reads of a transformers config: the decoder's settings (a composite,
vision-language config keeps them under its text config), its attention window, and the
settings a forward depends on (what makes two models' KV interchangeable, with the weights)."""

from __future__ import annotations

from typing import Optional

__all__ = ["text_config", "sliding_window", "forward_settings"]

#: Config fields a forward in eval mode does not depend on (bookkeeping, outputs asked for,
#: labels, generation ids, initialisation, the dtype, which the model's own is read for):
#: left out of :func:`forward_settings` so that they do not split a cache.
NOT_IN_FORWARD = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "chunk_size_feed_forward",
})


def text_config(config):
    """The decoder's settings: a composite config's text config, a text model's own config."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def sliding_window(config) -> Optional[int]:
    """The decoder's attention window in tokens, None for full attention."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def forward_settings(config) -> dict:
    """The decoder's config fields a forward depends on, as JSON-ready values: every field but
    :data:`NOT_IN_FORWARD` and private ones (the attention kernel's name among them: sdpa and
    eager compute the same KV). Two models with equal weights and equal settings compute the
    same KV; a norm's epsilon, an activation or a head count that differs makes other KV."""
    fields = text_config(config).to_dict()
    return {key: value for key, value in fields.items() if key not in NOT_IN_FORWARD and not key.startswith("_")}
