"""A vLLM server running the KVCOMM connector, behind the engine interface the SDK's adapters use.

``ChatKVComm(engine=VLLMEngine("http://127.0.0.1:8000"))`` serves a LangGraph graph from the
server with agent names taken from the graph exactly as with the local engine. Prompts are
rendered and tokenized here with the model's own chat template and sent as token ids (the
completions API), never as text the server would re-tokenize, so segment boundaries stay exact;
the agent travels in ``kv_transfer_params``. The server's report (tokens reused, each shared
segment's decision and reason) becomes the result's :class:`~kvcomm_agents.CallStats`, so
``usage_metadata["input_token_details"]["cache_read"]`` is the server's count.

``ttft_s`` is the server's own time to first token (queue wait plus prefill, from vLLM's
per-request metrics, which ``kvcomm_vllm.serve`` switches on); against a server without them it is
the client's wall time (``chat``) or the arrival of the first streamed piece (``stream``).
``stream`` yields text as the server generates it; vLLM's streamed answers carry no
``kv_transfer_params``, so a streamed result's stats take the tokens read from cache from the
usage chunk (``prompt_tokens_details.cached_tokens``: the connector's claim) and have no per-segment
decisions; ``chat`` has them unless it sends copies (below: then it is streamed too), or with
``VLLMEngine(prefill_ahead=False, reply_ahead=False)``. Replies carry no segment reference (the
server finds shared text by token runs).

**Prefill ahead** (``prefill_ahead=True``, the default; :mod:`kvcomm_vllm.text_ahead`): a prompt
whose new shared text (a task, documents) later agents were seen to read after their own system
text is streamed, and once its first token arrived one one-token request per later reader (its
prefix, then the text) is sent, so the copies ride on its decode steps, never on its prefill; the
server keeps each as an exact prefix, so those readers' own requests are served from it. The
connector claims only what it can rebuild without holes, and shared text read after another
agent's system text is what it could not. Copies are not waited for; a failed copy costs that
reader's reuse, never the call. :class:`~kvcomm_vllm.fleet.FleetEngine` sends them too.

**Replies ahead** (``reply_ahead=True``, the default; :mod:`kvcomm_vllm.reply_ahead`): when
earlier graphs showed which agents read an agent's reply, and after which ids, that agent's call
is streamed, and every :data:`~kvcomm_vllm.reply_ahead.CHUNK` new reply ids one one-token
``prefix_only`` request per reader is sent: the reader's prompt as it will be, up to the reply so
far. The server computes them beside the sender's decode steps and keeps each as an exact prefix,
so the reader's own request claims up to the reply's last chunk. Such a call's stats come from
the streamed answer (tokens from cache and the server's TTFT, no per-segment decisions), as are
those of a call that sends prefill-ahead copies.

Standard library HTTP only; this module never imports vLLM (a client machine needs none).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from typing import Any, Iterator, Optional, Sequence

from kvcomm_vllm.text_ahead import PrefillAhead
from kvcomm_vllm.reply_ahead import CHUNK, ReplyAhead, copy_prompt
from kvcomm_agents.paged import check_reuse, default_reply_budget, render_prompt
from kvcomm_agents import CallStats, ChatResult, InvalidRequestError, SegmentDecision

__all__ = ["VLLMEngine", "prepare_prompt", "remember_reply"]

logger = logging.getLogger(__name__)

#: vLLM priority of a prefill-ahead copy (lower is served first; requests default to 0).
COPY_PRIORITY = 1

_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


class VLLMEngine:
    """The ``chat`` / ``stream`` interface of :class:`~kvcomm_agents.KVCommEngine`, served remotely.

    Args:
        base_url: the server (``python -m kvcomm_vllm.serve``), e.g. ``http://127.0.0.1:8000``.
        tokenizer: a tokenizer or a folder to load one from (default: the served model's folder
            when it is local, the embedded model's for a SmolLM2 id; any other id is refused, since
            its prompts would be rendered with another model's ids).
        model: the served model id (default: the server's first).
        timeout: seconds per request.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, tokenizer: Any = None,
                 model: Optional[str] = None, timeout: float = 600.0, prefill_ahead: bool = True,
                 reply_ahead: bool = True):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.ahead = PrefillAhead() if prefill_ahead else None
        self.replies = ReplyAhead() if reply_ahead else None
        self._served: Optional[dict] = None  # the served model's card (/v1/models), read once
        if model is None:
            self._served = self._get("/v1/models")["data"][0]
        self.model_id = model or self._served["id"]
        self.tokenizer = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else \
            _load_tokenizer(tokenizer or self.model_id)

    @property
    def model_name(self) -> str:
        return f"kvcomm-vllm:{self.model_id}"

    def chat(self, messages: Sequence[dict], *, agent: str, max_new_tokens: Optional[int] = None, temperature: float = 0.0,
             top_p: float = 1.0, stop: Optional[list[str]] = None, seed: Optional[int] = None,
             reuse: Optional[bool] = None, tools: Optional[list] = None) -> ChatResult:
        """One agent call on the server; see :meth:`KVCommEngine.chat <kvcomm_agents.KVCommEngine.chat>`."""
        ids, copies, bases = self._prepare(messages, agent, tools, reuse)
        options = dict(agent=agent, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=stop,
                       seed=seed, reuse=reuse)
        if not copies and not bases:
            result = self.complete(ids, **options)
        else:  # streamed, so that the copies go out after the first token and while the reply is generated
            *_, result = self.stream_with_copies(ids, copies, bases, options)
        self._finished(agent, ids, result)
        return result

    def _prepare(self, messages: Sequence[dict], agent: str, tools: Optional[list], reuse: Optional[bool]
                 ) -> tuple[list[int], list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
        return prepare_prompt(self.tokenizer, messages, agent, tools, reuse, self.ahead, self.replies)

    def _finished(self, agent: str, ids: list[int], result: ChatResult) -> None:
        remember_reply(self.tokenizer, self.replies, agent, ids, result)

    def stream_with_copies(self, ids: list[int], copies: list[tuple[str, list[int]]],
                           bases: list[tuple[str, list[int]]], options: dict,
                           sent: Optional[list[list[int]]] = None) -> Iterator[Any]:
        """:meth:`stream_ids`, sending the prefill-ahead ``copies`` once the first piece arrived (so
        that they never share this request's prefill; at the end when no piece came), and each
        reader's copy of the reply so far every :data:`~kvcomm_vllm.reply_ahead.CHUNK` ids.
        Copies are not waited for, and nothing about them fails the call. ``sent`` collects the
        prompts of the copies sent."""
        text, done, pieces, shared_out = "", 0, 0, False

        def send(reader: str, prompt: list[int], prefix_only: bool = False) -> None:
            try:
                threading.Thread(target=self._send_copy, args=(reader, prompt, prefix_only), daemon=True).start()
                if sent is not None:
                    sent.append(prompt)
            except Exception as error:  # noqa: BLE001 - a copy is an optimisation
                logger.warning("copy for %s not sent: %s", reader, error)

        try:
            for piece in self.stream_ids(ids, **options):
                if not shared_out:
                    shared_out = True
                    for reader, prompt in copies:
                        send(reader, prompt)
                if isinstance(piece, str) and bases:
                    text, pieces = text + piece, pieces + 1
                    if pieces >= CHUNK:  # a piece holds at least one id: re-tokenize only then
                        pieces = 0
                        try:
                            reply = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                        except Exception as error:  # noqa: BLE001
                            logger.warning("reply copies stopped: %s", error)
                            bases = []
                            reply = []
                        if len(reply) >= done + CHUNK:
                            done = len(reply)
                            for reader, base in bases:
                                send(reader, copy_prompt(base, reply), True)
                yield piece
        finally:
            if not shared_out:
                for reader, prompt in copies:
                    send(reader, prompt)

    def _send_copy(self, reader: str, ids: list[int], prefix_only: bool = False) -> None:
        """A later reader's prefix and the shared text (or the reply so far), prefilled (one
        token); a failure costs that reader's reuse, never a request."""
        try:
            body = _body(self.model_id, ids, reader, 1, 0.0, 1.0, None, None, True)
            if prefix_only:
                body["kv_transfer_params"]["prefix_only"] = True
            body["priority"] = COPY_PRIORITY  # after the requests waiting with it (serve's priority policy)
            self._post("/v1/completions", body)
        except Exception as error:  # noqa: BLE001 - a copy is an optimisation
            logger.warning("prefill-ahead copy for %s failed: %s", reader, error)

    def complete(self, ids: list[int], *, agent: str, max_new_tokens: Optional[int] = None, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Optional[list[str]] = None, seed: Optional[int] = None,
                 reuse: Optional[bool] = None) -> ChatResult:
        """One call on prompt token ids already rendered with the model's chat template."""
        budget = self._reply_budget(len(ids), max_new_tokens)
        body = _body(self.model_id, ids, agent, budget, temperature, top_p, stop, seed, reuse)
        started = time.perf_counter()
        answer = self._post("/v1/completions", body)
        elapsed = time.perf_counter() - started
        choice = answer["choices"][0]
        report = (answer.get("kv_transfer_params") or {}).get("kvcomm", {})
        generated = list(choice.get("token_ids") or [])
        ttft = _server_ttft(answer.get("metrics"))
        return ChatResult(text=choice["text"], token_ids=generated, segment=None,
                          finish_reason=_finish(choice),
                          stats=_stats(agent, len(ids), len(generated), elapsed if ttft is None else ttft, elapsed,
                                       report, reuse))

    def stream(self, messages: Sequence[dict], *, agent: str, tools: Optional[list] = None,
               **options) -> Iterator[Any]:
        """Text pieces as the server generates them, then the :class:`~kvcomm_agents.ChatResult`
        (its stats without per-segment decisions; see the module's docstring)."""
        ids, copies, bases = self._prepare(messages, agent, tools, options.get("reuse"))
        pieces = self.stream_with_copies(ids, copies, bases, {"agent": agent, **options}) if copies or bases else \
            self.stream_ids(ids, agent=agent, **options)
        for piece in pieces:
            if not isinstance(piece, str):
                self._finished(agent, ids, piece)
            yield piece

    def stream_ids(self, ids: list[int], *, agent: str, max_new_tokens: Optional[int] = None, temperature: float = 0.0,
                   top_p: float = 1.0, stop: Optional[list[str]] = None, seed: Optional[int] = None,
                   reuse: Optional[bool] = None) -> Iterator[Any]:
        """:meth:`stream` on prompt token ids already rendered with the model's chat template."""
        budget = self._reply_budget(len(ids), max_new_tokens)
        body = _body(self.model_id, ids, agent, budget, temperature, top_p, stop, seed, reuse)
        body.update(stream=True, stream_options={"include_usage": True})
        started = time.perf_counter()
        first: Optional[float] = None
        text, generated, usage, metrics, last = [], [], {}, None, {}
        for chunk in self._post_stream("/v1/completions", body):
            for choice in chunk.get("choices") or []:
                generated.extend(choice.get("token_ids") or [])
                if choice.get("finish_reason"):
                    last = choice
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - started
                    text.append(choice["text"])
                    yield choice["text"]
            usage = chunk.get("usage") or usage
            metrics = chunk.get("metrics") or metrics
        elapsed = time.perf_counter() - started
        ttft = _server_ttft(metrics)
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        report = {"reused_tokens": cached} if cached else {"dense_reason": "reuse_off" if reuse is False
                                                            else "nothing_to_reuse"}
        yield ChatResult(text="".join(text), token_ids=generated, segment=None, finish_reason=_finish(last),
                         stats=_stats(agent, len(ids), len(generated),
                                      ttft if ttft is not None else first if first is not None else elapsed,
                                      elapsed, report, reuse, streamed=True))

    # ---- HTTP -----------------------------------------------------------------------------
    def _reply_budget(self, num_prompt: int, max_new_tokens: Optional[int]) -> int:
        """``max_new_tokens``, or where the call names none what the local engine takes: 256, or
        fewer where the served model's context (``max_model_len`` in vLLM's model card) ends first."""
        if max_new_tokens is not None:
            return max_new_tokens
        if self._served is None:
            try:
                cards = self._get("/v1/models")["data"]
                self._served = next((card for card in cards if card.get("id") == self.model_id), {})
            except (OSError, ValueError, KeyError) as error:  # unknown: the server checks the length itself
                logger.warning("the served model's context length is unknown (%s): asking for 256 tokens", error)
                self._served = {}
        limit = self._served.get("max_model_len")
        return default_reply_budget(num_prompt, int(limit) if limit else None)

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=self.timeout) as response:
            return json.loads(response.read())

    def _request(self, path: str, body: dict) -> urllib.request.Request:
        return urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})

    def _post(self, path: str, body: dict) -> dict:
        with urllib.request.urlopen(self._request(path, body), timeout=self.timeout) as response:
            return json.loads(response.read())

    def _post_stream(self, path: str, body: dict) -> Iterator[dict]:
        """The server-sent events of a streamed answer, one JSON chunk each, until ``[DONE]``."""
        with urllib.request.urlopen(self._request(path, body), timeout=self.timeout) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    return
                chunk = json.loads(payload)
                if chunk.get("error"):  # vLLM reports a failure inside the stream, after the 200
                    error = chunk["error"]
                    raise RuntimeError(f"the server failed the request: "
                                       f"{error.get('message', error) if isinstance(error, dict) else error}")
                yield chunk


