"""Ray Serve's request router for the fleet's replicas: the replica that holds most of a prompt,
within the load bound (:class:`~.affinity.AffinityRule`, the rule :class:`~.fleet.AffinityRouter`
applies on the client).

What each replica holds comes from the replicas themselves: every ``request_routing_stats_period_s``
Serve calls each replica's ``record_routing_stats`` (:class:`~.ray_replica.VLLMReplica`: the token
ids of the prompts and replies it computed, :class:`~.affinity.ComputedLog`) and hands the result
to every router as ``RunningReplica.routing_stats``; the router syncs one
:class:`~.affinity.Holdings` per replica from it. Between two reports, the router also records
the prompts it routed itself (``on_request_routed``), so a follow-up sent right after its first
turn finds that turn's prompt on the replica that computed it before the replica has reported
(the reply joins at the next report). Nothing is kept on the client.

Requests in flight per replica: Serve's queue-length cache (the replicas' own counts, updated as
requests are sent and finish) when it has an entry, else the requests this router sent that have
not finished. A request without token ids (text prompts, chats) has no holdings: it goes to the
least busy replica, in turn.

The ranking goes back to Serve as two ranks, ``[[choice], [the others, least busy first]]``:
Serve sends to the first rank if that replica has room below ``max_ongoing_requests``, else to
the next.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, List, Optional, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .affinity import AffinityRule, Holdings, reported_runs

__all__ = ["KVAffinityRouter", "RoundRobinRouter", "ROUTERS", "prompt_ids"]

logger = logging.getLogger(__name__)

_ROUTED = "routed:"  # key prefix of the prompts this router recorded itself


class KVAffinityRouter(RequestRouter):
    """Routes each completion to the replica holding most of its prompt (see the module's docstring).

    Settings (``request_router_kwargs``): ``min_run`` (16), ``min_share`` (0.25),
    ``max_imbalance`` (4), ``remember`` (requests kept per replica, 4096), ``remember_routed``
    (the router's own records kept per replica, 256).
    """

    def initialize_state(self, min_run: int = 16, min_share: float = 0.25, max_imbalance: int = 4,
                         remember: int = 4096, remember_routed: int = 256, **unknown: Any) -> None:
        if unknown:
            raise TypeError(f"KVAffinityRouter got unknown settings: {sorted(unknown)}")
        self.rule = AffinityRule(min_share, max_imbalance)
        self._min_run, self._remember, self._remember_routed = min_run, remember, remember_routed
        self._holdings: dict[ReplicaID, Holdings] = {}
        self._routed_keys: dict[ReplicaID, list[str]] = {}
        self._mine: dict[ReplicaID, int] = {}  # requests this router sent, not finished
        self._turn, self._count = 0, itertools.count(1)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ids = prompt_ids(pending_request)
        held = [self._sync(replica).covered(ids) if ids else 0 for replica in candidate_replicas]
        in_flight = [self._in_flight(replica.replica_id) for replica in candidate_replicas]
        order = self.rule.rank(held, in_flight, len(ids or ()), self._turn)
        if _body(pending_request) is not None:  # ties among model requests go round; a GET takes no turn
            self._turn += 1
        logger.debug("prompt of %d ids: held %s, in flight %s -> %s", len(ids or ()), held, in_flight,
                     candidate_replicas[order[0]].replica_id.unique_id)
        return [[candidate_replicas[order[0]]], [candidate_replicas[r] for r in order[1:]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The prompt will be computed on ``replica_id``: held there from now on (until the
        replica's own report has it, or this router's ``remember_routed`` newer records push it out)."""
        self._mine[replica_id] = self._mine.get(replica_id, 0) + 1
        ids = prompt_ids(pending_request)
        if not ids:
            return
        holdings = self._holdings_of(replica_id)
        keys = self._routed_keys.setdefault(replica_id, [])
        keys.append(f"{_ROUTED}{next(self._count)}")
        holdings.add(keys[-1], ids)
        while len(keys) > self._remember_routed:
            holdings.discard(keys.pop(0))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._mine.get(replica_id):
            self._mine[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for replica_id in set(self._holdings) - {replica.replica_id for replica in replicas}:
            self._forget(replica_id)

    # ---- helpers ------------------------------------------------------------------------------
    def _sync(self, replica: RunningReplica) -> Holdings:
        holdings = self._holdings_of(replica.replica_id)
        prefix, runs = reported_runs(replica.routing_stats)
        if prefix is not None:
            holdings.sync(prefix, runs)
        return holdings

    def _holdings_of(self, replica_id: ReplicaID) -> Holdings:
        if replica_id not in self._holdings:
            self._holdings[replica_id] = Holdings(self._min_run, self._remember + self._remember_routed)
        return self._holdings[replica_id]

    def _in_flight(self, replica_id: ReplicaID) -> int:
        cached = self.replica_queue_len_cache.get(replica_id)
        return cached if cached is not None else self._mine.get(replica_id, 0)

    def _forget(self, replica_id: ReplicaID) -> None:
        self._holdings.pop(replica_id, None)
        self._routed_keys.pop(replica_id, None)
        self._mine.pop(replica_id, None)


class RoundRobinRouter(RequestRouter):
    """Requests to the replicas in turn, whatever they hold: the baseline the affinity router is
    measured against (``benchmarks/ray_fleet.py``; ``--routing round-robin``). A GET takes no
    turn. Takes no settings."""

    def initialize_state(self, **unknown: Any) -> None:
        if unknown:
            raise TypeError(f"RoundRobinRouter takes no settings, got {sorted(unknown)}")
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        first = self._turn % len(ordered)
        if _body(pending_request) is not None:
            self._turn += 1
        return [[ordered[first]], ordered[first + 1:] + ordered[:first]]


#: the routers ``--routing`` names
ROUTERS = {"affinity": KVAffinityRouter, "round-robin": RoundRobinRouter}


def prompt_ids(pending_request: Optional[PendingRequest]) -> Optional[Sequence[int]]:
    """The prompt's token ids when the request is a completion on token ids (the call
    ``replica.call(path, body)`` / ``replica.stream(path, body)`` with ``body["prompt"]`` a list
    of ints, as :class:`~.client.VLLMEngine` sends); else None."""
    body = _body(pending_request)
    prompt = body.get("prompt") if body is not None else None
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        return prompt
    return None


def _body(pending_request: Optional[PendingRequest]) -> Optional[dict]:
    """The request body of a ``call(path, body)`` / ``stream(path, body)``; None for a GET."""
    if pending_request is None:
        return None
    args = list(pending_request.args or ())
    body = args[1] if len(args) > 1 else pending_request.kwargs.get("body")
    return body if isinstance(body, dict) else None
