"""ChatKVComm on tiny real models: calls, usage, reuse between agents, agent resolution, tools."""

import asyncio

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.prompt import render_prompt
from kvcomm_langgraph import ChatKVComm, kvcomm_agent

from .conftest import ScriptedEngine
from ..conftest import mechanics

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def prompt(system: str, *history) -> list:
    return [SystemMessage(system), HumanMessage(QUESTION), *history]


def test_invoke_reports_usage_segment_and_stats(engine):
    model = ChatKVComm(engine=engine, agent="solver-1", max_tokens=16)
    reply = model.invoke(prompt("You are solver one."))
    assert isinstance(reply, AIMessage) and reply.content
    meta = reply.response_metadata["kvcomm"]
    usage = reply.usage_metadata
    assert usage["input_tokens"] == meta["stats"]["prompt_tokens"]
    assert usage["output_tokens"] == meta["stats"]["generated_tokens"] <= 16
    assert usage["input_token_details"]["cache_read"] == meta["stats"]["reused_tokens"]
    assert meta["agent"] == "solver-1" and tuple(meta["segment"]["kind"]) == ("solver-1", "assistant")


REPLY = "The answer is 72 because 48 plus 24 equals 72."


def test_second_agent_reads_the_first_reply_from_the_cache(engine):
    # a random tiny model writes byte soup that no tokenizer would produce; script a real reply
    first = ChatKVComm(engine=ScriptedEngine(engine, [REPLY]), agent="solver-1").invoke(prompt("You are solver one."))
    second = ChatKVComm(engine=engine, agent="solver-2", max_tokens=4).invoke(prompt("You are solver two.", first))
    stats = second.response_metadata["kvcomm"]["stats"]
    assert second.usage_metadata["input_token_details"]["cache_read"] == stats["reused_tokens"] > 0
    reasons = {tuple(d["segment"]["kind"]): d["reason"] for d in stats["decisions"]}
    assert reasons[("solver-1", "assistant")] == "reference"  # the ref travelled in response_metadata


def test_stream_matches_invoke_and_ends_with_usage(engine, llama, tokenizer):
    model = ChatKVComm(engine=engine, agent="a", max_tokens=10)
    chunks = list(model.stream(prompt("You are solver one.")))
    assert len(chunks) > 2 and chunks[-1].usage_metadata is not None
    streamed = "".join(c.content for c in chunks)
    fresh = ChatKVComm(engine=KVCommEngine(llama, tokenizer, config=mechanics()), agent="a", max_tokens=10)
    assert streamed == fresh.invoke(prompt("You are solver one.")).content


def test_async_and_batch_calls(engine):
    model = ChatKVComm(engine=engine, agent="a", max_tokens=3)
    replies = model.batch([prompt("You are solver one."), prompt("You are solver two.")])
    assert len(replies) == 2 and all(isinstance(r, AIMessage) for r in replies)

    async def run():
        one = await model.ainvoke(prompt("You are solver three."))
        chunks = [c async for c in model.astream(prompt("You are solver four."))]
        return one, chunks

    one, chunks = asyncio.run(run())
    assert one.usage_metadata["output_tokens"] <= 3 and chunks[-1].usage_metadata is not None


def test_reuse_off_gives_the_dense_output(engine, llama, tokenizer):
    first = ChatKVComm(engine=ScriptedEngine(engine, [REPLY]), agent="s1").invoke(prompt("You are solver one."))
    history = prompt("You are solver two.", first)
    dense = ChatKVComm(engine=KVCommEngine(llama, tokenizer, config=KVCommConfig(method="dense")), max_tokens=12)
    off = ChatKVComm(engine=engine, agent="s2", max_tokens=12, reuse=False).invoke(history)
    assert off.content == dense.invoke(history).content
    assert off.usage_metadata["input_token_details"]["cache_read"] == 0