def prepare_prompt(tokenizer, messages: Sequence[dict], agent: str, tools: Optional[list], reuse: Optional[bool],
                   ahead: Optional[PrefillAhead], replies: Optional[ReplyAhead]
                   ) -> tuple[list[int], list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """A prompt's ids, the prefill-ahead copies of its new shared text for its later readers
    (:mod:`kvcomm_vllm.text_ahead`) and the ids before its reply in each learned reader's prompt
    (:mod:`kvcomm_vllm.reply_ahead`); both books learn from the prompt (not when ``reuse`` is
    False, nor without a book). A failure in the books costs the copies, never the call."""
    check_reuse(reuse)
    layout = render_prompt(tokenizer, messages, tools=tools)
    ids = layout.ids.tolist()
    copies, bases = [], []
    try:
        if ahead is not None and reuse is not False:
            spans = [layout.tokens_within(*span) for span in layout.content_spans if span is not None]
            copies = ahead.copies_for(agent, ids, spans)
            ahead.learn(agent, ids, spans)
        if replies is not None and reuse is not False:
            replies.learn(agent, ids)
            bases = replies.bases(agent, ids)
    except Exception as error:  # noqa: BLE001 - copies are an optimisation
        logger.warning("no copies for this call: %s", error)
    return ids, copies, bases


def remember_reply(tokenizer, replies: Optional[ReplyAhead], agent: str, ids: list[int], result: ChatResult) -> None:
    """Remember a call's prompt and reply (as a reader's prompt will tokenize its text); a
    failure costs later copies, never the call."""
    if replies is not None and result.text:
        try:
            replies.finished(agent, ids, tokenizer(result.text, add_special_tokens=False)["input_ids"])
        except Exception as error:  # noqa: BLE001
            logger.warning("reply not remembered for copies: %s", error)


def _body(model: str, ids: list[int], agent: str, max_new_tokens: int, temperature: float, top_p: float,
          stop: Optional[list[str]], seed: Optional[int], reuse: Optional[bool]) -> dict:
    """A completions request on token ids; the agent and the opt-out travel in ``kv_transfer_params``."""
    return {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": temperature,
            "top_p": top_p, "stop": stop or None, "seed": seed, "return_token_ids": True,
            "kv_transfer_params": {"agent": agent, "reuse": reuse is not False}}


def _finish(choice: dict) -> str:
    if choice.get("stop_reason") and isinstance(choice["stop_reason"], str):
        return "stop_string"
    return _FINISH.get(choice.get("finish_reason") or "stop", "stop")


def _server_ttft(metrics: Optional[dict]) -> Optional[float]:
    """Seconds from the server receiving the request to its first token (queue wait plus
    prefill), from vLLM's per-request metrics; ``None`` when the server sent none."""
    if not metrics or metrics.get("time_to_first_token_ms") is None:
        return None
    return (metrics["time_to_first_token_ms"] + (metrics.get("queue_time_ms") or 0.0)) / 1000.0


def _load_tokenizer(name: str):
    from pathlib import Path

    from transformers import AutoTokenizer

    if not Path(name).is_dir():
        from kvcomm_agents.paged import embedded_model_dir

        if "smollm2" not in name.lower():  # another model's ids from SmolLM2's tokenizer would be garbage
            raise InvalidRequestError(f"the served model {name!r} is not a local folder, so its tokenizer cannot be "
                                      "loaded here; pass VLLMEngine(tokenizer=<the model's folder or tokenizer>)")
        name = str(embedded_model_dir())
    return AutoTokenizer.from_pretrained(name)


def _stats(agent: str, prompt: int, generated: int, ttft: float, elapsed: float, report: dict,
           reuse: Optional[bool], streamed: bool = False) -> CallStats:
    """The server's report as :class:`CallStats` (an empty report: a server without the
    connector; nothing was reused). A streamed answer's report has the cached token count only:
    no exact-prefix share, no decisions; its reused tokens count as ``mode="reuse"``."""
    reused = int(report.get("reused_tokens", 0))
    prefix = int(report.get("prefix_tokens", 0))
    decisions = [SegmentDecision(**{**d, "span": tuple(d["span"])}) for d in report.get("decisions", [])]
    mode = "dense" if reused == 0 else "reuse" if streamed or reused != prefix else "prefix"
    return CallStats(agent=agent, prompt_tokens=prompt, reused_tokens=reused, computed_tokens=prompt - reused,
                     prefix_tokens=prefix, generated_tokens=generated, ttft_s=ttft, align_s=0.0, total_s=elapsed,
                     mode=mode, dense_reason=report.get("dense_reason") if report else "not_served_by_kvcomm",
                     decisions=decisions, opted_out=reuse is False,
                     own_text_tokens=int(report.get("own_text_tokens", 0)))
