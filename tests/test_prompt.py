"""Prompt layout: the chat template's exact ids, offsets and content spans."""

import pytest

from kvcomm_agents import InvalidMessagesError, InvalidRequestError
from kvcomm_agents.prompt import normalize_messages, render_prompt, token_span
from kvcomm_agents.testing import TOOLS_TEMPLATE, tiny_tokenizer

from .conftest import solver_messages


def test_ids_are_exactly_the_chat_templates(tokenizer):
    messages = solver_messages("You are solver two.", "the answer is 72")
    layout = render_prompt(tokenizer, messages)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert layout.ids.tolist() == list(expected)


def test_content_spans_point_at_each_message(tokenizer):
    messages = solver_messages("You are solver two.", "the answer is 72")
    layout = render_prompt(tokenizer, messages)
    for message, span in zip(messages, layout.content_spans):
        assert layout.text[span[0] : span[1]] == message["content"]


def test_segment_key_is_not_passed_to_the_template(tokenizer):
    messages = [{"role": "user", "content": "hello there", "segment": {"id": "x"}}]
    assert "segment" not in render_prompt(tokenizer, messages).text


def test_token_span_keeps_only_tokens_inside():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 10)]
    assert token_span(offsets, 3, 9) == range(1, 3)
    assert token_span(offsets, 4, 9) == range(2, 3)  # the token straddling the start is left out
    assert token_span(offsets, 4, 8) == range(2, 2)


def test_a_layouts_token_lookup_by_bisection_equals_the_scan(tokenizer):
    """``tokens_within`` bisects a real prompt's offsets and scans offsets that go backwards
    (a tokenizer giving (0, 0) to added tokens): either way what :func:`token_span` gives."""
    from kvcomm_agents.prompt import PromptLayout

    layout = render_prompt(tokenizer, solver_messages("You are solver two.", "the answer is 72, naïvely"))
    n = len(layout.text)
    for start in range(0, n + 2, 3):
        for end in range(start, n + 3, 7):
            assert layout.tokens_within(start, end) == token_span(layout.offsets, start, end), (start, end)
    backwards = PromptLayout("abcdefgh", layout.ids[:5], [(0, 2), (2, 4), (0, 0), (4, 6), (6, 8)], [(0, 8)])
    for start, end in [(0, 8), (2, 8), (1, 6), (4, 8), (0, 0)]:
        assert backwards.tokens_within(start, end) == token_span(backwards.offsets, start, end)
    assert backwards.id_list() == layout.ids[:5].tolist()


def test_tools_are_passed_to_the_chat_template():
    from kvcomm_agents.testing import tiny_tokenizer

    template = "{% if tools %}{{ 'TOOLS: ' + (tools | map(attribute='name') | join(',')) + '\n' }}{% endif %}" \
               "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    tokenizer = tiny_tokenizer(chat_template=template)
    layout = render_prompt(tokenizer, [{"role": "user", "content": "add 2 and 3"}], tools=[{"name": "add"}])
    assert layout.text.startswith("TOOLS: add\n")
    assert layout.text[slice(*layout.content_spans[0])] == "add 2 and 3"


@pytest.mark.parametrize("content, error", [
    (None, "message 1 content"), (42, "got int"), ([{"type": "image_url", "image_url": {"url": "x"}}], "'image_url'"),
    ([{"type": "input_audio"}], "'input_audio'"), ([3], "'int'"),
])
def test_bad_content_is_refused_naming_the_message(content, error):
    messages = [{"role": "system", "content": "You are a solver."}, {"role": "user", "content": content}]
    with pytest.raises(InvalidMessagesError, match=error):
        normalize_messages(messages)


def test_unknown_roles_are_refused():
    with pytest.raises(InvalidMessagesError, match="message 0 has role 'usr'"):
        normalize_messages([{"role": "usr", "content": "hi"}])


def test_text_parts_are_joined_and_render_like_the_string():
    tokenizer = tiny_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, "48 + 24?"]}]
    plain = [{"role": "user", "content": "What is 48 + 24?"}]
    assert render_prompt(tokenizer, parts).ids.tolist() == render_prompt(tokenizer, plain).ids.tolist()


def test_an_assistant_that_only_calls_tools_may_have_no_content():
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    clean = normalize_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert clean[0]["content"] == ""


