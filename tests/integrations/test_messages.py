"""Message conversion and tool-call parsing (no model)."""

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from kvcomm_langgraph import parse_tool_calls, to_engine_messages
from kvcomm_langgraph.agents import node_agent


def test_roles_tool_calls_and_segment_refs_convert():
    ref = {"id": "abc", "kind": ["solver", "assistant"], "num_tokens": 3, "text_hash": "h", "fingerprint": "m"}
    messages = [
        SystemMessage("sys"), HumanMessage("question", name="alice"),
        AIMessage("reply", response_metadata={"kvcomm": {"segment": ref}}),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1"}]),
        ToolMessage("2", tool_call_id="c1", name="add"),
    ]
    out = to_engine_messages(messages)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "assistant", "tool"]
    assert out[1]["name"] == "alice" and out[2]["segment"] == ref
    assert out[3]["tool_calls"] == [{"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 1}}}]
    assert out[4] == {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "add"}


def test_text_blocks_join_and_images_are_refused():
    assert to_engine_messages([HumanMessage([{"type": "text", "text": "a"}, "b"])])[0]["content"] == "ab"
    with pytest.raises(ValueError, match="text-only"):
        to_engine_messages([HumanMessage([{"type": "image_url", "image_url": {"url": "x"}}])])


def test_another_providers_history_converts():
    from langchain_core.messages import ChatMessage

    call = {"name": "add", "args": {"a": 1}, "id": "toolu_1"}
    reply = AIMessage([{"type": "text", "text": "Adding."}, {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}],
                      tool_calls=[call])
    out = to_engine_messages([ChatMessage("hi", role="human"), reply,
                              ToolMessage([{"type": "json", "json": {"sum": 1}}], tool_call_id="toolu_1"),
                              ChatMessage("ok", role="ai")])
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "assistant"]
    assert out[1]["content"] == "Adding." and out[1]["tool_calls"][0]["function"]["name"] == "add"
    assert out[2]["content"] == '{"sum": 1}'
    stray = AIMessage([{"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}}])  # a call its tool_calls lack
    with pytest.raises(ValueError, match="'tool_use' content block"):
        to_engine_messages([stray])


def test_tool_calls_are_parsed_and_bad_ones_reported():
    text, calls, invalid = parse_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert text == "Let me add." and [(c["name"], c["args"]) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert calls[0]["id"].startswith("call_") and invalid == []
    text, calls, invalid = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert calls == [] and len(invalid) == 1 and invalid[0]["args"] == "{not json}"
    assert parse_tool_calls("plain") == ("plain", [], [])


@pytest.mark.parametrize("raw", ['{"arguments": {}}', '"add"', "null", '[{"name": "add"}]', '{"name": "add", "arguments": 3}'])
def test_a_malformed_tool_call_is_reported_with_the_shape_it_needs(raw):
    _, calls, invalid = parse_tool_calls(f"<tool_call>{raw}</tool_call>")
    assert calls == [] and invalid[0]["args"] == raw
    assert invalid[0]["error"].startswith('a tool call must be a JSON object {"name": ..., "arguments": {...}}')


@pytest.mark.parametrize("reply, raw", [
    ('Let me add.<tool_call>{"name": "add", "arguments": {"a": 48', '{"name": "add", "arguments": {"a": 48'),  # cut by max_tokens
    ('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 48, "b": 24}}\n', None),  # a </tool_call> stop
])
def test_a_call_left_open_at_the_end_of_a_reply_is_still_a_call(reply, raw):
    text, calls, invalid = parse_tool_calls(reply)
    assert text == "Let me add."  # no tag or JSON left in the reply's text
    if raw is None:
        assert [(c["name"], c["args"]) for c in calls] == [("add", {"a": 48, "b": 24})] and invalid == []
    else:
        assert calls == [] and [(c["name"], c["args"]) for c in invalid] == [(None, raw)]


def test_calls_before_an_open_one_parse_each_and_an_invalid_ones_name_is_kept():
    text, calls, invalid = parse_tool_calls('a<tool_call>{"name": "add", "arguments": {}}</tool_call>b'
                                            '<tool_call>{"name": "mul", "arguments": [1]}')
    assert text == "ab" and [c["name"] for c in calls] == ["add"]
    assert [c["name"] for c in invalid] == ["mul"]  # which tool the model meant, for the agent to say
    assert parse_tool_calls("no call </tool_call> here") == ("no call </tool_call> here", [], [])


@pytest.mark.parametrize("reasoning", [
    {"type": "thinking", "thinking": "48+24=72", "signature": "sig"},  # Anthropic extended thinking
    {"type": "redacted_thinking", "data": "xyz"},
    {"type": "reasoning", "reasoning": "48+24=72"},  # LangChain's standard block
])
def test_another_providers_reasoning_is_left_out_of_the_history(reasoning):
    history = [HumanMessage("What is 48 + 24?"), AIMessage([reasoning, {"type": "text", "text": "72."}]),
               HumanMessage("Check it.")]
    assert [m["content"] for m in to_engine_messages(history)] == ["What is 48 + 24?", "72.", "Check it."]
    with pytest.raises(ValueError, match="text-only"):  # only a reply's own reasoning is left out
        to_engine_messages([HumanMessage([reasoning])])


def test_metadata_under_kvcomm_that_is_not_ours_is_ignored():
    for meta in ({"kvcomm": "x"}, {"kvcomm": {"segment": None}}, {"kvcomm": None}):
        assert "segment" not in to_engine_messages([AIMessage("reply", response_metadata=meta)])[0]


def test_node_names_include_the_subgraph_path():
    assert node_agent({}) is None
    assert node_agent({"langgraph_node": "solver", "langgraph_checkpoint_ns": "solver:1"}) == "solver"
    assert node_agent({"langgraph_node": "critic", "langgraph_checkpoint_ns": "review:9|critic:3"}) == "review/critic"