def test_decorator_names_the_agent_and_opts_out(engine):
    model = ChatKVComm(engine=engine, agent="constructor", max_tokens=2)

    @kvcomm_agent("judge", reuse=False)
    def judge(messages):
        return model.invoke(messages)

    @kvcomm_agent
    async def critic(messages):
        return await model.ainvoke(messages)

    reply = judge(prompt("You are the judge."))
    meta = reply.response_metadata["kvcomm"]
    assert meta["agent"] == "judge" and meta["stats"]["opted_out"]
    assert asyncio.run(critic(prompt("You are the critic."))).response_metadata["kvcomm"]["agent"] == "critic"
    assert model.invoke(prompt("x")).response_metadata["kvcomm"]["agent"] == "constructor"
    assert ChatKVComm(engine=engine, max_tokens=1).invoke(prompt("y")).response_metadata["kvcomm"]["agent"] == "default"


def test_an_empty_agent_name_is_refused_not_read_as_the_default(engine):
    with pytest.raises(ValueError, match="agent"):
        ChatKVComm(engine=engine, agent="")


def test_a_model_named_by_id_or_another_providers_option_is_refused(engine):
    """Taken silently, ``model=`` would serve the embedded model in place of the one named."""
    with pytest.raises(ValueError, match="engine=KVCommEngine.from_pretrained"):
        ChatKVComm(model="Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(ValueError, match="no option 'max_new_tokens', 'top_k'; 'max_new_tokens' is 'max_tokens'"):
        ChatKVComm(engine=engine, top_k=5, max_new_tokens=4)
    with pytest.raises(ValueError, match="engine must be a KVCommEngine"):
        ChatKVComm(engine="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert ChatKVComm(engine=engine, timeout=60, max_retries=2, api_key="x").engine is engine  # LangChain's own
    with pytest.raises(ValueError, match=r"engine=kvcomm_vllm.client.VLLMEngine\(base_url\)"):
        ChatKVComm(base_url="http://127.0.0.1:8000")  # taken silently, it would serve the embedded model


@pytest.mark.parametrize("options, error", [
    ({"max_new_tokens": 3}, "'max_new_tokens' is 'max_tokens' here"), ({"n": 2}, "one reply per call"),
    ({"frequency_penalty": 1.0}, "no call option 'frequency_penalty'"),
])
def test_a_call_option_it_would_ignore_is_refused(engine, options, error):
    with pytest.raises(ValueError, match=error):
        ChatKVComm(engine=engine, max_tokens=2).invoke(prompt("You are solver one."), **options)


def test_streaming_true_makes_invoke_stream_to_callbacks(engine):
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self):
            self.seen = []

        def on_llm_new_token(self, token, **kwargs):
            self.seen.append(token)

    for streaming in (False, True):
        tokens = Tokens()
        reply = ChatKVComm(engine=engine, max_tokens=6, streaming=streaming).invoke(
            prompt("You are solver one."), config={"callbacks": [tokens]})
        assert bool(tokens.seen) == streaming and (not streaming or "".join(tokens.seen) == reply.content)


def test_tool_options_are_recorded_and_others_refused_when_bound(tools_engine):
    model = ChatKVComm(engine=tools_engine, max_tokens=2)
    bound = model.bind_tools([add], parallel_tool_calls=False, strict=True)
    assert isinstance(bound.invoke("add 2 and 3"), AIMessage)
    with pytest.raises(ValueError, match="no call option 'top_k'"):
        model.bind_tools([add], top_k=5)  # at bind time, not at the first call
    assert model.invoke("hi", stream=False).content == model.invoke("hi").content  # LangChain's own switch


def test_bind_tools_without_template_support_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="does not render tools"):
        ChatKVComm(engine=engine).bind_tools([add])


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_tool_calls_round_trip_on_a_tools_template(tools_engine):
    scripted = ScriptedEngine(tools_engine, [
        'I will add them.<tool_call>{"name": "add", "arguments": {"a": 48, "b": 24}}</tool_call>',
        "The total is 72 clips.",
        "Agreed: 72 clips.",
    ])
    model = ChatKVComm(engine=scripted, agent="solver")
    bound = model.bind_tools([add])
    messages = [HumanMessage(QUESTION)]
    call = bound.invoke(messages)
    assert call.content == "I will add them."
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("add", {"a": 48, "b": 24})]
    assert call.response_metadata["finish_reason"] == "tool_calls"  # as OpenAI's models say it
    result = ToolMessage(str(add(**call.tool_calls[0]["args"])) + " clips in total, computed by the add tool", tool_call_id=call.tool_calls[0]["id"], name="add")
    final = bound.invoke(messages + [call, result])
    assert final.content == "The total is 72 clips." and final.tool_calls == []
    assert final.response_metadata["finish_reason"] == "stop"
    # another agent reads the tool result: it was captured as a segment and is reused
    reader = ChatKVComm(engine=scripted, agent="checker").invoke([SystemMessage("Check the tool output."), HumanMessage(result.content)])
    kinds = {tuple(d["segment"]["kind"]): d["status"] for d in reader.response_metadata["kvcomm"]["stats"]["decisions"]}
    assert kinds[("add", "tool")] == "reused"