def test_a_template_that_refuses_the_messages_is_an_invalid_messages_error():
    """Templates that ask for alternating roles (Llama-2-chat, Mistral-instruct) raise their own
    jinja error: callers catching the library's error see it, with what to do."""
    template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                "{{ m['content'] + '\n' }}{% endfor %}")
    tokenizer = tiny_tokenizer(chat_template=template)
    assert render_prompt(tokenizer, [{"role": "user", "content": "a"}]).text == "a\n"
    with pytest.raises(InvalidMessagesError, match="roles must alternate.*merge consecutive"):
        render_prompt(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_tools_for_a_template_that_does_not_render_them_are_refused(tokenizer):
    """Otherwise the template drops them and the model never sees the tools."""
    with pytest.raises(InvalidRequestError, match="does not render tools"):
        render_prompt(tokenizer, [{"role": "user", "content": "add 2 and 3"}], tools=[{"name": "add"}])


def test_a_broken_template_or_none_is_not_blamed_on_the_messages():
    from jinja2 import TemplateSyntaxError

    with pytest.raises(TemplateSyntaxError):
        render_prompt(tiny_tokenizer(chat_template="{% for m in messages %}"), [{"role": "user", "content": "a"}])
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        render_prompt(bare, [{"role": "user", "content": "a"}])


@pytest.mark.parametrize("arguments", [{"a": 48, "b": 24}, '{"a": 48, "b": 24}'])
def test_tool_calls_in_a_history_are_written_out_for_a_template_that_drops_them(tokenizer, arguments):
    """A template without tool support renders an assistant turn that only calls a tool as an
    empty turn, and the tool result after it answers nothing: the calls are written after the
    turn's text, in the ``<tool_call>`` form tool templates use."""
    history = [{"role": "user", "content": "add 48 and 24"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"type": "function", "id": "c1", "function": {"name": "add", "arguments": arguments}}]},
               {"role": "tool", "content": "72", "tool_call_id": "c1"}]
    written = '<tool_call>{"name": "add", "arguments": {"a": 48, "b": 24}}</tool_call>'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in render_prompt(tokenizer, history).text
    tools = tiny_tokenizer(chat_template=TOOLS_TEMPLATE)  # renders them itself: left to it
    assert render_prompt(tools, history).text == tools.apply_chat_template(history, tokenize=False, add_generation_prompt=True)


def test_tool_calls_written_out_keep_their_text_and_refuse_what_is_not_json(tokenizer):
    calls = [{"type": "function", "function": {"name": "größe", "arguments": {"stadt": "Zürich"}}}]
    history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "Ich schaue nach.", "tool_calls": calls}]
    written = '<tool_call>{"name": "größe", "arguments": {"stadt": "Zürich"}}</tool_call>'
    assert f"Ich schaue nach.\n{written}<|im_end|>" in render_prompt(tokenizer, history).text  # as a model writes it
    history[1]["tool_calls"] = [{"type": "function", "function": {"name": "f", "arguments": {"at": object()}}}]
    with pytest.raises(InvalidMessagesError, match="message 1 has a tool call whose arguments are not JSON"):
        render_prompt(tokenizer, history)
    history[1]["tool_calls"] = ["f(1)"]
    with pytest.raises(InvalidMessagesError, match="message 1 has a tool call that is not a mapping"):
        render_prompt(tokenizer, history)


@pytest.mark.parametrize("call, error", [
    ({"type": "function", "function": {"name": None, "arguments": {}}}, "without a function name"),
    ({"type": "function", "function": {"name": "add"}}, "'add' whose 'arguments' is not a mapping or JSON text"),
])
def test_a_tool_call_a_template_cannot_render_is_refused_naming_the_message(call, error):
    from kvcomm_agents.testing import TOOLS_TEMPLATE, tiny_tokenizer

    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(InvalidMessagesError, match=f"message 1 has a tool call (to )?{error}"):
        render_prompt(tiny_tokenizer(chat_template=TOOLS_TEMPLATE), history)


def test_text_no_tokenizer_takes_is_refused_naming_the_message(tokenizer):
    with pytest.raises(InvalidMessagesError, match="message 0 content is not valid Unicode"):
        render_prompt(tokenizer, [{"role": "user", "content": "bad \ud800"}])


def test_a_template_failing_on_a_field_of_another_type_is_an_invalid_messages_error(tokenizer):
    from kvcomm_agents.testing import tiny_tokenizer

    concatenating = tiny_tokenizer(chat_template="{% for m in messages %}{{ m['role'] + m['name'] }}{% endfor %}")
    with pytest.raises(InvalidMessagesError, match="chat template failed on these messages"):
        render_prompt(concatenating, [{"role": "user", "content": "hi", "name": 3}])
