"""ChatKVComm's token counts and profile: the served model's own tokenizer, chat template and
context, never LangChain's GPT-2 from the model hub; ``trim_messages`` on templates that refuse
histories out of turn."""

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from kvcomm_agents import InvalidMessagesError, KVCommEngine
from kvcomm_agents.prompt import render_prompt
from kvcomm_langgraph import ChatKVComm, to_engine_messages

from .conftest import ScriptedEngine
from .test_chat_model import QUESTION, add, prompt
from ..conftest import mechanics


#: A template that refuses roles out of turn, as Llama-2 and Mistral style templates do.
ALTERNATING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def history(turns: int) -> list:
    return [m for i in range(turns) for m in (HumanMessage(f"Question {i}: how many clips in month {i}?"),
                                              AIMessage(f"In month {i} she sold {12 * i} clips."))]


def test_token_counts_are_the_models_own_and_never_reach_the_hub(engine, tokenizer, monkeypatch):
    import langchain_core.language_models.base as base

    def hub(*_):
        raise AssertionError("counted with LangChain's GPT-2 tokenizer, fetched from the model hub")

    monkeypatch.setattr(base, "_get_token_ids_default_method", hub)
    model = ChatKVComm(engine=engine, agent="a", max_tokens=2)
    assert model.get_token_ids(QUESTION) == tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    assert model.get_num_tokens(QUESTION) == len(model.get_token_ids(QUESTION))
    assert ChatKVComm(engine=engine, custom_get_token_ids=lambda text: [0] * 3).get_num_tokens(QUESTION) == 3
    messages = prompt("You are solver one.", *history(2))
    assert model.get_num_tokens_from_messages(messages) == model.invoke(messages).usage_metadata["input_tokens"]


def test_token_counts_with_tools_are_the_calls_prompt(tools_engine):
    scripted = ScriptedEngine(tools_engine, ["The total is 72 clips."])
    model = ChatKVComm(engine=scripted)
    messages = [SystemMessage("You add numbers."), HumanMessage(QUESTION)]
    counted = model.get_num_tokens_from_messages(messages, tools=[add])
    assert counted > model.get_num_tokens_from_messages(messages)  # the tools' schema is rendered
    assert counted == model.bind_tools([add]).invoke(messages).usage_metadata["input_tokens"]


@pytest.mark.parametrize("template", ["chatml", "alternating"])
def test_trim_messages_keeps_the_newest_turns_that_fit(llama, template):
    from langchain_core.messages import trim_messages
    from kvcomm_agents.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer() if template == "chatml" else tiny_tokenizer(chat_template=ALTERNATING_TEMPLATE)
    model = ChatKVComm(engine=KVCommEngine(llama, tokenizer, config=mechanics()), agent="a", max_tokens=1)
    turns = history(12)
    budget = model.get_num_tokens_from_messages(turns) // 3
    kept = trim_messages(turns, max_tokens=budget, token_counter=model, strategy="last", start_on="human")
    assert kept == turns[-len(kept):] and len(kept) >= 2 and kept[0].type == "human"
    assert model.invoke(kept).usage_metadata["input_tokens"] <= budget  # the prompt a call takes fits
    two_more = turns[-len(kept) - 2:]
    assert model.get_num_tokens_from_messages(two_more) > budget  # and the turn before it would not


def test_the_profile_says_what_the_engines_model_takes(engine, llama, tools_engine):
    profile = ChatKVComm(engine=engine).profile
    assert profile["max_input_tokens"] == llama.config.max_position_embeddings
    assert profile["text_inputs"] and not profile["image_inputs"] and not profile["tool_calling"]
    assert ChatKVComm(engine=tools_engine).profile["tool_calling"]  # its template renders tools


def test_the_default_models_profile_is_the_embedded_files_own_and_loads_nothing(monkeypatch):
    import kvcomm_langgraph.chat_model as chat_model
    from transformers import AutoConfig, AutoTokenizer
    from kvcomm_agents.paged import embedded_model_dir, renders_tools

    monkeypatch.setattr(chat_model, "_DEFAULT", None)
    monkeypatch.setattr(KVCommEngine, "from_pretrained", lambda *a, **k: pytest.fail("the profile loaded the model"))
    profile = ChatKVComm().profile
    folder = embedded_model_dir()
    assert profile["max_input_tokens"] == AutoConfig.from_pretrained(folder).max_position_embeddings
    assert profile["tool_calling"] == renders_tools(AutoTokenizer.from_pretrained(folder))


def test_a_remote_engines_counts_use_its_tokenizer_and_its_profile_leaves_the_context_out(tokenizer):
    class Remote:  # what ChatKVComm reads of kvcomm_vllm's VLLMEngine: its tokenizer, chat and stream
        model_name = "served"

        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def chat(self, messages, *, agent, **options):
            raise AssertionError("counting runs no call")

        stream = chat

    model = ChatKVComm(engine=Remote(tokenizer))
    messages = prompt("You are solver one.")
    assert model.get_num_tokens_from_messages(messages) == len(render_prompt(tokenizer, to_engine_messages(messages)).ids)
    assert "max_input_tokens" not in model.profile and model.profile["text_inputs"]


def test_a_message_a_call_would_refuse_is_refused_when_counted(engine):
    model = ChatKVComm(engine=engine)
    with pytest.raises(InvalidMessagesError, match="message 0 content is not valid Unicode"):
        model.get_num_tokens_from_messages([HumanMessage("bad \ud800")])