class Answer(BaseModel):
    """The final answer."""

    number: int
    unit: str


def test_structured_output_through_tool_calls(tools_engine):
    scripted = ScriptedEngine(tools_engine, ['<tool_call>{"name": "Answer", "arguments": {"number": 72, "unit": "clips"}}</tool_call>'])
    structured = ChatKVComm(engine=scripted).with_structured_output(Answer)
    assert structured.invoke([HumanMessage(QUESTION)]) == Answer(number=72, unit="clips")


def test_a_reply_edited_after_its_segment_was_made_is_never_reused_stale(engine, llama, tokenizer):
    first = ChatKVComm(engine=ScriptedEngine(engine, [REPLY]), agent="s1").invoke(prompt("You are solver one."))
    edited = first.model_copy(update={"content": first.content.replace("answer", "result")})  # ref kept in metadata
    history = prompt("You are solver two.", edited)
    reply = ChatKVComm(engine=engine, agent="s2", max_tokens=6).invoke(history)
    decision = [d for d in reply.response_metadata["kvcomm"]["stats"]["decisions"] if tuple(d["segment"]["kind"]) == ("s1", "assistant")]
    assert [(d["status"], d["reason"], d["found_by"]) for d in decision[:1]] == [("prefilled", "stale", "reference")]
    # the unchanged text after the edit may come back as token runs, never the edited word
    layout = render_prompt(tokenizer, [m if isinstance(m, dict) else {"role": m.type.replace("human", "user").replace("ai", "assistant"), "content": m.content} for m in history])
    edited_word = layout.tokens_within(layout.text.index("result"), layout.text.index("result") + len("result"))
    assert len(decision) > 1  # the tail after the edit is found by token ids
    for d in decision[1:]:
        assert d["found_by"] == "tokens" and d["span"][0] >= edited_word.stop


def test_copies_share_the_engine_and_pickling_is_clear(engine, monkeypatch):
    import copy
    import pickle

    import kvcomm_langgraph.chat_model as chat_model

    model = ChatKVComm(engine=engine, agent="solver-1", max_tokens=8)
    clone = copy.deepcopy(model)
    assert clone.engine is engine and clone.max_tokens == 8  # frameworks deep-copy models freely
    assert clone.invoke(prompt("You are solver one.")).content
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(model)
    monkeypatch.setattr(chat_model, "_DEFAULT", engine)  # the process-wide engine pickles by reference
    back = pickle.loads(pickle.dumps(ChatKVComm(engine=engine, max_tokens=5)))
    assert back.engine is None and back.max_tokens == 5 and back._engine() is engine


def test_a_malformed_tool_call_is_reported_when_streamed_as_when_invoked(tools_engine):
    bad = 'Let me call. <tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>'
    invoked = ChatKVComm(engine=ScriptedEngine(tools_engine, [bad])).bind_tools([add]).invoke("2+3?")
    chunks = list(ChatKVComm(engine=ScriptedEngine(tools_engine, [bad])).bind_tools([add]).stream("2+3?"))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    switched = ChatKVComm(engine=ScriptedEngine(tools_engine, [bad]), streaming=True).bind_tools([add]).invoke("2+3?")
    for reply in (invoked, streamed, switched):
        assert reply.content == "Let me call." and reply.tool_calls == []
        assert len(reply.invalid_tool_calls) == 1 and '"a": 2,}' in reply.invalid_tool_calls[0]["args"]


