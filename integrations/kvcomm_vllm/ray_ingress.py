"""The fleet's HTTP front on Ray Serve: vLLM's OpenAI routes, each request handed to a replica
(:class:`~.ray_replica.VLLMReplica`) through a deployment handle, where
:class:`~.ray_router.KVAffinityRouter` picks the replica from the request's prompt ids.

Routes: ``GET /v1/models``, ``GET /health``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed when the body says ``"stream": true``): what
:class:`~.client.VLLMEngine` uses (completions on token ids, ``kv_transfer_params``,
``return_token_ids``, ``priority``, per-request metrics) is passed through untouched, and the
answers are vLLM's own; a non-streamed answer names the replica that served it in the
``x-kvcomm-replica`` header (host and process id).

**A replica that dies with requests on it** (its process killed, its node lost, its vLLM server
exited): each such request is **retried once** on another replica when nothing of its answer
has reached the client yet (a non-streamed request always; a streamed one before its first
piece). Greedy decoding gives the same answer there, and what the dead replica published to the
shared Redis tier before it died is served there too. A streamed answer cut after its first
piece cannot be retried without sending text twice: it ends with an error event
(``{"error": {"message": "... died mid-answer ..."}}``, which ``VLLMEngine`` raises as
``RuntimeError``). A request that fails twice answers 503 with the reason. Ray replaces the dead
replica meanwhile (Serve's health checks), and Serve's routers stop sending to it as soon as its
death is seen.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

__all__ = ["OpenAIIngress", "ReplicaFailed", "REPLICA_HEADER", "api"]

logger = logging.getLogger(__name__)

api = FastAPI(title="kvcomm-agents fleet on Ray Serve")

#: the response header naming the replica that served a non-streamed request
REPLICA_HEADER = "x-kvcomm-replica"

#: the failures retried on another replica: the replica's actor died or became unreachable
RETRIED = (RayActorError,)


class ReplicaFailed(RuntimeError):
    """The replica serving a request died, and the retry did too (or the answer had begun)."""


def _short(error: BaseException) -> str:
    """The first line of a Ray error (its full text holds the remote traceback)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# (everything the class uses is defined above it: Serve pickles the class when it is decorated)
@serve.ingress(api)
class OpenAIIngress:
    """vLLM's OpenAI routes in front of the replicas.

    Args:
        replicas: the handle of the replicas' deployment.
        retries: times a request whose replica died is sent to another one (default 1).
    """

    def __init__(self, replicas: DeploymentHandle, retries: int = 1):
        self._replicas = replicas
        self._retries = retries
        self._models: Optional[JSONResponse] = None

    @api.get("/v1/models")
    async def models(self) -> JSONResponse:
        # every replica serves the same model: asked once (the first answer that is not an error)
        if self._models is None:
            answer = await self._answer("/v1/models", None)
            if answer.status_code != 200:
                return answer
            self._models = answer
        return self._models

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({})

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._forward("/v1/completions", request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._forward("/v1/chat/completions", request)

    async def _forward(self, path: str, request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError as error:
            return JSONResponse({"error": {"message": f"the body is not JSON: {error}"}}, status_code=400)
        if body.get("stream"):
            return StreamingResponse(self._stream(path, body), media_type="text/event-stream")
        return await self._answer(path, body)

    async def _answer(self, path: str, body: Optional[dict]) -> JSONResponse:
        try:
            status, answer, replica = await self.call(path, body)
        except ReplicaFailed as error:
            return JSONResponse({"error": {"message": str(error)}}, status_code=503)
        return JSONResponse(answer, status_code=status, headers={REPLICA_HEADER: replica})

    async def call(self, path: str, body: Optional[dict]) -> tuple[int, Any, str]:
        """A non-streamed request on a replica, retried on another if its replica dies."""
        for attempt in range(self._retries + 1):
            try:
                return await self._replicas.call.remote(path, body)
            except RETRIED as error:
                if attempt == self._retries:
                    raise ReplicaFailed(f"the replica serving {path} died, and so did {attempt} retries: "
                                        f"{_short(error)}") from error
                logger.warning("the replica serving %s died (%s): retrying on another", path, _short(error))
        raise AssertionError("not reached")

    async def _stream(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """A streamed request's event-stream lines, retried before its first piece (see the
        module's docstring)."""
        for attempt in range(self._retries + 1):
            sent = False
            try:
                async for line in self._replicas.options(stream=True).stream.remote(path, body):
                    sent = True
                    yield line
                return
            except RETRIED as error:
                if not sent and attempt < self._retries:
                    logger.warning("the replica streaming %s died before answering (%s): retrying on another",
                                   path, _short(error))
                    continue
                reason = "died mid-answer" if sent else f"died, and so did {attempt} retries"
                message = f"the replica serving {path} {reason}: {_short(error)}"
                yield f"data: {json.dumps({'error': {'message': message}})}\n\ndata: [DONE]\n\n".encode()
                return
