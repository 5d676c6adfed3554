"""``KVCommEngine``: run a local causal LM for many agents, reusing KV across their prompts.

One call: render the prompt with the chat template -> plan (exact prefix, re-rotated shared
segments, the rest computed) -> one prefill forward -> decode -> package the reply's KV (and
any user/tool message seen for the first time) as segments for the next agents.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch

from .cache import hf_cache
from .cache.assembly import prefill
from .cache.blend import select_recompute
from .cache.anchors import AnchorRegistry
from .cache.segments import Kind, SegmentRef
from .cache.store import SegmentStore
from .cache.templates import TemplateStore
from .config import KVCommConfig
from .decoding import TextAccumulator, TokenSampler
from .errors import InvalidMessagesError
from .fidelity import first_token_kl
from .models import load_model
from .packaging import CallPackager
from .plan import CallPlan, Observation
from .planner import plan_call
from .prompt import PromptLayout, render_prompt
from .results import CallStats, ChatResult
from .support import inspect_model

__all__ = ["KVCommEngine"]

logger = logging.getLogger("kvcomm_agents")
Messages = Sequence[Mapping[str, Any]]


class KVCommEngine:
    """Serve several agents from one local model, reusing each other's KV caches.

    Args:
        model: a loaded causal LM (``PreTrainedModel``), on any device or ``device_map``.
        tokenizer: its tokenizer, with a chat template (fast, for reuse).
        config: settings; defaults to ``KVCommConfig()``.
        store: a segment store to share between engines; a new one by default.

    Raises:
        UnsupportedModelError: the model cannot be re-rotated (the message says what is
            supported and how to run with ``KVCommConfig(reuse=False)``).
    """

    def __init__(self, model, tokenizer, *, config: Optional[KVCommConfig] = None, store: Optional[SegmentStore] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or KVCommConfig()
        self.info = inspect_model(model, tokenizer, reuse=self.config.reuse, verify_rope=self.config.verify_rope)
        self._store = store if store is not None else SegmentStore(self.config.store_max_bytes)
        self._lock = threading.RLock()
        c = self.config
        self._anchors = AnchorRegistry(
            max_anchors=c.max_anchors, eviction_window=c.eviction_window, max_bytes=c.anchor_max_bytes,
            estimator="weighted" if c.offsets == "weighted" else "mean", gate=c.gate, gamma=c.gamma,
            max_error=c.max_error, min_anchors=c.min_anchors, temperature=c.anchor_temperature,
            activation_top_p=c.activation_top_p,
        )
        self._templates = TemplateStore(c.template_max_bytes)
        self._packager = CallPackager(
            self._store, tokenizer, self.info.rotator, self.info.fingerprint, c, self._anchors, self._templates
        )
        self._reused_calls = 0

    @classmethod
    def from_pretrained(
        cls,
        model: Optional[Union[str, os.PathLike]] = None,
        *,
        config: Optional[KVCommConfig] = None,
        dtype=None,
        device: Optional[str] = None,
        device_map=None,
        attn_implementation: Optional[str] = None,
        cache_dir: Optional[Union[str, os.PathLike]] = None,
    ) -> "KVCommEngine":
        """Load a model and wrap it. ``model=None`` loads the embedded SmolLM2-135M-Instruct
        offline; otherwise a local folder or a hub id. ``dtype=None`` means float32 on CPU and
        the checkpoint's dtype on CUDA."""
        loaded, tokenizer = load_model(
            model, dtype=dtype, device=device, device_map=device_map,
            attn_implementation=attn_implementation, cache_dir=cache_dir,
        )
        return cls(loaded, tokenizer, config=config)

    @property
    def store(self) -> SegmentStore:
        """The segment store (``stats()``, ``clear()``)."""
        return self._store

    @property
    def anchors(self) -> AnchorRegistry:
        """KVCOMM anchor pools (``nbytes()``, ``clear()``, ``anchors(kind)``, ``pool(kind)``)."""
        return self._anchors

    @property
    def templates(self) -> TemplateStore:
        """The agents' template KV (``config.template == "reuse"``)."""
        return self._templates

    @contextmanager
    def freeze_anchors(self) -> Iterator[None]:
        """Stop anchor pools and template KV from changing inside the block (reproducible runs:
        no anchor is added, evicted, credited or given offsets)."""
        with self._lock:
            was = self._anchors.frozen, self._templates.frozen
            self._anchors.frozen = self._templates.frozen = True
        try:
            yield
        finally:
            self._anchors.frozen, self._templates.frozen = was

    @property
    def fingerprint(self) -> str:
        """Identifies this engine's model, dtype and tokenizer."""
        return self.info.fingerprint

    # ---- public calls ---------------------------------------------------------------------
    def chat(self, messages: Messages, *, agent: str, **options) -> ChatResult:
        """Generate one agent's reply. Options as :meth:`stream`."""
        result = None
        for item in self.stream(messages, agent=agent, **options):
            if isinstance(item, ChatResult):
                result = item
        assert result is not None
        return result

    def stream(
        self,
        messages: Messages,
        *,
        agent: str,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        reuse: Optional[bool] = None,
        tools: Optional[list] = None,
        force_reply_ids: Optional[Sequence[int]] = None,
        return_logits: bool = False,
    ) -> Iterator[Union[str, ChatResult]]:
        """Generate one agent's reply, yielding text pieces and finally the :class:`ChatResult`.

        Args:
            messages: ``{"role", "content"}`` dicts; a message may carry ``"segment"``
                (a ``SegmentRef`` or its dict) naming the segment its content came from.
            agent: the calling agent's name (its replies become segments of kind
                ``(agent, "assistant")``).
            max_new_tokens, temperature, top_p, stop, seed: decoding; temperature 0 is greedy.
            reuse: False makes this call dense (it still packages its KV for others).
            tools: passed to the chat template.
            force_reply_ids: process these ids as the reply instead of sampling (measurement).
            return_logits: keep the first token's logits in ``ChatResult.first_token_logits``.
        """
        if not isinstance(agent, str) or not agent:
            raise InvalidMessagesError("agent must be a non-empty string")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if force_reply_ids is not None and len(force_reply_ids) == 0:
            raise ValueError("force_reply_ids must hold at least one token id")
        sampler = TokenSampler(temperature, top_p, seed)
        # The engine lock is taken around each compute step inside _run, never across a yield:
        # a paused or cross-thread-resumed stream (LangChain's async streaming) blocks nobody.
        for item in self._run(messages, agent, max_new_tokens, sampler, stop, reuse, tools, force_reply_ids):
            if isinstance(item, ChatResult) and not return_logits:
                item.first_token_logits = None
            yield item

    def add_segment(self, text: str, *, kind: Optional[Kind] = None) -> SegmentRef:
        """Register text no agent generated (a document, a tool result) so later prompts reuse it.

        Its KV is computed as a user message of this model's chat template and cut out. With
        reuse off nothing is computed or stored and later calls report ``reuse_off``.
        """
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty string")
        kind = tuple(kind) if kind else ("document", None)  # type: ignore[assignment]
        existing = self._store.find_text(text, self.fingerprint)
        if existing is not None and existing.ref.kind == kind:
            return existing.ref
        messages = [{"role": "user", "content": text}]
        layout = render_prompt(self.tokenizer, messages)
        with self._lock, torch.inference_mode():
            if not self.config.reuse:
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                return SegmentRef(id="reuse-off", kind=kind, num_tokens=len(ids), text_hash="", model=self.fingerprint)
            pre = prefill(self.model, self.info.rotator, CallPlan(layout.ids))
            if layout.content_spans[0] is None:
                raise ValueError("the chat template altered the text (e.g. trimmed its whitespace); pass it stripped")
            ref = self._packager.capture_message(layout, 0, kind, pre.cache, pre.slot_positions)
        if ref is None:
            raise ValueError(
                f"the text is shorter than min_match_tokens ({self.config.min_match_tokens} tokens) "
                "or larger than the store's byte budget"
            )
        return ref

    # ---- one call -------------------------------------------------------------------------
    def _run(self, messages, agent, max_new_tokens, sampler, stop, reuse, tools, forced) -> Iterator:
        started = time.perf_counter()
        layout = render_prompt(self.tokenizer, messages, tools=tools)
        with self._lock, torch.inference_mode():  # anchor bookkeeping tensors are inference tensors
            plan = self._plan(layout, messages, agent, reuse, max_new_tokens if forced is None else len(forced))
        planned = time.perf_counter()
        plan, recomputed = self._select_recompute(plan)
        selected = time.perf_counter()
        pinned = [run.segment for run in plan.runs] + ([plan.prefix.entry] if plan.prefix else [])
        with self._store.pinned(pinned):
            with self._lock, torch.inference_mode():
                pre = prefill(self.model, self.info.rotator, plan)
            prefill_done = time.perf_counter()
            text = TextAccumulator(self.tokenizer, stop)
            if forced is not None:
                sampler(pre.logits)  # what decoding would do first (waits for the device)
                ttft = time.perf_counter() - started  # the forced reply's own forward comes after
                ids, logits = self._force(plan, pre, forced)
                greedy_prefix = _greedy_prefix(logits, ids)
                finish = "forced"
                for token in ids:
                    piece = text.push(token)
                    if piece:
                        yield piece
            else:
                greedy_prefix = None
                next_id = sampler(pre.logits)
                ttft = time.perf_counter() - started
                finish = None
                position = plan.num_prompt
                while finish is None:
                    piece = text.push(next_id)
                    if piece:
                        yield piece
                    finish = self._finish_reason(next_id, text, max_new_tokens)
                    if finish is not None:
                        break
                    with self._lock, torch.inference_mode():
                        logits = hf_cache.run_forward(
                            self.model, torch.tensor([[next_id]], device=self._device),
                            pre.cache, position_ids=torch.tensor([[position]], device=self._device),
                        )[0, -1].float()
                    position += 1
                    next_id = sampler(logits)
            tail = text.flush()
            if tail:
                yield tail
            with self._lock, torch.inference_mode():
                segment = None
                if self.config.reuse:
                    segment = self._packager.package(layout, messages, plan, pre, agent, text.ids, text.text)
                audit_kl = self._audit(plan, pre.logits, agent)
        stats = CallStats(
            agent=agent,
            prompt_tokens=plan.num_prompt,
            reused_tokens=plan.reused_tokens,
            computed_tokens=plan.num_prompt - plan.reused_tokens,
            prefix_tokens=plan.prefix_length,
            generated_tokens=len(text.ids),
            ttft_s=ttft,
            align_s=pre.align_s,
            plan_s=planned - started,
            prefill_s=prefill_done - selected - pre.align_s,
            recompute_s=(selected - planned) if recomputed else 0.0,
            recomputed_tokens=recomputed,
            total_s=time.perf_counter() - started,
            mode="reuse" if plan.runs else ("prefix" if plan.prefix else "dense"),
            dense_reason=plan.dense_reason,
            decisions=plan.decisions,
            opted_out=self.config.reuse and (reuse is False or agent in self.config.dense_agents),
            template_tokens=plan.template_tokens,
            anchors_consulted=sum(d.gate.anchors for d in plan.decisions if d.gate is not None),
            anchor_bytes=self._anchors.nbytes() if self.config.offsets != "none" else 0,
            audit_kl=audit_kl,
        )
        yield ChatResult(
            text=text.text, token_ids=list(text.ids), segment=segment, finish_reason=finish, stats=stats,
            first_token_logits=pre.logits, forced_greedy_tokens=greedy_prefix,
        )

    def _select_recompute(self, plan: CallPlan) -> tuple[CallPlan, int]:
        """CacheBlend-style: hand the most deviating re-rotated tokens back to the prefill."""
        if not self.config.recompute_share or not plan.runs:
            return plan, 0
        with self._lock, torch.inference_mode():
            return select_recompute(
                self.model, self.info.rotator, plan,
                share=self.config.recompute_share, probe_layers=self.config.recompute_probe_layers,
            )

    def _force(self, plan: CallPlan, pre, forced: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """Process forced reply ids (up to the first end-of-sequence) in one forward, as decoding
        would have cached them. Returns the ids and ``[k, vocab]`` logits predicting each of them
        (row 0: the prompt's last token)."""
        ids = [int(t) for t in forced]
        ends = [i for i, t in enumerate(ids) if t in self.info.eos_ids]
        ids = ids[: ends[0] + 1] if ends else ids
        rows = [pre.logits[None]]
        if len(ids) > 1:
            n = plan.num_prompt
            with self._lock, torch.inference_mode():
                rows.append(hf_cache.run_forward(
                    self.model, torch.tensor([ids[:-1]], device=self._device), pre.cache,
                    position_ids=torch.arange(n, n + len(ids) - 1, device=self._device)[None],
                    last_logits_only=False,
                )[0].float())
        return ids, torch.cat([r.to(rows[0].device) for r in rows])

    def _audit(self, plan: CallPlan, logits: torch.Tensor, agent: str) -> Optional[float]:
        """Every ``audit_every``-th reused call: prefill densely and return KL(dense || reuse).

        The dense pass is exact everywhere, so the reused segments' real offsets are recorded as
        anchors too: the error gate's measurement stays fresh while calls are being reused."""
        if not self.config.audit_every or not plan.runs:
            return None
        self._reused_calls += 1
        if self._reused_calls % self.config.audit_every:
            return None
        dense = prefill(self.model, self.info.rotator, CallPlan(plan.prompt_ids))
        if self.config.reuse:
            observed = CallPlan(
                plan.prompt_ids,
                observations=[Observation(r.segment, r.prompt_start, r.segment_start, r.length)
                              for r in plan.runs if not r.template],
                pieces=[dataclasses.replace(p, reused=False, observed=True) for p in plan.pieces],
            )
            self._packager.record_offsets(observed, agent, dense.cache, dense.slot_positions)
        return first_token_kl(dense.logits, logits)

    @property
    def _device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def _plan(self, layout: PromptLayout, messages: Messages, agent: str, reuse: Optional[bool], new_tokens: int) -> CallPlan:
        if not self.config.reuse:
            return CallPlan(layout.ids, dense_reason="reuse_off")
        refuse = None
        window = self.info.sliding_window
        if reuse is False or agent in self.config.dense_agents:
            refuse = "reuse_off"
        elif window is not None and layout.ids.numel() + new_tokens > window:
            refuse = "sliding_window"
        return plan_call(
            layout, messages, store=self._store, model=self.fingerprint, config=self.config,
            refuse_reason=refuse, agent=agent, anchors=self._anchors, templates=self._templates,
        )

    def _finish_reason(self, token_id: int, text: TextAccumulator, max_new_tokens: int) -> Optional[str]:
        if token_id in self.info.eos_ids:
            return "stop"
        if text.stopped:
            return "stop_string"
        if len(text.ids) >= max_new_tokens:
            return "length"
        return None


def _greedy_prefix(logits: torch.Tensor, ids: list[int]) -> int:
    """How many leading ``ids`` greedy decoding would also produce (``logits[i]`` predicts ``ids[i]``)."""
    agree = (logits.argmax(dim=-1).cpu() == torch.tensor(ids)).long()
    return int(agree.cumprod(0).sum())
