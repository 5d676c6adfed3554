"""Shared fixtures: one tiny tokenizer and seeded tiny models, built in memory (no files)."""

from __future__ import annotations

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.testing import tiny_llama, tiny_qwen2, tiny_tokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def llama(tokenizer):
    return tiny_llama(tokenizer, seed=0)


@pytest.fixture(scope="session")
def qwen2(tokenizer):
    return tiny_qwen2(tokenizer, seed=1)


@pytest.fixture(params=["llama", "qwen2"])
def model(request, llama, qwen2):
    return {"llama": llama, "qwen2": qwen2}[request.param]


@pytest.fixture
def make_engine(tokenizer):
    """Engines for tests of the reuse mechanics: re-rotation only unless ``offsets`` is given
    (the default, KVCOMM anchors, first prefills what it has not seen; tests/cache/test_anchors.py)."""
    def make(model, **config):
        return KVCommEngine(model, tokenizer, config=KVCommConfig(**{"offsets": "none", **config}))

    return make


QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def solver_messages(system: str, *upstream: str) -> list[dict]:
    """A receiver's prompt: its own system text, the shared question, earlier replies pasted in."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    for i, reply in enumerate(upstream, 1):
        messages.append({"role": "user", "content": f"Agent {i} said: {reply}"})
    return messages
