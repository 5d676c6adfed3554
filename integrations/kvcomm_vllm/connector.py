"""``KVCommConnector``: KVCOMM reuse inside vLLM, as an out-of-tree KV connector (vLLM 0.32).

Loaded by vLLM itself from ``kv_transfer_config`` (:func:`kvcomm_vllm.kv_transfer_config` builds
it). Per request, on token ids alone:

- **scheduler side** (:meth:`get_num_new_matched_tokens`): the broker plans the prompt (exact
  prefix, shared token runs re-rotated with anchor offsets or recorded versions, the receiver's
  own text from its own-text KV) and claims the longest reusable prefix of it; vLLM computes the
  rest. The agent comes from the request's ``kv_transfer_params`` (``{"agent": "solver"}``;
  ``{"reuse": false}`` runs it dense and records it; ``{"prefix_only": true}`` claims exact
  prefixes only, so that what it computes is kept as an exact prefix: a client's copy of a later
  reader's prompt, :mod:`kvcomm_vllm.reply_ahead`).
- **worker side** (:meth:`start_load_kv`): the claimed KV is aligned on the worker's device and
  written into the request's blocks with the backend's own cache-update op. A failed load marks
  the blocks for vLLM to recompute (``kv_load_failure_policy="recompute"``).
- **capture** (:meth:`request_finished`): the prompt and reply KV of every finished request is
  read from its blocks before they are freed and becomes segments, exact prefixes, own-text KV
  and anchor observations for later requests, inline; with ``background_capture=True``
  (:func:`kvcomm_vllm.kv_transfer_config`) the blocks are copied out and the rest runs on the
  broker's capture thread, off the scheduler's path (a request planned later that could read it
  waits for it; at most :data:`MAX_PENDING_CAPTURES` copies wait at once, past that inline).
  The request's report (tokens reused, each shared segment's decision and reason) goes back in
  the output's ``kv_transfer_params["kvcomm"]``.

Safety: vLLM's own prefix cache is refused at start (it would hash approximate KV as exact
blocks and serve it to later requests); this connector's exact-prefix reuse replaces it.

Named limits (checked at start, with a clear error): the worker must run in the scheduler's
process (``distributed_executor_backend="uni"``; on CPU also ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so one device, no tensor or pipeline parallelism; KV cache dtype ``auto``; no sliding-window,
MLA or hybrid models; no dense shadow audits yet (``audit_every`` is 0 here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcomm_agents import KVCommConfig, UnsupportedModelError
from kvcomm_agents.paged import KVBlock, KVCommBroker, rotator_from_config

from .paged import PagedKV

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KVCommConnector", "KVCommMetadata", "runtime_of", "runtimes"]

logger = logging.getLogger("kvcomm_agents.vllm")


@dataclass
class Load:
    """Claimed KV to write before a request's first forward: prompt positions ``start .. end``."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int


@dataclass
class KVCommMetadata(KVConnectorMetadata):
    """What the worker does this step."""

    loads: list[Load] = field(default_factory=list)


class _Runtime:
    """What the scheduler and worker sides of one engine share in their process: the broker and
    the paged KV."""

    def __init__(self, vllm_config: "VllmConfig"):
        model_config = vllm_config.model_config
        hf_config = model_config.hf_text_config
        _check_supported(vllm_config, hf_config)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer,
                                                       trust_remote_code=model_config.trust_remote_code)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.config = KVCommConfig(**extra.get("kvcomm", {}))
        self.fingerprint = _fingerprint(vllm_config, self.tokenizer)
        self.background_capture = _background_capture(extra)
        self.broker = KVCommBroker(self.tokenizer, rotator_from_config(hf_config), self.fingerprint, self.config,
                                   device=vllm_config.device_config.device, shared=_shared_tier(extra))
        self.paged: Optional[PagedKV] = None


def _shared_tier(extra: dict):
    """The fleet's shared segment tier named in the connector's extra config, if any."""
    url = extra.get("shared_store")
    if not url:
        return None
    from kvcomm_agents.paged import RedisSegments

    return RedisSegments(url, namespace=extra.get("shared_namespace", "kvcomm"))


