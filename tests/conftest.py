"""Shared fixtures: one tiny tokenizer and seeded tiny models, built in memory (no files).

The models live on ``$KVCOMM_TEST_DEVICE`` (default cpu) in ``$KVCOMM_TEST_DTYPE`` (default
float32): ``benchmarks/gpu_check.sh`` runs the ``exact`` tests on CUDA in fp32 and bf16.
Tests marked ``exact`` are written to run on any device; their tolerances scale with the dtype.

Tiers: every test that uses a model fixture (or builds or loads a model itself, marked by hand)
is marked ``model``; ``pytest -m "not model"`` runs the fast, model-free tier alone.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["KVCOMM_REMEMBER_MEASUREMENTS"] = "0"  # no engine starts from what an earlier test measured

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.config import ExperimentalSettings
from kvcomm_agents.alignment import assemble
from kvcomm_agents.engines import hf
from kvcomm_agents.testing import tiny_llama, tiny_qwen2, tiny_tokenizer

torch.set_num_threads(2)

DEVICE = torch.device(os.environ.get("KVCOMM_TEST_DEVICE", "cpu"))
DTYPE = getattr(torch, os.environ.get("KVCOMM_TEST_DTYPE", "float32"))
#: tolerance multiplier of the exactness checks (a bf16 ulp is 2**-8 relative: dense and reused
#: paths round in different places)
TOLERANCE_SCALE = {torch.float32: 1.0, torch.bfloat16: 1000.0, torch.float16: 200.0}[DTYPE]

#: Fixtures that build, load or wrap a model: a test using any of them (directly or through
#: another fixture) is in the ``model`` tier.
MODEL_FIXTURES = frozenset({
    "llama", "qwen2", "model", "make_engine", "merging",  # tests/conftest.py
    "engine", "tools_engine",  # tests/integrations/conftest.py, tests/test_embedded.py
    "smoke",  # tests/test_benchmarks.py: a benchmark run on a tiny model
})


def pytest_collection_modifyitems(config, items):
    """Mark every test that needs a model ``model`` (the fast tier is ``-m "not model"``)."""
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if uses & MODEL_FIXTURES or item.get_closest_marker("embedded") is not None:
            item.add_marker(pytest.mark.model)


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


#: Tests of the reuse mechanics run on short texts (the tiny tokenizer: replies and shared
#: messages of 10-40 ids). They pin the run head at 4 ids, compute no run's tail and no short or
#: last run whole, so that such runs are re-rotated (the default computes runs of up to 64 ids
#: whole, one of up to 256 right before the reader's own text, and the last 8 ids of a longer one
#: there): what they check is the mechanics
#: of reuse (tests/test_computed_heads.py checks heads, tails and short runs). Copies (off in the default) are on and fed whatever they cost, so that
#: their mechanics run wherever reuse's do: whether they pay is timed on the machine running the
#: tests (tests/test_copy_cost.py sets the rates; tests that check the rule switch it on). Audits
#: run at the cadence a test sets, whatever reuse spared (tests/test_audit.py prices them).
MECHANICS = {"recompute_head": 4, "recompute_cut_head": 0, "recompute_tail": 0, "recompute_short_runs": 0, "recompute_last_run": 0,
             "reply_copies": True, "text_copies": True,
             "copies_when_cheaper": False, "audit_share": None}
#: the experimental settings those tests start from: replies re-rotated like any text (the tests'
#: replies are short; tests/test_rerotation_check.py tests the default)
MECHANICS_EXPERIMENTAL = {"rerotate_replies": True}


def mechanics(**config) -> KVCommConfig:
    """A :class:`KVCommConfig` for a test of the reuse mechanics (:data:`MECHANICS`, then ``config``;
    ``experimental`` merged into :data:`MECHANICS_EXPERIMENTAL`)."""
    given = config.pop("experimental", {})
    given = given.model_dump(exclude_unset=True) if isinstance(given, ExperimentalSettings) else given
    experimental = {**MECHANICS_EXPERIMENTAL, **given}
    return KVCommConfig(**{**MECHANICS, **config, "experimental": experimental})


@pytest.fixture
def make_engine(tokenizer):
    """Engines for tests of the reuse mechanics: re-rotation only unless ``method`` is given
    (the default, KVCOMM anchors, first prefills what it has not seen; tests/anchors)."""
    def make(model, *, plan_hook=None, **config):
        return KVCommEngine(model, tokenizer, config=mechanics(**{"method": "rerotate", **config}),
                            plan_hook=plan_hook)

    return make


QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
REPLY = "The answer is 72 because 48 plus 24 equals 72."


def solver_messages(system: str, *upstream: str) -> list[dict]:
    """A receiver's prompt: its own system text, the shared question, earlier replies pasted in."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    for i, reply in enumerate(upstream, 1):
        messages.append({"role": "user", "content": f"Agent {i} said: {reply}"})
    return messages


def forced(tokenizer, text: str = REPLY) -> list[int]:
    """Ids of a reply ``text`` ending with end-of-sequence, for ``engine.replay``."""
    return tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]


def replayed(engine, messages, agent: str, text: str = REPLY):
    """The engine's ``ChatResult`` for ``messages`` with ``text`` as the agent's reply."""
    return engine.replay(messages, agent=agent, reply_ids=forced(engine.tokenizer, text)).result


def first_logits(engine, messages, agent: str = "x") -> torch.Tensor:
    """``[vocab]`` logits of the prompt's last token under ``engine`` (row 0 of a replay does
    not depend on the replayed reply: one end-of-sequence id is replayed)."""
    return engine.replay(messages, agent=agent, reply_ids=[engine.tokenizer.eos_token_id]).first_token_logits


@torch.inference_mode()
def run_plan(model, rotator, plan, position_offset: int = 0) -> hf.Prefill:
    """Prefill ``plan`` as the engine does (assembly, position mask when runs are re-rotated),
    optionally with the whole prompt ``position_offset`` positions later."""
    block = assemble(plan, rotator, position_offset) if plan.reused_tokens else None
    return hf.prefill(model, plan.prompt_ids, plan.computed_positions(), block,
                      plan.reused_positions() if block is not None else None, masked=bool(plan.runs),
                      position_offset=position_offset)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def merging(request):
    """The embedded model's tokenizer (its pre-tokenizer merges a reply's trailing newline with
    the reader's ``\n\n`` into other ids; the model generates splits it would not make) and a
    seeded tiny model of each family for it (tests/test_framing.py, tests/test_lead_outs.py)."""
    from transformers import AutoTokenizer

    from kvcomm_agents.embedded import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    build = tiny_llama if request.param == "llama" else tiny_qwen2
    return build(tokenizer, seed=0).eval(), tokenizer
