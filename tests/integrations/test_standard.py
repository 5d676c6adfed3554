"""LangChain's standard chat-model suites (``langchain-tests``).

Unit suite: on a tiny Qwen2-style model with a tools chat template (tool binding is exercised).
Integration suite: on the embedded SmolLM2-135M-Instruct with replies of at most 32 tokens. Its
chat template has no tool support, so the tool-calling and structured-output tests are skipped by
declaring those capabilities absent (``bind_tools`` raises a clear error there, tested in
``test_chat_model.py``); every other skip is the suite's own (images, audio, PDFs: the model is
text only).
"""

from __future__ import annotations

from functools import lru_cache

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvcomm_agents import KVCommEngine
from kvcomm_agents.testing import TOOLS_TEMPLATE, tiny_qwen2, tiny_tokenizer
from kvcomm_langgraph import ChatKVComm

pytestmark = pytest.mark.model  # every suite here builds an engine on a model


@lru_cache(maxsize=1)
def _tiny_tools_engine() -> KVCommEngine:
    tokenizer = tiny_tokenizer(chat_template=TOOLS_TEMPLATE)
    return KVCommEngine(tiny_qwen2(tokenizer, seed=3), tokenizer)


class TestChatKVCommUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVComm]:
        return ChatKVComm

    @property
    def chat_model_params(self) -> dict:
        return {"engine": _tiny_tools_engine()}

    @property
    def supports_model_override(self) -> bool:
        return False  # an engine serves one model; there is no model name to switch per call


@pytest.mark.embedded
class TestChatKVCommIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVComm]:
        return ChatKVComm

    @property
    def chat_model_params(self) -> dict:
        return {"max_tokens": 32}  # engine=None: the process-wide embedded SmolLM2-135M-Instruct

    @property
    def has_tool_calling(self) -> bool:
        return False  # SmolLM2's chat template does not render tools

    @property
    def has_structured_output(self) -> bool:
        return False  # it goes through tool calling, see above

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    @property
    def supports_model_override(self) -> bool:
        return False

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """Two agents read the same long text; the second reads it from the cache."""
        text = ("The quarterly report lists revenue by region: north 120, south 95, east 143, west 88, "
                "with costs rising four percent and headcount flat across all offices this quarter.")
        ChatKVComm(agent="reader-1", max_tokens=2).invoke([SystemMessage("Summarise."), HumanMessage(text)])
        second = ChatKVComm(agent="reader-2", max_tokens=2)
        messages = [SystemMessage("Find the largest region."), HumanMessage(text)]
        if not stream:
            return second.invoke(messages)
        chunks = list(second.stream(messages))
        message = chunks[0]
        for chunk in chunks[1:]:
            message = message + chunk
        return message
