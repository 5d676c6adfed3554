"""One replica of the Ray Serve fleet: the connector's vLLM server, owned by a Serve replica.

Each replica starts ``python -m kvcomm_vllm.serve`` (vLLM's async engine and OpenAI server with
the connector and the shared Redis tier: :mod:`.serve`) as a child process on a free local port,
and forwards the ingress's requests to it. Why a child rather than vLLM's app built in this
process: :mod:`.serve` builds a command line, not an app, and vLLM's app-building functions are
internal and change between releases; the child is exactly the server the connector's tests run
(the worker in the scheduler's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and one local hop
costs little beside a model's prefill. The child dies with the replica (``PR_SET_PDEATHSIG``).

What the replica computed (each completion's prompt ids and reply ids, prefill-ahead copies
included) goes into a :class:`~.affinity.ComputedLog`, reported to the routers by
``record_routing_stats``. ``check_health`` fails when the child has exited or stops answering, so
Ray replaces the replica; entries already published to the Redis tier stay there for the others
and for the replacement.

Imports Ray only when the deployment is built (:func:`replica_deployment`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from typing import Any, AsyncIterator, Optional

from .affinity import ComputedLog

__all__ = ["EngineGone", "VLLMReplica", "replica_deployment"]

logger = logging.getLogger(__name__)


class EngineGone(RuntimeError):
    """The replica's vLLM server exited: the replica ends itself (Ray replaces it, and the
    ingress retries the request elsewhere), or its health check fails."""


class VLLMReplica:
    """The body of the Serve deployment (see :func:`replica_deployment`).

    Args:
        serve_args: ``python -m kvcomm_vllm.serve`` options (``--shared-store``, ``--kvcomm``, ``--model``...).
        env: environment for the server (``OMP_NUM_THREADS``, ``VLLM_CPU_KVCACHE_SPACE``).
        start_timeout_s: seconds the server may take to answer.
        request_timeout_s: seconds per forwarded request.
    """

    def __init__(self, serve_args: tuple[str, ...] = (), env: Optional[dict] = None, start_timeout_s: float = 900,
                 request_timeout_s: float = 600):
        import httpx

        from .serve import start_server, wait_until_serving

        self._process, self._url = start_server(*serve_args, env=env, die_with_parent=True)
        try:
            wait_until_serving(self._process, self._url, start_timeout_s)
        except RuntimeError:
            self._stop()
            raise
        self._client = httpx.AsyncClient(base_url=self._url, timeout=request_timeout_s)
        self.computed = ComputedLog()
        self.served = 0
        self.tag = f"{socket.gethostname()}:{os.getpid()}"  # which replica served (a response header)
        logger.info("replica %d serving vLLM at %s", os.getpid(), self._url)

    # ---- requests -----------------------------------------------------------------------------
    async def call(self, path: str, body: Optional[dict] = None) -> tuple[int, Any, str]:
        """A non-streamed request to the server: ``(status, JSON answer, this replica's tag)``;
        GET when ``body`` is None."""
        import httpx

        try:
            if body is None:
                response = await self._client.get(path)
            else:
                response = await self._client.post(path, json=body)
        except httpx.TransportError as error:
            self._raise_unless_alive(error)
            raise
        answer = response.json()
        if response.status_code == 200 and body is not None:
            self._log(body, [choice.get("token_ids") for choice in answer.get("choices") or []])
        return response.status_code, answer, self.tag

    async def stream(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """A streamed request: the server's event-stream lines as they come (an error status
        comes as one ``data:`` line holding the error, as vLLM reports failures mid-stream)."""
        import httpx

        replies: list[int] = []
        try:
            async with self._client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode("utf-8", "replace")
                    yield _error_event(f"the server answered {response.status_code}: {detail[-2000:]}")
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        for choice in json.loads(line[5:]).get("choices") or []:
                            replies.extend(choice.get("token_ids") or [])
                    yield (line + "\n").encode()
        except httpx.TransportError as error:
            self._raise_unless_alive(error)
            raise
        self._log(body, [replies])

    def _raise_unless_alive(self, error: Exception) -> None:
        """A transport error with the server gone ends this replica at once (every request on it
        fails alike): the ingress sees the replica die and retries elsewhere, Serve's routers drop
        it, and Ray starts a replacement. With the server alive (a timeout) the error stands."""
        if self._process.poll() is None:
            return
        logger.error("the replica's vLLM server exited (%s) during a request (%s): ending the replica",
                     self._process.returncode, error)
        os.kill(os.getpid(), signal.SIGKILL)
        raise EngineGone(f"the replica's vLLM server exited ({self._process.returncode})")  # not reached

    def _log(self, body: dict, replies: list) -> None:
        """Log a finished completion's prompt and reply ids (a prompt of text, or a chat, is
        not logged: the router matches token ids)."""
        self.served += 1
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            self.computed.add(list(prompt) + list((replies or [None])[0] or []))

    # ---- Serve hooks --------------------------------------------------------------------------
    async def record_routing_stats(self) -> dict:
        """What the routers read (:class:`~.ray_router.KVAffinityRouter`): the computed token runs,
        the requests served and this replica's tag (host and process id)."""
        return {**self.computed.report(), "served": self.served, "tag": self.tag}

    async def check_health(self) -> None:
        """Raise when the server exited or does not answer ``/health``: Ray replaces the replica."""
        import httpx

        if self._process.poll() is not None:
            raise EngineGone(f"the replica's vLLM server exited ({self._process.returncode})")
        try:
            response = await self._client.get("/health", timeout=30)
        except httpx.TransportError as error:
            raise EngineGone(f"the replica's vLLM server does not answer: {error}") from error
        if response.status_code != 200:
            raise EngineGone(f"the replica's vLLM server is unhealthy ({response.status_code})")

    def __del__(self):
        self._stop()

    def _stop(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            from .serve import stop_server

            stop_server(process, timeout_s=30)


def _error_event(message: str) -> bytes:
    """An event-stream line holding an error, as vLLM reports one after the 200 (the client
    raises it: :meth:`~.client.VLLMEngine._post_stream`)."""
    return f"data: {json.dumps({'error': {'message': message}})}\n\n".encode()


def replica_deployment(*, min_replicas: int = 1, max_replicas: int = 1, num_cpus: float = 1.0,
                       num_gpus: float = 0.0, max_ongoing_requests: int = 64, target_ongoing_requests: float = 8,
                       routing: str = "affinity", router_kwargs: Optional[dict] = None, stats_period_s: float = 1.0,
                       health_check_period_s: float = 5.0):
    """The replica as a Serve deployment, routed by :class:`~.ray_router.KVAffinityRouter`.

    Args:
        min_replicas, max_replicas: equal: that many replicas; else autoscaled between them on
            ``target_ongoing_requests`` per replica (Serve's autoscaling).
        num_cpus: Ray CPUs reserved per replica (vLLM's own threads are set by ``OMP_NUM_THREADS``).
        num_gpus: Ray GPUs per replica (a CUDA vLLM; not run here).
        max_ongoing_requests: requests a replica takes at once (vLLM batches them).
        routing: ``"affinity"`` (:class:`~.ray_router.KVAffinityRouter`) or ``"round-robin"``
            (:class:`~.ray_router.RoundRobinRouter`, the baseline of the benchmark).
        router_kwargs: the router's settings (the affinity router's ``min_share``...).
        stats_period_s: how often replicas report what they computed.
        health_check_period_s: how often Serve checks a replica (a dead one is replaced).
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .ray_router import ROUTERS

    if routing not in ROUTERS:
        raise ValueError(f"routing is one of {sorted(ROUTERS)}, got {routing!r}")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
    scaling: dict[str, Any] = {"num_replicas": min_replicas} if min_replicas == max_replicas else {
        "autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                               "target_ongoing_requests": target_ongoing_requests}}
    return serve.deployment(
        VLLMReplica, name="VLLMReplica", ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=max_ongoing_requests, health_check_period_s=health_check_period_s,
        health_check_timeout_s=60, graceful_shutdown_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[routing],
            request_router_kwargs=dict(router_kwargs or {}), request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=30),
        **scaling)
