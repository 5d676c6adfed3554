"""Lay out a receiver's prompt: the chat template's exact ids, their character offsets, and
where each message's content sits in the rendered text.

Every strategy sees these same ids, so with reuse off the engine is plain transformers, token
for token, with one difference: tool calls in a history given to a template that would drop them
(the embedded model's has no tool support) are written into their turn as text. Tokenizing a
chat prompt piece by piece gives other ids (measured on SmolLM2: 128 of 128 prompts, by 0 to 4
tokens), so pieces are never tokenized alone.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch

from jinja2 import TemplateError, TemplateSyntaxError

from .errors import InvalidMessagesError, InvalidRequestError

__all__ = ["PromptLayout", "render_prompt", "renders_tools", "renders_tool_calls", "normalize_messages", "token_span"]


@dataclass
class PromptLayout:
    """A tokenized chat prompt.

    Attributes:
        text: the rendered template string.
        ids: ``[N]`` int64 CPU tensor, exactly the ids ``apply_chat_template(..., tokenize=True)``
            gives.
        offsets: for each id, its ``(start, end)`` character span in ``text``.
        content_spans: for each message, the ``(start, end)`` span of its content in ``text``,
            or None when the template altered the content beyond recognition.
        refs: for each message, its ``segment`` entry as given (a ``SegmentRef``, its dict, or
            None): where the message says its content came from.
    """

    text: str
    ids: torch.Tensor
    offsets: list[tuple[int, int]]
    content_spans: list[Optional[tuple[int, int]]]
    refs: list[Any] = field(default_factory=list)
    _bounds: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)
    _id_list: Optional[list[int]] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of_ids(cls, ids) -> "PromptLayout":
        """A prompt known only by its token ids (a runtime that got ids, not messages): one
        pseudo-message covering every token, no text. Shared text is then found only as runs of
        token ids (:func:`~kvcomm_agents.matching.find_token_matches`); each token's "character
        span" is its own index."""
        ids = torch.as_tensor(list(ids) if not isinstance(ids, torch.Tensor) else ids, dtype=torch.long).flatten().cpu()
        n = int(ids.numel())
        return cls("", ids, [(i, i + 1) for i in range(n)], [(0, n)], [None])

    def content(self, index: int) -> Optional[str]:
        """Message ``index``'s content as rendered, or None if it could not be located."""
        span = self.content_spans[index]
        return None if span is None else self.text[span[0] : span[1]]

    def tokens_within(self, start: int, end: int) -> range:
        """Indices of the tokens lying entirely inside characters ``[start, end)``
        (:func:`token_span`; by bisection where the offsets' starts and ends never decrease, as
        a tokenizer's do: planning asks this for every segment found, of every prompt)."""
        if self._bounds is None:
            starts, ends = [s for s, _ in self.offsets], [e for _, e in self.offsets]
            ordered = all(a <= b for a, b in zip(starts, starts[1:])) and all(a <= b for a, b in zip(ends, ends[1:]))
            self._bounds = (starts, ends) if ordered else ()
        if not self._bounds:
            return token_span(self.offsets, start, end)
        starts, ends = self._bounds
        first = bisect.bisect_left(starts, start)
        return range(first, max(first, bisect.bisect_right(ends, end)))

    def id_list(self) -> list[int]:
        """``ids`` as Python ints (cached): per-token lookups without indexing a tensor."""
        if self._id_list is None:
            self._id_list = self.ids.tolist()
        return self._id_list


#: Roles chat templates render; anything else is refused (a typo would render as nonsense).
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate messages and return plain dicts for the chat template (``segment`` removed).

    Content must be a string; a list of text parts (``"text"`` strings or ``{"type": "text",
    "text": ...}``, as LangChain and OpenAI write them) is joined; an assistant message that only
    calls tools may have ``None``. Everything else gets :class:`InvalidMessagesError` naming the
    message, before any compute.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidMessagesError("messages must be a non-empty list of dicts")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise InvalidMessagesError(f"message {i} must be a dict with 'role' and 'content'")
        role = message["role"]
        if role not in ROLES:
            raise InvalidMessagesError(f"message {i} has role {role!r}; known roles: {', '.join(ROLES)}")
        entry = {k: v for k, v in message.items() if k != "segment"}
        entry["content"] = _content_text(i, role, message.get("content"), bool(message.get("tool_calls")))
        _check_encodable(i, entry["content"])
        for call in message.get("tool_calls") or ():
            _check_tool_call(i, call)
        clean.append(entry)
    return clean


