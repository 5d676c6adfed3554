"""``KVCommEngine``: run a local causal LM for many agents, reusing KV across their prompts.

The engine holds the model, the segment store, the anchors and the rest of the state several
agents share, checks each request and renders its prompt; the steps of one call (plan, align,
prefill, decode, keep, audit, stats) are :mod:`.call`'s.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch

from .audit import CallAuditor
from .call import CallSteps, EngineParts
from .budgets import default_budgets
from .anchors import KVCommAnchors
from .anchors.remembered import measurements_folder, remembered, under_cache_dir
from .capture import CallCapture
from .checks import (check_agent, check_length, check_max_new_tokens, check_reply_ids, check_segment_fits, reply_budget,
                     segment_kind, segment_not_kept)
from .config import KVCommConfig
from .decoding import TextAccumulator, TokenSampler
from .engines import hf
from .engines.placement import model_lock
from .engines.weight_layout import choose_layout
from .errors import InvalidRequestError
from .evaluation import Replay, greedy_prefix, trim_at_eos
from .framing import Framer
from .identity import WeightsWatch
from .kv.block_count import BlockCount
from .kv.own_text import OwnTextStore
from .kv.segments import Kind, SegmentRef
from .kv.shared import SharedSegments
from .kv.store import SegmentStore
from .models import load_model
from .plan import CallPlan
from .prompt import render_prompt
from .results import ChatResult
from .prefill_cost import prefill_cost
from .rerotation_check import RerotationCheck
from .model_config import text_config
from .support import inspect_model, model_fingerprint
from .versions import Versions

__all__ = ["KVCommEngine", "PlanHook"]

logger = logging.getLogger("kvcomm_agents")
Messages = Sequence[Mapping[str, Any]]
#: Called with each call's plan between planning and prefill; returns the plan to prefill (a
#: baseline's variant, e.g. the benchmark's CacheBlend-style recompute). Runs under the engine lock.
PlanHook = Callable[["KVCommEngine", CallPlan], CallPlan]


class KVCommEngine:
    """Serve several agents from one local model, reusing each other's KV caches.

    Args:
        model: a loaded causal LM (``PreTrainedModel``), on any device or ``device_map``.
        tokenizer: its tokenizer, with a chat template (fast, for reuse).
        config: settings; defaults to ``KVCommConfig()``.
        store: a segment store to share between engines; a new one by default.
        plan_hook: see :data:`PlanHook` (benchmarks only; None in production).
        shared: a segment tier shared with other processes serving the same model (a fleet:
            ``kvcomm_agents.paged.RedisSegments``); what this engine computes is published there,
            and what others published is found and fetched like its own (:mod:`.kv.shared`).

    Raises:
        UnsupportedModelError: the model cannot be re-rotated (the message says what is
            supported and how to run with ``KVCommConfig(method="dense")``).
    """

    def __init__(self, model, tokenizer, *, config: Optional[KVCommConfig] = None,
                 store: Optional[SegmentStore] = None, plan_hook: Optional[PlanHook] = None,
                 shared: Optional[SharedSegments] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or KVCommConfig()
        self.info = inspect_model(model, tokenizer, reuse=self.config.reuse, exact_only=self.config.method == "exact_prefix")
        #: how the model's linear weights lie in memory, and why (:mod:`.engines.weight_layout`)
        self.weight_layout = choose_layout(model, self.config.weight_layout, folder=measurements_folder(self.config))
        self._weights = WeightsWatch(model)
        self.plan_hook = plan_hook
        c, x = self.config, self.config.experimental
        store_budget, anchor_budget = default_budgets(hf.input_device(model))
        if store is not None and shared is not None:
            raise InvalidRequestError("give either store= or shared= (a store built with shared=...), not both")
        self._store = store if store is not None else SegmentStore(
            c.store_max_bytes if c.store_max_bytes is not None else store_budget, min_run=c.min_match_tokens, shared=shared)
        self._store.fetch_onto(hf.kv_devices(model))  # KV fetched from a shared tier lands where the model reads it
        self._lock = model_lock(model)  # shared by engines on a model its forwards change (offloaded)
        self._freeze = BlockCount()
        self._anchors = KVCommAnchors.from_config(c, default_max_bytes=anchor_budget, freeze=self._freeze)
        self._versions = Versions.from_config(c, self._anchors, tokenizer)
        self._own_texts = OwnTextStore(x.own_text_max_bytes, self._freeze)
        self._calibrating = BlockCount()  # open calibrating() blocks
        self._capture = CallCapture(self._store, tokenizer, self.info.rotator, self.info.fingerprint, c, self._own_texts)
        self._auditor = CallAuditor(model, self.info.rotator, c, self._anchors, self._capture)
        self._framer = Framer(self.config, self._anchors, self._versions, self.info, self._store)
        self._remembered = remembered(c, self.info.fingerprint, self._anchors.tracker)
        cost = prefill_cost(model, hf.input_device(model)) if c.dense_when_cheaper else None
        self._calls = CallSteps(EngineParts(
            model, c, self.info, self._lock, self._weights, self._calibrating, self._store, self._anchors,
            self._versions, self._own_texts, self._framer, self._auditor, self._capture,
            plan_hook=lambda: None if self.plan_hook is None else (lambda plan: self.plan_hook(self, plan)),
            refresh_weights=self._refresh_changed_weights, prefill_cost=cost,
            rerotation_check=RerotationCheck(model, self.info.rotator, c, self._store, self.info.fingerprint,
                                             self._anchors, cost),
            remember=lambda: self._remembered is not None and self._remembered.sync(self._anchors.frozen)))

    # ---- an engine is a shared resource ---------------------------------------------------
    def __copy__(self) -> "KVCommEngine":
        return self

    def __deepcopy__(self, memo) -> "KVCommEngine":
        """Copies of objects that hold an engine (a chat model, a graph's config) share it: one
        model, one store, one set of anchors per process."""
        return self

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a KVCommEngine cannot be pickled: it holds a loaded model and its KV caches in this "
            "process. Share it by reference within the process; in another process build an "
            "engine there (ChatKVComm(engine=None) uses that process's default engine)."
        )

    @classmethod
    def from_pretrained(
        cls,
        model: Optional[Union[str, os.PathLike]] = None,
        *,
        config: Optional[KVCommConfig] = None, dtype=None, device: Optional[str] = None, device_map=None,
        attn_implementation: Optional[str] = None, cache_dir: Optional[Union[str, os.PathLike]] = None,
    ) -> "KVCommEngine":
        """Load a model and wrap it. ``model=None`` loads the embedded SmolLM2-135M-Instruct
        offline; otherwise a local folder or a hub id. ``dtype=None`` means float32 on CPU and
        the checkpoint's dtype on CUDA. ``cache_dir`` also holds remembered measurements."""
        loaded, tokenizer = load_model(model, dtype=dtype, device=device, device_map=device_map,
                                       attn_implementation=attn_implementation, cache_dir=cache_dir)
        return cls(loaded, tokenizer, config=under_cache_dir(config, cache_dir))

    @property
    def store(self) -> SegmentStore:
        """The segment store (``stats()``, ``clear()``, ``resize(n)``)."""
        return self._store

    @property
    def versions(self) -> Versions:
        """Recorded versions of segments (their offsets live in the anchor pools): ``homes``,
        ``token_texts`` (the tokenizer's id texts contexts are compared as), ``recorded(...)``."""
        return self._versions

    @property
    def anchors(self) -> KVCommAnchors:
        """KVCOMM anchor pools (``nbytes()``, ``clear()``, ``anchors(kind)``, ``pool(kind)``)."""
        return self._anchors

    @property
    def own_texts(self) -> OwnTextStore:
        """The agents' own-text KV (``experimental.own_text="reuse"``)."""
        return self._own_texts

    @property
    def fingerprint(self) -> str:
        """Identifies the weights as they are now (a change the watch sees is read first, as before
        a call), dtype and tokenizer; KV of any other fingerprint is never used."""
        if self._weights.changed():
            self._refresh_changed_weights()
        return self.info.fingerprint

    def refresh_fingerprint(self) -> str:
        """Recompute the fingerprint from the weights as they are now. Every call does this by
        itself when a weight tensor was replaced or written in place or the active adapters
        changed; call it after changing weights some other way. When the fingerprint changes,
        the anchors and own-text KV (learned from the old weights) are dropped, and stored KV of
        the old weights is never used again. Returns the fingerprint."""
        return self._refresh(recompute=True)

    def _refresh_changed_weights(self) -> None:
        """A weight tensor was replaced or written in place: the digest must be read again."""
        self._refresh(recompute=False)

    def _refresh(self, *, recompute: bool) -> str:
        with self._lock:
            fingerprint = model_fingerprint(self.model, self.tokenizer, recompute=recompute)
            self._weights.mark()
            if fingerprint != self.info.fingerprint:
                logger.info("weights changed: fingerprint %s -> %s", self.info.fingerprint, fingerprint)
                self.info.fingerprint = fingerprint
                self._capture.fingerprint = fingerprint
                self._anchors.clear()
                self._versions.clear()
                self._own_texts.clear()
                self._framer.clear()
                self._calls.parts.rerotation_check.fingerprint = fingerprint
                self._remembered = remembered(self.config, fingerprint, self._anchors.tracker)
            return fingerprint

    @contextmanager
    def freeze_anchors(self) -> Iterator[None]:
        """Stop anchor pools and own-text KV from changing inside the block (reproducible runs:
        no anchor is added, evicted, credited or given offsets). Blocks nest and interleave
        across threads: the pools stay frozen until the last block ends."""
        self._freeze.enter()
        try:
            yield
        finally:
            self._freeze.leave()

    # ---- warm start -----------------------------------------------------------------------
    def save_anchors(self, path: Union[str, os.PathLike]) -> int:
        """Write the anchor pools to one safetensors file (tensors plus a JSON header with the
        model fingerprint, the library version and the settings; never pickle). Returns the
        number of anchors written."""
        from . import __version__

        header = {"fingerprint": self.fingerprint, "library": __version__,
                  "settings": self.config.model_dump(mode="json", exclude={"dense_agents"})}
        return self._anchors.save(path, header)

    def load_anchors(self, path: Union[str, os.PathLike]) -> int:
        """Replace the anchor pools with a file written by :meth:`save_anchors` for this model,
        and what was measured with them (audits, re-rotation checks: the KL budget's evidence)
        where the file's settings measure as this engine's (:data:`.anchors.persist.MEASURED_WITH`):
        a warm-started engine serves re-rotation and estimates measured within the budget from
        its first call, instead of sampling them again.

        Raises:
            AnchorFileError: the file is missing, unreadable, corrupted or of another model
                (fingerprint, shapes or dtype differ); the engine's anchors are unchanged and
                it serves on without them.
        """
        config = text_config(self.model.config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shape = (config.num_hidden_layers - 1, kv_heads, head_dim)
        return self._anchors.load(path, fingerprint=self.fingerprint, shape=shape, device=self._device,
                                  dtype=self.model.dtype, settings=self.config.model_dump(mode="json"))

    @contextmanager
    def calibrating(self) -> Iterator[None]:
        """Inside the block, every call computes its shared segments densely (reason
        ``calibration``) and records them as anchors: a short warm-up on representative
        pipelines (a LangGraph graph included) before serving. Reuse resumes after the block."""
        self._calibrating.enter()
        try:
            yield
        finally:
            self._calibrating.leave()

    def calibrate(self, calls: Iterable[tuple[Messages, str]], *, max_new_tokens: int = 128) -> list[ChatResult]:
        """Run ``(messages, agent)`` calls densely, recording their shared segments as anchors
        (:meth:`calibrating`); returns their results. For pipelines whose later prompts depend
        on earlier replies, run the pipeline inside ``with engine.calibrating():`` instead."""
        with self.calibrating():
            return [self.chat(messages, agent=agent, max_new_tokens=max_new_tokens) for messages, agent in calls]

    # ---- public calls ---------------------------------------------------------------------
    def chat(self, messages: Messages, *, agent: str, **options) -> ChatResult:
        """Generate one agent's reply. Options as :meth:`stream`."""
        return _final(self.stream(messages, agent=agent, **options))

    def stream(
        self,
        messages: Messages,
        *,
        agent: str,
        max_new_tokens: Optional[int] = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        reuse: Optional[bool] = None,
        tools: Optional[list] = None,
    ) -> Iterator[Union[str, ChatResult]]:
        """Generate one agent's reply, yielding text pieces and finally the :class:`ChatResult`.

        Args:
            messages: ``{"role", "content"}`` dicts; a message may carry ``"segment"``
                (a ``SegmentRef`` or its dict) naming the segment its content came from.
            agent: the calling agent's name (its replies become segments of kind
                ``(agent, "assistant")``).
            max_new_tokens (None: 256, fewer where the context ends), temperature (0: greedy), top_p, stop, seed.
            reuse: False makes this call dense (it still keeps its KV for others).
            tools: passed to the chat template.

        Raises:
            InvalidRequestError: an argument is wrong (before any compute).
        """
        sampler = TokenSampler(temperature, top_p, seed, vocab_size=len(self.tokenizer))
        yield from self._generate(messages, agent, max_new_tokens, sampler, stop, reuse, tools)

    def greedy(self, messages: Messages, *, agent: str, max_new_tokens: Optional[int] = None, reuse: Optional[bool] = None,
               tools: Optional[list] = None) -> Replay:
        """``chat`` at temperature 0 that also returns the logits behind every generated token
        (evaluation: a free run's first-token KL against dense). ``Replay.greedy_prefix`` is the
        whole reply."""
        rows: list[torch.Tensor] = []
        choose = TokenSampler(vocab_size=len(self.tokenizer))

        def pick(logits: torch.Tensor) -> int:
            rows.append(logits.detach().float().cpu())  # every row: KL is over the model's whole output
            return choose(logits)

        result = _final(self._generate(messages, agent, max_new_tokens, pick, None, reuse, tools))
        return Replay(result, torch.stack(rows), len(result.token_ids))

    def _generate(self, messages: Messages, agent: str, max_new_tokens: Optional[int], sampler: Callable[[torch.Tensor], int],
                  stop: Optional[Sequence[str]], reuse: Optional[bool],
                  tools: Optional[list]) -> Iterator[Union[str, ChatResult]]:
        """:meth:`stream`'s body with the token picker given (``[vocab]`` logits -> id)."""
        check_agent(agent)
        check_max_new_tokens(max_new_tokens)
        text = TextAccumulator(self.tokenizer, stop)
        # The engine lock is taken around each compute step, never across a yield: a paused or
        # cross-thread-resumed stream (LangChain's async streaming) blocks nobody.
        started = time.perf_counter()
        layout = render_prompt(self.tokenizer, messages, tools=tools)
        max_new_tokens = reply_budget(layout, self.info.max_positions, max_new_tokens)
        with self._calls.prepared(layout, messages, agent, reuse, max_new_tokens, started) as call:
            first = sampler(call.pre.logits)
            ttft = time.perf_counter() - started
            finish = yield from self._calls.decoding.decode(call, first, sampler, text, max_new_tokens)
            tail = text.flush()
            if tail:
                yield tail
            segment, audit_kl = self._calls.keep(call, messages, agent, text)
        yield self._calls.result(call, agent, reuse, text, finish, segment, ttft, audit_kl)

    def replay(self, messages: Messages, *, agent: str, reply_ids: Sequence[int], reuse: Optional[bool] = None,
               tools: Optional[list] = None, stepwise: bool = False) -> Replay:
        """Run one agent call with ``reply_ids`` as its reply (teacher forcing, up to the first
        end-of-sequence id), for evaluation: the prompt, planning and the KV kept for later
        agents are exactly ``chat``'s. Returns the logits predicting each reply token and how
        many of them greedy decoding would have produced (:mod:`.evaluation`).

        ``stepwise``: feed the reply one decode step per token, as ``chat`` would generate it, so
        the call's time and forwards are a generated reply's (whole-graph measurements); by
        default the reply goes in one forward."""
        check_agent(agent)
        ids = trim_at_eos(check_reply_ids(reply_ids, len(self.tokenizer)), self.info.eos_ids)
        started = time.perf_counter()
        layout = render_prompt(self.tokenizer, messages, tools=tools)
        check_length(layout, self.info.max_positions, len(ids), "reply_ids")
        with self._calls.prepared(layout, messages, agent, reuse, len(ids), started) as call:
            int(torch.argmax(call.pre.logits))  # waits for the device: the first token's time
            ttft = time.perf_counter() - started  # the replayed reply's own forward comes after
            logits = (self._calls.decoding.force_stepwise if stepwise else self._calls.decoding.force)(call, ids)
            text = TextAccumulator(self.tokenizer)
            for token in ids:
                text.push(token)
            text.flush()
            segment, audit_kl = self._calls.keep(call, messages, agent, text)
        result = self._calls.result(call, agent, reuse, text, "forced", segment, ttft, audit_kl)
        return Replay(result, logits.cpu(), greedy_prefix(logits, ids, len(self.tokenizer)))

    def add_segment(self, text: str, *, kind: Optional[Kind] = None) -> SegmentRef:
        """Register text no agent generated (a document, a tool result) so later prompts reuse it.

        Its KV is computed as a user message of this model's chat template and cut out. With
        ``method="dense"`` nothing is computed or stored and later calls report ``reuse_off``.
        """
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("text must be a non-empty string")
        kind = segment_kind(kind)
        existing = self._store.find_text(text, self.fingerprint)  # the fingerprint of the weights as they are now
        if existing is not None and existing.ref.kind == kind:
            return existing.ref
        layout = render_prompt(self.tokenizer, [{"role": "user", "content": text}])
        check_segment_fits(layout, self.info.max_positions)
        if not self.config.reuse:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return SegmentRef(id="reuse-off", kind=kind, num_tokens=len(ids), text_hash="", fingerprint=self.fingerprint)
        if layout.content_spans[0] is None:
            raise InvalidRequestError("the chat template altered the text (e.g. trimmed its whitespace); pass it stripped")
        with self._lock, torch.inference_mode():
            pre = hf.prefill(self.model, layout.ids, torch.arange(layout.ids.numel()))
            ref = self._capture.capture_message(layout, 0, kind, hf.kv_reader(pre.cache, pre.slot_positions))
        if ref is None:
            span = layout.content_spans[0]
            raise segment_not_kept(len(layout.tokens_within(*span)), self.config.min_match_tokens, self._store)
        return ref

    @property
    def _device(self) -> torch.device:
        return hf.input_device(self.model)


def _final(items: Iterable[Union[str, ChatResult]]) -> ChatResult:
    """The :class:`ChatResult` a generation ends with (its text pieces consumed)."""
    for item in items:
        if isinstance(item, ChatResult):
            return item
    raise RuntimeError("the generation ended without a result")
