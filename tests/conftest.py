"""Shared fixtures: one tiny tokenizer and seeded tiny models, built in memory (no files).

The models live on ``$KVCOMM_TEST_DEVICE`` (default cpu) in ``$KVCOMM_TEST_DTYPE`` (default
float32): ``benchmarks/gpu_check.sh`` runs the ``exact`` tests on CUDA in fp32 and bf16.
Tests marked ``exact`` are written to run on any device; their tolerances scale with the dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.testing import tiny_llama, tiny_qwen2, tiny_tokenizer

torch.set_num_threads(2)

DEVICE = torch.device(os.environ.get("KVCOMM_TEST_DEVICE", "cpu"))
DTYPE = getattr(torch, os.environ.get("KVCOMM_TEST_DTYPE", "float32"))
#: tolerance multiplier of the exactness checks (a bf16 ulp is 2**-8 relative: dense and reused
#: paths round in different places)
TOLERANCE_SCALE = {torch.float32: 1.0, torch.bfloat16: 1000.0, torch.float16: 200.0}[DTYPE]


def tol(fp32_atol: float) -> float:
    """An absolute tolerance given for float32, scaled for the dtype under test."""
    return fp32_atol * TOLERANCE_SCALE


def rtol() -> float:
    """Relative tolerance of element-wise KV checks: 0 in float32, two ulps in half precision."""
    return 0.0 if DTYPE == torch.float32 else 2 * torch.finfo(DTYPE).eps


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def llama(tokenizer):
    return tiny_llama(tokenizer, seed=0).to(device=DEVICE, dtype=DTYPE)


@pytest.fixture(scope="session")
def qwen2(tokenizer):
    return tiny_qwen2(tokenizer, seed=1).to(device=DEVICE, dtype=DTYPE)


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
