"""Several replicas of one model, each a vLLM server with the KVCOMM connector: requests go to the
replica that already holds most of their text.

An agent's prompt repeats what other agents computed (the question, their replies). Sent to the
replica where those agents ran, that text is in the replica's memory (an exact prefix or a
segment to re-rotate); sent elsewhere it must come from the shared tier (one Redis fetch per
entry, when replicas run with ``--shared-store``) or be computed. :class:`AffinityRouter` scores
each replica by the prompt tokens its past requests (prompts and replies) cover, as token runs
found anywhere in the prompt (the matcher the store itself uses). Affinity wins only when it is
worth it: a replica holding at least ``min_share`` of the prompt gets it unless it has
``max_imbalance`` more requests in flight than the least busy one (the rule of cache-aware
routers such as SGLang's); otherwise, and on ties, the least busy replica, in turn (the rule and
the index live in :mod:`.affinity`, shared with the Ray Serve router, :mod:`.ray_router`, which
routes on the server side from what replicas report). :class:`FleetEngine` is
:class:`~.client.VLLMEngine`'s interface over several servers, so
``ChatKVComm(engine=FleetEngine([...]))`` serves a graph.

Standard library only, no vLLM import.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

from kvcomm_vllm.text_ahead import PrefillAhead
from kvcomm_vllm.reply_ahead import ReplyAhead
from kvcomm_agents import ChatResult

from .affinity import AffinityRule, Holdings
from .client import VLLMEngine, prepare_prompt, remember_reply

__all__ = ["AffinityRouter", "FleetEngine"]


class AffinityRouter:
    """Picks a replica for a prompt by the tokens of it each replica has computed, as the client
    recorded them (:class:`~.affinity.Holdings`, :class:`~.affinity.AffinityRule`: the rule the
    Ray Serve router applies to what replicas report).

    Args:
        replicas: how many replicas.
        min_run: the shortest token run that counts (the connector's ``min_match_tokens``).
        remember: past requests remembered per replica (oldest forgotten first; a replica's own
            store forgets too).
        min_share: the share of the prompt a replica must hold for affinity to count.
        max_imbalance: requests in flight beyond the least busy replica's at which affinity yields.
    """

    def __init__(self, replicas: int, *, min_run: int = 16, remember: int = 4096, min_share: float = 0.25,
                 max_imbalance: int = 4):
        if replicas < 1:
            raise ValueError("a fleet needs at least one replica")
        self._held = [Holdings(min_run, remember) for _ in range(replicas)]
        self._in_flight = [0] * replicas
        self._count, self._turn = 0, 0
        self.rule = AffinityRule(min_share, max_imbalance)
        self._lock = threading.Lock()

    @property
    def replicas(self) -> int:
        return len(self._held)

    @property
    def min_share(self) -> float:
        return self.rule.min_share

    @property
    def max_imbalance(self) -> int:
        return self.rule.max_imbalance

    def held_tokens(self, prompt_ids: Sequence[int]) -> list[int]:
        """Per replica, the prompt tokens (all but the last) its past requests cover."""
        with self._lock:
            return [held.covered(prompt_ids) for held in self._held]

    def pick(self, prompt_ids: Sequence[int]) -> int:
        """The replica holding most of the prompt if it holds enough of it and is not too busy;
        else the least busy (ties in turn)."""
        held = self.held_tokens(prompt_ids)
        with self._lock:
            choice = self.rule.rank(held, self._in_flight, len(prompt_ids), self._turn)[0]
            self._turn += 1
            return choice

    @contextmanager
    def serving(self, replica: int) -> Iterator[None]:
        """Count a request in flight on ``replica`` while the block runs."""
        with self._lock:
            self._in_flight[replica] += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[replica] -= 1

    def record(self, replica: int, ids: Sequence[int]) -> None:
        """``ids`` (a prompt followed by its reply) were computed on ``replica``."""
        with self._lock:
            self._count += 1
            self._held[replica].add(f"r{self._count}", ids)


class FleetEngine:
    """The ``chat`` / ``stream`` interface over several replicas (vLLM servers with the connector).

    Args:
        base_urls: one URL per replica (``python -m kvcomm_vllm.serve --port ...``).
        tokenizer: as for :class:`~.client.VLLMEngine` (loaded once, shared).
        model: the served model id (default: the first replica's first).
        router: default: an :class:`AffinityRouter` over ``base_urls``.
        timeout: seconds per request.
        prefill_ahead, reply_ahead: as for :class:`~.client.VLLMEngine`, learned over the whole
            fleet; the copies go to the replica serving the sender's call and are recorded there,
            so the router sends their reader to the replica that holds them.
    """

    def __init__(self, base_urls: Sequence[str], *, tokenizer: Any = None, model: Optional[str] = None,
                 router: Optional[AffinityRouter] = None, timeout: float = 600.0, prefill_ahead: bool = True,
                 reply_ahead: bool = True):
        if not base_urls:
            raise ValueError("a fleet needs at least one replica URL")
        books = dict(prefill_ahead=False, reply_ahead=False)  # the fleet learns; replicas only send
        first = VLLMEngine(base_urls[0], tokenizer=tokenizer, model=model, timeout=timeout, **books)
        self.replicas = [first] + [VLLMEngine(url, tokenizer=first.tokenizer, model=first.model_id, timeout=timeout,
                                              **books) for url in base_urls[1:]]
        self.ahead = PrefillAhead() if prefill_ahead else None
        self.replies = ReplyAhead() if reply_ahead else None
        self.tokenizer = first.tokenizer
        self.router = router or AffinityRouter(len(self.replicas))
        if self.router.replicas != len(self.replicas):
            raise ValueError(f"the router knows {self.router.replicas} replicas, {len(self.replicas)} URLs given")
        self.served = [0] * len(self.replicas)  # requests per replica

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    def chat(self, messages: Sequence[dict], *, agent: str, tools: Optional[list] = None, **options) -> ChatResult:
        """One agent call on the replica holding most of its prompt; see
        :meth:`KVCommEngine.chat <kvcomm_agents.KVCommEngine.chat>`. Streamed when it sends copies."""
        ids, copies, bases = prepare_prompt(self.tokenizer, messages, agent, tools, options.get("reuse"),
                                            self.ahead, self.replies)
        *_, result = self._serve(ids, copies, bases, agent, options, streamed=bool(copies or bases))
        return result

    def stream(self, messages: Sequence[dict], *, agent: str, tools: Optional[list] = None,
               **options) -> Iterator[Any]:
        """Text pieces from the replica holding most of the prompt, then the
        :class:`~kvcomm_agents.ChatResult`; see :meth:`.client.VLLMEngine.stream`."""
        ids, copies, bases = prepare_prompt(self.tokenizer, messages, agent, tools, options.get("reuse"),
                                            self.ahead, self.replies)
        yield from self._serve(ids, copies, bases, agent, options, streamed=True)

    def _serve(self, ids: list[int], copies: list, bases: list, agent: str, options: dict, *,
               streamed: bool) -> Iterator[Any]:
        """The call on the replica holding most of ``ids``, its copies (prefill ahead, replies
        ahead) sent to the same replica and recorded there for the router."""
        replica = self.router.pick(ids)
        engine = self.replicas[replica]
        sent: list[list[int]] = []  # the copies' prompts, as sent
        with self.router.serving(replica):
            if not streamed:
                pieces: Iterator[Any] = iter([engine.complete(ids, agent=agent, **options)])
            elif copies or bases:
                pieces = engine.stream_with_copies(ids, copies, bases, {"agent": agent, **options}, sent)
            else:
                pieces = engine.stream_ids(ids, agent=agent, **options)
            for item in pieces:
                if isinstance(item, ChatResult):
                    self.router.record(replica, ids + list(item.token_ids))
                    for prompt in sent:  # the reader goes where its copies are
                        self.router.record(replica, prompt)
                    remember_reply(self.tokenizer, self.replies, agent, ids, item)
                    self.served[replica] += 1
                yield item
