"""Exceptions raised by kvcomm-agents.

The tree::

    KVCommError                      base class; catch this to handle every library error
    ├── UnsupportedModelError        the model cannot run with KV reuse (raised at load)
    ├── RopeCheckError               the load-time re-rotation self-check failed
    │                                (subclass of UnsupportedModelError)
    ├── ModelNotAvailableError       the model or the embedded default cannot be found offline
    ├── AnchorFileError              an anchor file is unreadable or of another model (engine unchanged)
    └── InvalidRequestError          an argument of a call is wrong (also a ``ValueError``)
        └── InvalidMessagesError     the messages given to ``chat`` are malformed

Argument errors are raised before any compute.

Warnings: :class:`BudgetWarning` (a ``UserWarning``) when a byte budget cannot hold even one
segment or anchor, so that reuse would silently stop; :class:`SharedTierWarning` (a
``UserWarning``) when a shared segment tier fails (down, or a blob that is not what its catalog
announced): the store serves from memory and computes what it cannot find.

A missing, evicted, stale or foreign cache segment is *not* an error: the engine prefills that
text instead and records the reason in ``ChatResult.stats.decisions``.
"""

from __future__ import annotations

__all__ = [
    "KVCommError",
    "UnsupportedModelError",
    "RopeCheckError",
    "ModelNotAvailableError",
    "AnchorFileError",
    "InvalidRequestError",
    "InvalidMessagesError",
    "BudgetWarning",
    "SharedTierWarning",
]

SUPPORTED_MODELS_HINT = (
    "kvcomm-agents reuses KV caches of decoder-only models with rotary position embeddings of "
    "rope_type 'default', 'linear' or 'llama3' (Llama, Qwen2, Mistral families and the like), "
    "loaded with attn_implementation 'sdpa' or 'eager', with a chat template and a fast tokenizer."
)
#: Appended where a model that cannot reuse KV could still be served without reuse.
DENSE_HINT = "To run any other causal LM without reuse, pass config=KVCommConfig(method='dense')."


class KVCommError(Exception):
    """Base class of every exception raised by kvcomm-agents."""


class UnsupportedModelError(KVCommError):
    """The model cannot be used with KV reuse; the message says why and what is supported."""

    def __init__(self, reason: str, *, dense_fallback: bool = True) -> None:
        self.reason = reason
        super().__init__(f"{reason}. {SUPPORTED_MODELS_HINT}" + (f" {DENSE_HINT}" if dense_fallback else ""))


class RopeCheckError(UnsupportedModelError):
    """Re-rotating the model's own layer-0 keys did not reproduce the keys it computes."""


class ModelNotAvailableError(KVCommError):
    """The requested model (or the embedded default) is not available on this machine."""


class AnchorFileError(KVCommError):
    """``load_anchors`` refused a file: unreadable, corrupted, or written for other weights. The
    engine's anchors are unchanged."""


class InvalidRequestError(KVCommError, ValueError):
    """An argument of a call is wrong; the message names it."""


class InvalidMessagesError(InvalidRequestError):
    """``messages`` is not a list of ``{"role": ..., "content": ...}`` dicts."""


class BudgetWarning(UserWarning):
    """A byte budget is too small to hold one segment or anchor: that KV is not kept."""


class SharedTierWarning(UserWarning):
    """A shared segment tier failed or returned a bad blob: that KV is computed instead."""
