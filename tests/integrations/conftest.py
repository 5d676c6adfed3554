"""Fixtures for the LangGraph/LangChain adapter: tiny engines, and a scripted engine (the real
engine, with the reply text forced) for tool-call tests."""

from __future__ import annotations

import pytest

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.testing import TOOLS_TEMPLATE, tiny_qwen2, tiny_tokenizer

from ..conftest import mechanics


class ScriptedEngine:
    """Wraps a real engine; each call's reply is the next scripted text, processed by the model
    as that agent's reply (``engine.replay``), so prompts, reuse and stats stay real."""

    def __init__(self, engine: KVCommEngine, replies: list[str]):
        self.engine, self.replies = engine, list(replies)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, messages, *, agent, **options):
        text = self.replies.pop(0)
        ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.engine.tokenizer.eos_token_id]
        kept = {k: v for k, v in options.items() if k in ("reuse", "tools")}
        result = self.engine.replay(messages, agent=agent, reply_ids=ids, **kept).result
        result = result.model_copy(update={"finish_reason": "stop"})  # scripted as a reply ended by eos
        if result.text:
            yield result.text
        yield result

    def chat(self, messages, *, agent, **options):
        return list(self.stream(messages, agent=agent, **options))[-1]


@pytest.fixture
def engine(llama, tokenizer):
    """Re-rotation only, so a second agent reuses on its first call (anchors: tests/anchors), with
    the mechanics tests' head (tests/conftest.py, MECHANICS): the replies here are short."""
    return KVCommEngine(llama, tokenizer, config=mechanics(method="rerotate"))


@pytest.fixture(scope="session")
def tools_tokenizer():
    return tiny_tokenizer(chat_template=TOOLS_TEMPLATE)


@pytest.fixture
def tools_engine(tools_tokenizer):
    return KVCommEngine(tiny_qwen2(tools_tokenizer, seed=3), tools_tokenizer, config=KVCommConfig(
        method="rerotate", recompute_short_runs=0, recompute_tail=0, recompute_last_run=0))