def _background_capture(extra: dict) -> bool:
    """The connector's extra config's ``background_capture`` (default False); anything but a
    boolean is refused at start rather than read as off."""
    value = extra.get("background_capture", False)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config's background_capture must be true or false (got {value!r})")
    return value


_RUNTIMES: dict[str, _Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def runtime_of(vllm_config: "VllmConfig") -> _Runtime:
    """The process's runtime for this engine (created on first use)."""
    key = vllm_config.kv_transfer_config.engine_id
    with _RUNTIMES_LOCK:
        found = _RUNTIMES.get(key)
        if found is None:
            found = _RUNTIMES[key] = _Runtime(vllm_config)
        return found


def runtimes() -> list[_Runtime]:
    """Every engine's runtime in this process (its ``broker`` holds the store and anchors)."""
    with _RUNTIMES_LOCK:
        return list(_RUNTIMES.values())


def _check_supported(vllm_config: "VllmConfig", hf_config) -> None:
    """Refuse at start, with what is supported, what this connector cannot serve faithfully."""
    if vllm_config.cache_config.enable_prefix_caching:
        raise UnsupportedModelError(
            "KVCommConnector needs vLLM's prefix caching off (enable_prefix_caching=False, "
            "--no-enable-prefix-caching): vLLM would register approximate, re-rotated KV as exact prefix "
            "blocks and serve it to later requests. The connector reuses exact prefixes itself.")
    parallel = vllm_config.parallel_config
    if parallel.world_size != 1:
        raise UnsupportedModelError(
            "KVCommConnector supports one worker (tensor and pipeline parallel size 1) for now")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise UnsupportedModelError(
            f"KVCommConnector needs kv_cache_dtype='auto' (got {vllm_config.cache_config.cache_dtype!r}): "
            "quantized KV cannot be re-rotated exactly")
    if getattr(hf_config, "sliding_window", None) is not None and getattr(hf_config, "use_sliding_window", True):
        raise UnsupportedModelError("KVCommConnector does not support sliding-window attention models")
    rotator_from_config(hf_config)  # RoPE type checks: raises UnsupportedModelError with what is supported


def _fingerprint(vllm_config: "VllmConfig", tokenizer) -> str:
    """Identifies model, dtype and tokenizer from what the scheduler can see: the config, the
    dtype, the tokenizer and the weight files (names, sizes, first MiB). KV computed by another
    model, dtype or tokenizer is never used."""
    model_config = vllm_config.model_config
    digest = hashlib.sha256(json.dumps({
        "runtime": "vllm", "model": model_config.model, "dtype": str(model_config.dtype),
        "config": model_config.hf_text_config.to_dict(), "vocab": len(tokenizer),
    }, sort_keys=True, default=str).encode())
    folder = Path(model_config.model)
    if folder.is_dir():
        for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
            with open(path, "rb") as handle:
                digest.update(handle.read(1 << 20))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    return "vllm-" + digest.hexdigest()[:16]


#: finished requests whose KV copies may wait for the capture thread at once (each holds its
#: request's whole KV on the KV's device, outside vLLM's budget); past it, capture runs inline
MAX_PENDING_CAPTURES = 4


def _kv_at_copy(block: KVBlock, length: int):
    """``kv_at`` over ``block``, a copy of a request's positions ``0 .. length``: a position
    outside raises here (on CUDA an out-of-range index would be a device-side assert)."""

    def kv_at(positions: torch.Tensor) -> KVBlock:
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= length):
            raise IndexError(f"positions up to {int(positions.max())} read from a copy of {length}")
        return block.select(positions)

    return kv_at


def _layers_of(vllm_config: "VllmConfig", kv_caches: dict[str, torch.Tensor]) -> list[tuple[object, torch.Tensor]]:
    """``(attention module, cache)`` per layer, in model order."""
    from vllm.model_executor.models.utils import extract_layer_index

    context = vllm_config.compilation_config.static_forward_context
    names = sorted(kv_caches, key=extract_layer_index)
    return [(context[name], kv_caches[name]) for name in names]


