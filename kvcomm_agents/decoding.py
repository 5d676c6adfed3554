"""Token selection, stop strings and incremental detokenization for the decode loop."""

from __future__ import annotations

import math
import random
from typing import Optional, Sequence

import torch

from .errors import InvalidRequestError

__all__ = ["TokenSampler", "TextAccumulator"]


class TokenSampler:
    """Greedy (``temperature == 0``) or nucleus sampling.

    Args:
        temperature: 0 for greedy, otherwise the softmax temperature.
        top_p: nucleus mass kept when sampling (1.0 keeps everything).
        seed: seeds the sampler's own generator; None draws a fresh seed.
        vocab_size: ids at or above it are never picked: a checkpoint's output matrix may have
            more rows than its tokenizer has tokens (padding rows), and an id the tokenizer
            cannot decode must not reach the reply. None picks from every row.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                 vocab_size: Optional[int] = None):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise InvalidRequestError(f"vocab_size must be a positive integer or None, got {vocab_size!r}")
        self.temperature = temperature
        self.top_p = top_p
        self.vocab_size = vocab_size
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed if seed is not None else random.getrandbits(63))

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick the next token id from ``[vocab]`` logits."""
        logits = logits[: self.vocab_size]
        if self.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < self.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator))


class TextAccumulator:
    """Decodes generated ids incrementally, applies stop strings, and yields safe text pieces.

    Text is held back while it ends in an incomplete UTF-8 sequence or could still become the
    start of a stop string, so a streamed piece is never taken back.
    """

    def __init__(self, tokenizer, stop: Optional[Sequence[str]] = None):
        self._tokenizer = tokenizer
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
        self._stop = [s for s in (stop or []) if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one id; returns the newly safe text (possibly empty)."""
        self.ids.append(token_id)
        text = self._tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = text[:cut]
            self.stopped = True
            return self.flush()
        self.text = text
        # an unfinished multi-byte character (U+FFFD) must not use up the stop-string holdback
        safe = len(text.rstrip("\ufffd")) - self._holdback
        if safe <= self._emitted:
            return ""
        piece = text[self._emitted : safe]
        self._emitted = safe
        return piece

    def flush(self) -> str:
        """The text not yet emitted (call once generation ends)."""
        piece = self.text[self._emitted :]
        self._emitted = len(self.text)
        return piece
