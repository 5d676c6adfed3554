"""LangChain messages <-> the engine's message dicts, and tool calls in ``<tool_call>`` JSON style.

Replies produced by :class:`~kvcomm_langgraph.ChatKVComm` carry their segment reference in
``response_metadata["kvcomm"]["segment"]`` (a plain dict, so graph state stays JSON-safe); when
such a message comes back in a history, the reference travels with it to the engine. Any other
text (human messages, tool results, replies pasted into a prompt) is found by content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional, Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import ToolCall, tool_call

from kvcomm_agents import InvalidMessagesError

__all__ = ["to_engine_messages", "parse_tool_calls", "TOOL_CALL_PATTERN", "message_text"]

#: A ``<tool_call>`` block; the last one may be left open (a reply cut by ``max_tokens`` or by a
#: ``</tool_call>`` stop sequence, or a model that leaves the tag off), as Hermes-style parsers take it.
TOOL_CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


#: Another provider's chat roles, and the chat template's names for them.
ROLE_ALIASES = {"human": "user", "ai": "assistant"}
#: Content blocks in which a reply from another provider (Anthropic ``tool_use``, LangChain's
#: standard ``tool_call``) states a call its ``tool_calls`` already carry.
CALL_BLOCKS = ("tool_use", "tool_call")
#: A reply's reasoning (Anthropic ``thinking`` / ``redacted_thinking``, LangChain's standard
#: ``reasoning``): not part of what it said, so left out of the history, as chat templates of
#: reasoning models leave earlier turns' thinking out.
REASONING_BLOCKS = ("reasoning", "thinking", "redacted_thinking")


def message_text(message: BaseMessage) -> str:
    """A message's text: text blocks joined, ``json`` blocks as JSON text, a reply's call blocks
    left to its tool calls and its reasoning blocks left out; other blocks are refused (text-only
    models)."""
    content = message.content
    if isinstance(content, str):
        return content
    calls = {call.get("id") for call in getattr(message, "tool_calls", None) or []}
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            text = block.get("text", "")
            if not isinstance(text, str):
                raise InvalidMessagesError(f"a text content block's 'text' must be a string, got {type(text).__name__}")
            parts.append(text)
        elif isinstance(block, dict) and block.get("type") == "json" and "json" in block:
            try:
                parts.append(json.dumps(block["json"]))
            except (TypeError, ValueError) as error:
                raise InvalidMessagesError(f"a json content block must hold JSON-serialisable data: {error}") from None
        elif isinstance(block, dict) and block.get("type") in CALL_BLOCKS and block.get("id") in calls:
            continue
        elif isinstance(block, dict) and block.get("type") in REASONING_BLOCKS and isinstance(message, AIMessage):
            continue
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidMessagesError(f"ChatKVComm serves text-only models; got a {kind!r} content block")
    return "".join(parts)


def _segment_of(message: BaseMessage) -> Optional[dict]:
    """The segment ref ChatKVComm put in a reply's metadata; None for anything else there."""
    meta = getattr(message, "response_metadata", None) or {}
    kvcomm = meta.get("kvcomm") if isinstance(meta, dict) else None
    return kvcomm.get("segment") if isinstance(kvcomm, dict) else None


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages to ``{"role", "content", ...}`` dicts for the chat template.

    AI messages keep their tool calls (``{"type": "function", "function": {"name", "arguments"}}``)
    and their segment reference; tool messages keep ``name`` and ``tool_call_id``.
    """
    out = []
    for message in messages:
        if isinstance(message, SystemMessage):
            entry: dict[str, Any] = {"role": "system", "content": message_text(message)}
        elif isinstance(message, HumanMessage):
            entry = {"role": "user", "content": message_text(message)}
        elif isinstance(message, AIMessage):
            entry = {"role": "assistant", "content": message_text(message)}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"type": "function", "id": call.get("id"), "function": {"name": call["name"], "arguments": call["args"]}}
                    for call in message.tool_calls
                ]
            segment = _segment_of(message)
            if segment is not None and not message.tool_calls:
                entry["segment"] = segment
        elif isinstance(message, ToolMessage):
            entry = {"role": "tool", "content": message_text(message), "tool_call_id": message.tool_call_id}
            if message.name:
                entry["name"] = message.name
        elif isinstance(message, ChatMessage):
            entry = {"role": ROLE_ALIASES.get(message.role, message.role), "content": message_text(message)}
        else:
            raise InvalidMessagesError(f"unsupported message type {type(message).__name__}")
        if getattr(message, "name", None) and "name" not in entry and not isinstance(message, ToolMessage):
            entry["name"] = message.name
        out.append(entry)
    return out


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[dict]]:
    """Split a reply into its text and its ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    calls (Qwen2.5 / Hermes style).

    Returns:
        ``(text outside the calls, valid tool calls, invalid ones as {"name", "args", "error"})``.
    """
    calls: list[ToolCall] = []
    invalid: list[dict] = []
    for raw in TOOL_CALL_PATTERN.findall(text):
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        name = None
        try:
            payload = json.loads(raw)
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
            name, args = payload.get("name"), payload.get("arguments", payload.get("parameters", {}))
            name = name if isinstance(name, str) else None
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError("no string 'name' with an object of 'arguments'")
            calls.append(tool_call(name=name, args=args, id=call_id))
        except ValueError as error:  # json.JSONDecodeError is one
            invalid.append({"name": name, "args": raw, "id": call_id, "type": "invalid_tool_call",
                            "error": f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}: {error}'})
    remaining = TOOL_CALL_PATTERN.sub("", text).strip() if calls or invalid else text
    return remaining, calls, invalid