class KVCommConnector(KVConnectorBase_V1):
    """KVCOMM's out-of-tree vLLM KV connector (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._runtime = runtime_of(vllm_config)
        self._loads: dict[str, Load] = {}
        self._failed_blocks: set[int] = set()
        if role == KVConnectorRole.SCHEDULER and self._runtime.paged is None:
            raise UnsupportedModelError(
                "KVCommConnector needs the worker in the scheduler's process: start vLLM with "
                "distributed_executor_backend='uni' (on CPU also VLLM_ENABLE_V1_MULTIPROCESSING=0); "
                "`python -m kvcomm_vllm.serve` does both")

    @property
    def broker(self) -> KVCommBroker:
        return self._runtime.broker

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        agent = str(params.get("agent") or "default")
        reuse = params.get("reuse", True) is not False
        try:
            claim = self.broker.plan(request.request_id, request.prompt_token_ids, agent, reuse=reuse,
                                     held=num_computed_tokens, prefix_only=params.get("prefix_only") is True)
        except Exception:  # noqa: BLE001 - a planning failure costs speed, never the request
            logger.exception("KVCOMM planning failed for request %s; it runs dense", request.request_id)
            self.broker.drop(request.request_id)
            return 0, False
        external = max(claim.length - num_computed_tokens, 0)
        return external, False

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        # the claim ends at claim.length; vLLM holds the tokens before its start. A request no longer
        # known to the broker still gets its load queued: it fails on the worker, which hands the
        # blocks back to vLLM to recompute (never unwritten blocks read as KV)
        claim = self.broker.claim(request.request_id)
        end = claim.length if claim is not None else request.num_computed_tokens + num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        self._loads[request.request_id] = Load(request.request_id, block_ids, end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVCommMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        paged = self._runtime.paged
        prompt = len(request.prompt_token_ids)
        output = list(request.output_token_ids)
        with_kv = request.num_computed_tokens - prompt + 1  # generated ids fed back: their KV exists
        background = self._runtime.background_capture and self.broker.pending_captures < MAX_PENDING_CAPTURES
        kv_at = None
        try:
            if paged is not None and paged.readable and request.num_computed_tokens >= prompt and block_ids:
                ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids)
                if background:  # the blocks are freed on return: copy them out, keep them later
                    kv_at = _kv_at_copy(paged.read(ids, torch.arange(request.num_computed_tokens)),
                                        request.num_computed_tokens)
                else:
                    kv_at = lambda positions: paged.read(ids, positions)  # noqa: E731
                output = output[: max(with_kv, 0)]
            report = self.broker.finish(request.request_id, output, kv_at, background=background)
        except Exception:  # noqa: BLE001 - a capture failure costs later reuse, never this request
            logger.exception("KVCOMM capture failed for request %s", request.request_id)
            self.broker.drop(request.request_id)
            report = {}
        return False, {"kvcomm": report} if report else None

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        hf_config = self._vllm_config.model_config.hf_text_config
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        paged = PagedKV(_layers_of(self._vllm_config, kv_caches), self._block_size, head_dim)
        if paged.choose_reader() is None:
            logger.warning("KVCOMM capture is off: %s", paged.check_reason)
        else:
            logger.info("KVCOMM paged KV: %d layers, block size %d, reader %s", len(paged.layers),
                        self._block_size, paged.reader_name)
        self._runtime.paged = paged

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCommMetadata) or not meta.loads:
            return
        paged = self._runtime.paged
        for load in meta.loads:
            try:
                block = self.broker.aligned(load.request_id)
                if block is None:
                    raise RuntimeError("the claim holds no reused KV")
                positions = torch.arange(load.start, load.end)
                paged.write(block.window(load.start, load.end), load.block_ids, positions)
            except Exception:  # noqa: BLE001 - vLLM recomputes the blocks (kv_load_failure_policy=recompute)
                logger.exception("KVCOMM load failed for request %s; its blocks are recomputed", load.request_id)
                first, last = load.start // self._block_size, (load.end - 1) // self._block_size
                self._failed_blocks.update(load.block_ids[first : last + 1])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # capture reads finished requests' blocks in request_finished

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
