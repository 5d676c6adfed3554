"""vLLM connector tests: vLLM's CPU build, the embedded model, one engine for the session.

Run with ``bash scripts/run.sh test-vllm`` (its own venv, ``.venv-vllm``); the default suite does
not collect this folder and runs without vLLM.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: vLLM's CPU default takes most of the memory
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ["KVCOMM_REMEMBER_MEASUREMENTS"] = "0"  # no engine starts from what an earlier test measured

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k-dev.jsonl"


def questions(n: int) -> list[str]:
    with open(DATA) as handle:
        return [json.loads(line)["question"] for _, line in zip(range(n), handle)]


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvcomm_agents.embedded import embedded_model_dir

    return str(embedded_model_dir())


@pytest.fixture(scope="session")
def llm(model_dir):
    from vllm import LLM

    from kvcomm_vllm import engine_kwargs

    # kl_budget=None: estimated offsets served unmeasured, the path with approximate KV to check
    # (the default holds them back on vLLM, as nothing audits them there: tests/test_broker.py)
    return LLM(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True, max_logprobs=-1, seed=0,
               **engine_kwargs({"kl_budget": None}))


@pytest.fixture(scope="session")
def broker(llm):
    from kvcomm_vllm.connector import runtimes

    (runtime,) = runtimes()
    return runtime.broker


class Client:
    """Requests on token ids, as the SDK's remote client sends them."""

    def __init__(self, llm):
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()

    def ids(self, messages) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])

    def generate(self, ids, agent: str, *, reuse: bool = True, max_tokens: int = 24, logprobs=None,
                 prefix_only: bool = False):
        from vllm import SamplingParams

        transfer = {"agent": agent, "reuse": reuse, **({"prefix_only": True} if prefix_only else {})}
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs,
                                extra_args={"kv_transfer_params": transfer})
        return self.llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]

    def first_token_logprobs(self, ids, agent: str, *, reuse: bool = True):
        """``([vocab] float32 log-probabilities of the first reply token, the request's report)``."""
        out = self.generate(ids, agent, reuse=reuse, max_tokens=1, logprobs=-1)
        row = torch.full((len(self.tokenizer),), float("-inf"))
        for token, entry in out.outputs[0].logprobs[0].items():
            row[token] = entry.logprob
        return row, (out.kv_transfer_params or {}).get("kvcomm", {})


@pytest.fixture(scope="session")
def client(llm) -> Client:
    return Client(llm)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) of two log-probability rows over the same vocabulary."""
    p_log, q_log = p_log.double(), q_log.double()
    finite = torch.isfinite(p_log)
    return float(torch.sum(p_log[finite].exp() * (p_log[finite] - q_log[finite])))



@contextmanager
def serving(*args: str):
    """The one-command server on a free port with ``args``; yields its URL once it answers."""
    from kvcomm_vllm.serve import local_server

    try:
        with local_server(*args) as url:
            yield url
    except RuntimeError as error:
        pytest.fail(str(error))
