"""Request checks: a bad argument is refused with a clear error before any compute."""

from __future__ import annotations

import operator
from typing import Optional, Sequence

from .errors import InvalidMessagesError, InvalidRequestError
from .prompt import PromptLayout

__all__ = ["check_agent", "byte_budget", "segment_not_kept", "check_segment_fits", "segment_kind", "check_max_new_tokens", "check_reply_ids",
           "check_length", "check_reuse", "reply_budget", "default_reply_budget", "DEFAULT_MAX_NEW_TOKENS"]

#: The most tokens a reply takes where the call names no ``max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 256


def check_length(layout: PromptLayout, limit: Optional[int], new_tokens: int, what: str) -> None:
    """Prompt plus reply must fit the model's ``limit`` positions (None: no limit)."""
    n = int(layout.ids.numel())
    if limit is not None and n >= limit:
        raise InvalidRequestError(f"the prompt alone ({n} tokens) fills the model's {limit} positions, leaving none "
                                  f"for {what}; shorten the messages")
    if limit is not None and n + new_tokens > limit:
        raise InvalidRequestError(
            f"the prompt ({n} tokens) plus {what} ({new_tokens}) exceeds the model's {limit} positions; "
            f"shorten the messages or lower {what} to at most {max(limit - n, 0)}"
        )


def reply_budget(layout: PromptLayout, limit: Optional[int], max_new_tokens: Optional[int]) -> int:
    """The most tokens a reply after ``layout``'s prompt may take: ``max_new_tokens`` where the
    call names it, refused where prompt plus reply exceed the model's ``limit`` positions (None:
    no limit); else :data:`DEFAULT_MAX_NEW_TOKENS`, or fewer where the positions end first, as
    an OpenAI-style server reads an unset ``max_tokens`` (the reply then ends with
    ``finish_reason="length"``)."""
    if max_new_tokens is None:
        max_new_tokens = default_reply_budget(int(layout.ids.numel()), limit)
    check_length(layout, limit, max_new_tokens, "max_new_tokens")
    return max_new_tokens


def default_reply_budget(num_prompt: int, limit: Optional[int]) -> int:
    """:data:`DEFAULT_MAX_NEW_TOKENS`, or fewer where the model's ``limit`` positions (None: no
    limit) end first after ``num_prompt`` prompt tokens (at least 1: a prompt that fills them is
    refused with its own message)."""
    return DEFAULT_MAX_NEW_TOKENS if limit is None else max(1, min(DEFAULT_MAX_NEW_TOKENS, limit - num_prompt))


def check_agent(agent) -> None:
    if not isinstance(agent, str) or not agent:
        raise InvalidMessagesError("agent must be a non-empty string")


def segment_kind(kind) -> tuple:
    """``add_segment``'s ``kind``: a ``(producer, role)`` pair (a non-empty string and a string or
    None); None: ``("document", None)``."""
    if kind is None:
        return ("document", None)
    pair = tuple(kind) if isinstance(kind, (tuple, list)) else None
    if (pair is None or len(pair) != 2 or not isinstance(pair[0], str) or not pair[0]
            or not (pair[1] is None or isinstance(pair[1], str))):
        raise InvalidRequestError(f"kind must be a (producer, role) pair such as ('document', None), got {kind!r}")
    return pair


def check_segment_fits(layout: PromptLayout, limit: Optional[int]) -> None:
    """A segment's text, rendered as a message, must leave room in the model's ``limit``
    positions (None: no limit): no prompt holding a longer one could be served."""
    n = int(layout.ids.numel())
    if limit is not None and n >= limit:
        raise InvalidRequestError(f"the text takes {n} tokens as a message and the model has {limit} positions: "
                                  "no prompt holding it could be served; split it")


def segment_not_kept(tokens: int, min_match_tokens: int, store) -> InvalidRequestError:
    """Why ``add_segment``'s text of ``tokens`` ids was not kept by ``store`` (a ``SegmentStore``):
    too short to be matched, or no room: entries running calls hold (pinned, not evictable until
    they finish) fill the budget, or the text's KV alone is larger than it."""
    if tokens < min_match_tokens:
        return InvalidRequestError(f"the text is {tokens} tokens, shorter than min_match_tokens ({min_match_tokens})")
    stats = store.stats()
    if stats.pinned:
        return InvalidRequestError(
            f"the store's budget ({stats.max_bytes} bytes) is held by entries running calls are using "
            f"({stats.pinned} pinned), so the text was not kept: add it again once they finish, or raise store_max_bytes")
    return InvalidRequestError(f"the text's KV is larger than the store's byte budget ({stats.max_bytes} bytes): "
                               "raise store_max_bytes")


def check_reuse(value) -> None:
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"reuse must be True, False or None (the engine's setting), got {value!r}")


def byte_budget(value) -> int:
    """``value`` as a byte budget: an integer >= 0 (0 holds nothing; a NumPy integer is one)."""
    try:
        budget = operator.index(value)
    except TypeError:
        budget = -1
    if isinstance(value, bool) or budget < 0:
        raise InvalidRequestError(f"a byte budget must be an integer >= 0, got {value!r}")
    return budget


def check_max_new_tokens(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1 or None (up to {DEFAULT_MAX_NEW_TOKENS}, "
                                  f"fewer where the model's positions end first), got {value!r}")


def check_reply_ids(ids, vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or len(ids) == 0:
        raise InvalidRequestError("reply_ids must be a non-empty sequence of token ids")
    out = []
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(f"reply_ids holds {token!r}, not a token id of this vocabulary (0..{vocab_size - 1})")
        out.append(token)
    return out
