"""Token counts from the served model's own tokenizer and chat template.

LangChain counts a chat model's tokens (``get_num_tokens``, ``get_num_tokens_from_messages``,
``trim_messages(token_counter=model)``) with GPT-2's tokenizer unless the model says otherwise,
fetched from the model hub: offline that retries for about half a minute and counts 0, so a
history trimmed to the context never shrinks; online it counts another model's ids. ChatKVComm
counts with the engine's tokenizer instead, and counts a history as the engine renders it.

``trim_messages`` also counts histories that are no prompt: with ``strategy="last"`` it counts
them reversed, and cut anywhere. A template that refuses such a list (roles that must
alternate) gets an additive count instead: each message's text plus the ids a reply's framing
takes in this template, plus a one-message prompt's own framing (:func:`additive_count`): close
to what the template would render, not exact (roles' framings may differ by an id or two).
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Optional, Sequence

from kvcomm_agents import InvalidMessagesError
from kvcomm_agents.paged import normalize_messages, render_prompt

__all__ = ["text_ids", "prompt_count", "additive_count"]

#: Probe texts for measuring a template's framing: plain words that tokenize alone.
_PROBE_USER, _PROBE_REPLY = "Hello", "Hi"
#: Per tokenizer: the framing measured for each set of tools (:func:`_framing`).
_FRAMINGS: "weakref.WeakKeyDictionary[Any, dict[str, dict[str, int]]]" = weakref.WeakKeyDictionary()


def text_ids(tokenizer, text: str) -> list[int]:
    """The ids ``text`` takes in a prompt body (no special tokens added)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_count(tokenizer, messages: Sequence[dict[str, Any]], tools: Optional[list] = None) -> int:
    """The ids a call with ``messages`` (engine dicts) and ``tools`` prefills: exactly its
    ``usage_metadata["input_tokens"]`` where the chat template renders the messages as a prompt,
    else :func:`additive_count`.

    Raises:
        InvalidMessagesError: messages a call would refuse (checked first, so that only the
            template's refusal of an order falls back to the additive count).
        InvalidRequestError: ``tools`` given to a template that does not render them (as a call
            would be refused).
    """
    normalize_messages(messages)
    try:
        return len(render_prompt(tokenizer, messages, tools=tools).ids)
    except InvalidMessagesError:
        return additive_count(tokenizer, messages, tools)


def additive_count(tokenizer, messages: Sequence[dict[str, Any]], tools: Optional[list] = None) -> int:
    """A count that adds up message by message, for lists the template refuses: each message's
    text ids (its tool calls' names and arguments included) plus the framing ids a reply takes
    in this template, plus the framing of a one-message prompt (generation header, any default
    system text and ``tools``)."""
    framing = _framing(tokenizer, tools)
    body = sum(len(text_ids(tokenizer, _text(message))) + framing["per_message"] for message in messages)
    return body + framing["prompt"]


def _framing(tokenizer, tools: Optional[list]) -> dict[str, int]:
    """Measured on the template, cached per tokenizer and tools: ``per_message``, the ids a
    reply's framing takes (a user-then-reply prompt against the user-only one, the reply's text
    taken off); ``prompt``, what a one-message prompt takes beyond its text's ids."""
    key = json.dumps(tools, sort_keys=True, default=str)
    try:
        cache = _FRAMINGS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced is measured each time
        cache = {}
    if key not in cache:
        user = {"role": "user", "content": _PROBE_USER}
        try:
            alone = len(render_prompt(tokenizer, [user], tools=tools).ids)
            reply = {"role": "assistant", "content": _PROBE_REPLY}
            answered = len(render_prompt(tokenizer, [user, reply], tools=tools).ids)
        except InvalidMessagesError:  # a template refusing both probes: the texts alone are counted
            cache[key] = {"per_message": 0, "prompt": 0}
        else:
            per_message = max(0, answered - alone - len(text_ids(tokenizer, _PROBE_REPLY)))
            cache[key] = {"per_message": per_message,
                          "prompt": max(0, alone - len(text_ids(tokenizer, _PROBE_USER)) - per_message)}
    return cache[key]


def _text(message: dict[str, Any]) -> str:
    """A message's text as counted: its content, and its tool calls' names and arguments."""
    calls = message.get("tool_calls") or []
    return str(message.get("content") or "") + "".join(
        call["function"]["name"] + _arguments(call["function"].get("arguments", {})) for call in calls)


def _arguments(arguments: Any) -> str:
    """A call's arguments as JSON text (a string is JSON text already)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
