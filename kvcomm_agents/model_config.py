"""What the engine reads of a transformers config: the decoder's settings (a composite,
vision-language config keeps them under its text config) and its attention window."""

from __future__ import annotations

from typing import Optional

__all__ = ["text_config", "sliding_window"]


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