def test_a_call_whose_closing_tag_a_stop_cut_off_is_a_call_streamed_or_not(tools_engine):
    """``stop=["</tool_call>"]`` (or a model leaving the tag off) ends the reply inside the call's
    block: the call is parsed, not handed to the user as text with the tag."""
    cut = 'I will add them.<tool_call>{"name": "add", "arguments": {"a": 48, "b": 24}}'
    invoked = ChatKVComm(engine=ScriptedEngine(tools_engine, [cut])).bind_tools([add]).invoke(QUESTION, stop=["</tool_call>"])
    chunks = list(ChatKVComm(engine=ScriptedEngine(tools_engine, [cut])).bind_tools([add]).stream(QUESTION))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    for reply in (invoked, streamed):
        assert reply.content == "I will add them." and reply.invalid_tool_calls == []
        assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("add", {"a": 48, "b": 24})]
        assert reply.response_metadata["finish_reason"] == "tool_calls"


def test_two_models_and_two_agents_never_share_langchains_cache(engine, tokenizer):
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import get_llm_cache, set_llm_cache

    from kvcomm_agents.testing import tiny_qwen2

    other = KVCommEngine(tiny_qwen2(tokenizer, seed=1), tokenizer, config=mechanics())
    messages = prompt("You are solver one.")
    uncached = [ChatKVComm(engine=e, max_tokens=6).invoke(messages).content for e in (engine, other)]
    assert uncached[0] != uncached[1]
    before = get_llm_cache()
    set_llm_cache(InMemoryCache())
    try:
        cached = [ChatKVComm(engine=e, max_tokens=6).invoke(messages) for e in (engine, other)]
        assert [r.content for r in cached] == uncached
        judge_model = ChatKVComm(engine=engine, max_tokens=6)

        @kvcomm_agent("judge", reuse=False)
        def judge(messages):
            return judge_model.invoke(messages)

        verdict = judge(messages)  # same model and messages as the cached reply, another agent
        assert verdict.response_metadata["kvcomm"]["agent"] == "judge"
        again = ChatKVComm(engine=engine, max_tokens=6).invoke(messages)
        assert again.response_metadata == cached[0].response_metadata  # a hit, for the same agent
        # the options a call decodes with, resolved as the call resolves them, key the entry
        short = ChatKVComm(engine=engine, max_tokens=1).invoke(messages, max_tokens=None)
        assert short.usage_metadata["output_tokens"] == 1
        stopped = ChatKVComm(engine=engine, max_tokens=6, stop=uncached[0][:2]).invoke(messages)
        assert stopped.content == ""
    finally:
        set_llm_cache(before)


def test_none_call_options_mean_the_models_own_and_an_empty_stop_clears_its_stop(engine):
    model = ChatKVComm(engine=engine, max_tokens=6, stop=["\x00never"])
    assert model._get_llm_string(max_tokens=None, seed=None) == model._get_llm_string()  # one LLM-cache entry
    plain = model.invoke(prompt("You are solver one.")).content
    assert model.invoke(prompt("You are solver one."), max_tokens=None, temperature=None, seed=None).content == plain
    first = plain[:2]
    stopped = ChatKVComm(engine=engine, max_tokens=6, stop=first).invoke(prompt("You are solver one."))
    assert stopped.content == "" and stopped.response_metadata["finish_reason"] == "stop"  # as providers name it
    assert stopped.response_metadata["kvcomm"]["finish_reason"] == "stop_string"
    cleared = ChatKVComm(engine=engine, max_tokens=6, stop=[first]).invoke(prompt("You are solver one."), stop=[])
    assert cleared.content == plain


def test_a_text_block_without_a_string_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="'text' must be a string, got NoneType"):
        ChatKVComm(engine=engine, max_tokens=2).invoke([HumanMessage([{"type": "text", "text": None}])])


def test_a_cached_reply_of_weights_changed_since_is_not_served(engine, llama, tokenizer):
    import copy

    import torch
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import get_llm_cache, set_llm_cache

    model = copy.deepcopy(llama)
    tuned = KVCommEngine(model, tokenizer, config=mechanics())
    messages = prompt("You are solver one.")
    before = get_llm_cache()
    set_llm_cache(InMemoryCache())
    try:
        first = ChatKVComm(engine=tuned, max_tokens=6).invoke(messages)
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.mul_(3.0)
        changed = ChatKVComm(engine=tuned, max_tokens=6).invoke(messages)
        assert changed.response_metadata != first.response_metadata  # generated again, not the cached reply
    finally:
        set_llm_cache(before)