def _check_encodable(index: int, text: str) -> None:
    """Refuse text no tokenizer can take: a lone surrogate (``"\\ud800"``) is no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidMessagesError(f"message {index} content is not valid Unicode text ({error.reason} at "
                                   f"character {error.start}); decode its bytes with errors='replace'") from None


def _check_tool_call(index: int, call: Any) -> None:
    """A tool call as chat templates read it: ``{"function": {"name": str, "arguments": mapping
    or JSON text}}`` (or the function's fields at the top level)."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        raise InvalidMessagesError(f"message {index} has a tool call that is not a mapping with a name and "
                                   f"arguments: {call!r}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidMessagesError(f"message {index} has a tool call without a function name: {call!r}; "
                                   "write {'type': 'function', 'function': {'name': ..., 'arguments': {...}}}")
    if not isinstance(function.get("arguments"), (Mapping, str)):
        raise InvalidMessagesError(f"message {index} has a tool call to {name!r} whose 'arguments' is not a mapping "
                                   f"or JSON text: {call!r}")


def _content_text(index: int, role: str, content: Any, calls_tools: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and calls_tools:
        return ""
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidMessagesError(
                    f"message {index} has a {kind!r} content part; kvcomm-agents serves text-only models "
                    "(text parts are joined, images and audio are not supported)"
                )
        return "".join(texts)
    raise InvalidMessagesError(
        f"message {index} content must be a string or a list of text parts, got {type(content).__name__}"
    )


def token_span(offsets: list[tuple[int, int]], start: int, end: int) -> range:
    """Indices of tokens whose character span lies entirely inside ``[start, end)``.

    Tokens are contiguous in the text, so the result is a contiguous range.
    """
    first = next((i for i, (s, _) in enumerate(offsets) if s >= start), len(offsets))
    last = first
    while last < len(offsets) and offsets[last][1] <= end:
        last += 1
    return range(first, last)


def renders_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template renders a ``tools`` list (tool calling possible)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "tools" in template


def renders_tool_calls(tokenizer, tools=None) -> bool:
    """Whether the chat template a call with ``tools`` renders with (a template per use: the
    ``tool_use`` one where tools are given and it exists) renders an assistant message's
    ``tool_calls``."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") if tools and "tool_use" in template else template.get("default")
    return isinstance(template, str) and "tool_calls" in template


def _calls_as_text(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls written after its content as
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, for a template that would drop
    them (the turn would render empty, and the tool result after it would answer nothing)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    written = []
    for call in calls:  # each checked by normalize_messages
        function = call.get("function", call)
        arguments = function["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # kept as the model wrote it
        try:
            payload = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
        except (TypeError, ValueError) as error:
            raise InvalidMessagesError(f"message {index} has a tool call whose arguments are not JSON: {error}") from error
        written.append(f"<tool_call>{payload}</tool_call>")
    text = "\n".join(written)
    content = message["content"]
    return {**{k: v for k, v in message.items() if k != "tool_calls"},
            "content": f"{content}\n{text}" if content else text}


def render_prompt(tokenizer, messages: Sequence[Mapping[str, Any]], *, tools=None) -> PromptLayout:
    """Render messages with the tokenizer's chat template and tokenize the result as a whole.

    Raises:
        InvalidMessagesError: the template refused the messages (e.g. roles that must alternate).
        InvalidRequestError: no chat template, or ``tools`` given to one that does not render them.
    """
    clean = normalize_messages(messages)
    if not tokenizer.chat_template:
        raise InvalidRequestError("the tokenizer has no chat template; load the chat (instruct) model's tokenizer")
    if tools and not renders_tools(tokenizer):
        raise InvalidRequestError("the tokenizer's chat template does not render tools, so tool calling cannot work; "
                                  "use a model whose template supports tools, or call it without tools")
    if not renders_tool_calls(tokenizer, tools):
        clean = [_calls_as_text(i, message) for i, message in enumerate(clean)]
    kwargs = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True, **kwargs)
    except TemplateSyntaxError:
        raise  # the template itself is broken, not the messages
    except TemplateError as error:  # the template's raise_exception, or a field it needs missing
        raise InvalidMessagesError(
            f"the model's chat template refused these messages ({type(error).__name__}: {error}); if it asks for "
            "alternating roles, merge consecutive messages of one role into one") from error
    except (TypeError, ValueError, KeyError, AttributeError) as error:  # a field of a type it cannot use
        raise InvalidMessagesError(
            f"the model's chat template failed on these messages ({type(error).__name__}: {error}); check that "
            "each message's fields have the types the template expects (strings, tool calls as mappings)") from error
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
    offsets = [tuple(span) for span in encoded["offset_mapping"]]
    refs = [message.get("segment") for message in messages]
    return PromptLayout(text, ids, offsets, _locate_contents(text, clean), refs)


def _locate_contents(text: str, messages: list[dict[str, Any]]) -> list[Optional[tuple[int, int]]]:
    """Find each message's content in the rendered text, in order."""
    spans: list[Optional[tuple[int, int]]] = []
    cursor = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str) or not content:
            spans.append(None)
            continue
        start = text.find(content, cursor)
        if start < 0:
            spans.append(None)
            continue
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans
