"""Timings read a forward's end, not its launch: every timed forward waits on its device
(``kvcomm_agents.engines.placement.wait_for``), on any accelerator torch names, and nothing is
waited for on the CPU."""

import pytest
import torch

from kvcomm_agents import KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf, placement

from ..conftest import QUESTION


def test_an_accelerator_is_waited_for_and_the_cpu_is_not(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: waited.append(device))
    for device in ("cpu", "meta", torch.device("cpu")):
        placement.wait_for(device)
    assert waited == []
    for device in ("xpu:0", torch.device("mps"), "cuda:1"):
        placement.wait_for(device)
    assert waited == [torch.device("xpu:0"), torch.device("mps"), torch.device("cuda:1")]


@pytest.mark.model
def test_each_timed_forward_waits_on_the_models_device(monkeypatch, llama, tokenizer):
    """The prefill and each decode step wait on the device before their time is read."""
    waited = []
    monkeypatch.setattr(hf, "wait_for", lambda device: waited.append(torch.device(device)))
    engine = KVCommEngine(llama, tokenizer, config=KVCommConfig(draft_tokens=0))
    reply = engine.chat([{"role": "user", "content": QUESTION}], agent="solver", max_new_tokens=6)
    assert reply.stats.generated_tokens == 6
    assert set(waited) == {llama.device}
    assert len(waited) >= 1 + 5  # the prefill, then a step for each id after the first
