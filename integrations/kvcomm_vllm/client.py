"""A vLLM server running the KVCOMM connector, behind the engine interface the SDK's adapters use.

``ChatKVComm(engine=VLLMEngine("http://127.0.0.1:8000"))`` serves a LangGraph graph from the
server with agent names taken from the graph exactly as with the local engine. Prompts are
rendered and tokenized here with the model's own chat template and sent as token ids (the
completions API), never as text the server would re-tokenize, so segment boundaries stay exact;
the agent travels in ``kv_transfer_params``. The server's report (tokens reused, each shared
segment's decision and reason) becomes the result's :class:`~kvcomm_agents.CallStats`, so
``usage_metadata["input_token_details"]["cache_read"]`` is the server's count.

Standard library HTTP only; this module never imports vLLM (a client machine needs none).
Named limits: ``stream`` yields the reply in one piece (vLLM's streaming answers carry no
``kv_transfer_params``); ``ttft_s`` is the request's wall time seen by the client (the answer has
no first-token time); replies carry no segment reference (the server finds shared text by token
runs).
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any, Iterator, Optional, Sequence

from kvcomm_agents.plan import SegmentDecision
from kvcomm_agents.prompt import render_prompt
from kvcomm_agents.results import CallStats, ChatResult

__all__ = ["VLLMEngine"]

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class VLLMEngine:
    """The ``chat`` / ``stream`` interface of :class:`~kvcomm_agents.KVCommEngine`, served remotely.

    Args:
        base_url: the server (``python -m kvcomm_vllm.serve``), e.g. ``http://127.0.0.1:8000``.
        tokenizer: a tokenizer or a folder to load one from (default: the served model's folder
            when it is local, else the embedded model's).
        model: the served model id (default: the server's first).
        timeout: seconds per request.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, tokenizer: Any = None,
                 model: Optional[str] = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.model_id = model or self._get("/v1/models")["data"][0]["id"]
        self.tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else \
            _load_tokenizer(tokenizer or self.model_id)

    @property
    def model_name(self) -> str:
        return f"kvcomm-vllm:{self.model_id}"

    def chat(self, messages: Sequence[dict], *, agent: str, max_new_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, stop: Optional[list[str]] = None, seed: Optional[int] = None,
             reuse: Optional[bool] = None, tools: Optional[list] = None) -> ChatResult:
        """One agent call on the server; see :meth:`KVCommEngine.chat <kvcomm_agents.KVCommEngine.chat>`."""
        ids = render_prompt(self.tokenizer, messages, tools=tools).ids.tolist()
        return self.complete(ids, agent=agent, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             stop=stop, seed=seed, reuse=reuse)

    def complete(self, ids: list[int], *, agent: str, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Optional[list[str]] = None, seed: Optional[int] = None,
                 reuse: Optional[bool] = None) -> ChatResult:
        """One call on prompt token ids already rendered with the model's chat template."""
        body = {"model": self.model_id, "prompt": ids, "max_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "stop": stop or None, "seed": seed, "return_token_ids": True,
                "kv_transfer_params": {"agent": agent, "reuse": reuse is not False}}
        started = time.perf_counter()
        answer = self._post("/v1/completions", body)
        elapsed = time.perf_counter() - started
        choice = answer["choices"][0]
        report = (answer.get("kv_transfer_params") or {}).get("kvcomm", {})
        generated = list(choice.get("token_ids") or [])
        return ChatResult(text=choice["text"], token_ids=generated, segment=None,
                          finish_reason="stop_string" if choice.get("stop_reason") and isinstance(choice["stop_reason"], str)
                          else _FINISH.get(choice.get("finish_reason") or "stop", "stop"),
                          stats=_stats(agent, len(ids), len(generated), elapsed, report, reuse))

    def stream(self, messages: Sequence[dict], *, agent: str, **options) -> Iterator[Any]:
        """The reply text in one piece, then the :class:`~kvcomm_agents.ChatResult`."""
        result = self.chat(messages, agent=agent, **options)
        if result.text:
            yield result.text
        yield result

    # ---- HTTP -----------------------------------------------------------------------------
    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=self.timeout) as response:
            return json.loads(response.read())

    def _post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())


def _load_tokenizer(name: str):
    from pathlib import Path

    from transformers import AutoTokenizer

    if not Path(name).is_dir():
        from kvcomm_agents.embedded import embedded_model_dir

        name = str(embedded_model_dir())
    return AutoTokenizer.from_pretrained(name)


def _stats(agent: str, prompt: int, generated: int, elapsed: float, report: dict, reuse: Optional[bool]) -> CallStats:
    """The server's report as :class:`CallStats` (an empty report: a server without the
    connector; nothing was reused)."""
    reused = int(report.get("reused_tokens", 0))
    prefix = int(report.get("prefix_tokens", 0))
    decisions = [SegmentDecision(**{**d, "span": tuple(d["span"])}) for d in report.get("decisions", [])]
    mode = "dense" if reused == 0 else "prefix" if reused == prefix else "reuse"
    return CallStats(agent=agent, prompt_tokens=prompt, reused_tokens=reused, computed_tokens=prompt - reused,
                     prefix_tokens=prefix, generated_tokens=generated, ttft_s=elapsed, align_s=0.0, total_s=elapsed,
                     mode=mode, dense_reason=report.get("dense_reason") if report else "not_served_by_kvcomm",
                     decisions=decisions, opted_out=reuse is False,
                     own_text_tokens=int(report.get("own_text_tokens", 0)))
