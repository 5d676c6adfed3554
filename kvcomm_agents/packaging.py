"""Package KV out of a finished call for later calls: the exact prefix, the reply, and user/tool
messages seen for the first time.

Segment keys are cut from the call's cache and de-rotated to the canonical frame (first token at
position 0). KV is stored only where it is complete: a sliding window that dropped early tokens
means nothing is packaged.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any, Mapping, Optional, Sequence

import torch

from .cache import hf_cache
from .cache.assembly import PrefillResult, kv_at_positions, stacked_kv_at_positions
from .cache.anchors import AnchorRegistry
from .cache.rope import RopeRotator
from .cache.segments import Kind, KVSegment, SegmentRef, from_stacked
from .cache.store import SegmentStore
from .cache.templates import TemplateStore
from .config import KVCommConfig
from .plan import CallPlan
from .prompt import PromptLayout, normalize_messages

__all__ = ["align_ids_to_text", "cut_segment", "message_kind", "CallPackager"]

logger = logging.getLogger("kvcomm_agents")


def align_ids_to_text(tokenizer, ids: list[int], text: str) -> list[Optional[tuple[int, int]]]:
    """Character span in ``text`` of each id, or None where the ids leave the canonical
    tokenization of ``text`` (a non-canonical merge the model produced, eos, text past a stop).
    """
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    canonical, offsets = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    spans: list[Optional[tuple[int, int]]] = [None] * len(ids)
    if list(ids[: len(canonical)]) == list(canonical):
        spans[: len(canonical)] = offsets
        return spans
    matcher = difflib.SequenceMatcher(None, list(ids), list(canonical), autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        spans[a : a + size] = offsets[b : b + size]
    return spans


def cut_segment(
    *,
    cache,
    slot_positions: torch.Tensor,
    rotator: RopeRotator,
    start: int,
    token_ids: list[int],
    char_spans: list[Optional[tuple[int, int]]],
    text: str,
    kind: Kind,
    model_fingerprint: str,
) -> KVSegment:
    """Copy prompt positions ``start .. start + len(token_ids)`` out of ``cache`` as a segment.

    Keys are de-rotated by ``-start`` so the segment's first token sits at position 0.
    """
    positions = torch.arange(start, start + len(token_ids))
    stacked = stacked_kv_at_positions(cache, slot_positions, positions)
    if stacked is not None:  # one rotation for every layer; the segment keeps per-layer views
        stacked = (rotator.shift(stacked[0], -start), stacked[1])
        keys, values = from_stacked(*stacked)
    else:
        keys, values = kv_at_positions(cache, slot_positions, positions)
        keys = [rotator.shift(k, -start) for k in keys]
    segment = KVSegment.create(
        kind=kind,
        text=text,
        token_ids=token_ids,
        char_spans=char_spans,
        keys=keys,
        values=values,
        model_fingerprint=model_fingerprint,
    )
    segment._stacked = stacked
    return segment


def message_kind(message: dict) -> Optional[Kind]:
    """Kind of a user or tool message's segment; None for other roles (not captured)."""
    role = message.get("role")
    if role == "user":
        return ("user", None)
    if role == "tool":
        return (str(message.get("name") or message.get("tool_call_id") or "tool"), "tool")
    return None


class CallPackager:
    """Stores what a finished call computed, for the calls after it.

    Args:
        store: where segments and prefixes go.
        tokenizer: to align generated ids with the reply text.
        rotator: de-rotates keys to the canonical frame.
        fingerprint: the engine's model fingerprint, stamped on every segment.
        config: ``prefix_cache``, ``capture_messages``, ``min_match_tokens``, ``min_prefix_tokens``.
        anchors: where observed offsets go (``config.offsets`` other than ``"none"``).
        templates: where the agents' template KV goes (``config.template == "reuse"``).
    """

    def __init__(
        self, store: SegmentStore, tokenizer, rotator: RopeRotator, fingerprint: str, config: KVCommConfig,
        anchors: Optional[AnchorRegistry] = None, templates: Optional[TemplateStore] = None,
    ):
        self.store = store
        self.anchors = anchors if config.offsets != "none" else None
        self.templates = templates if config.template == "reuse" else None
        self.tokenizer = tokenizer
        self.rotator = rotator
        self.fingerprint = fingerprint
        self.config = config

    def package(
        self,
        layout: PromptLayout,
        messages: Sequence[Mapping[str, Any]],
        plan: CallPlan,
        prefill: PrefillResult,
        agent: str,
        generated_ids: list[int],
        reply_text: str,
    ) -> Optional[SegmentRef]:
        """Store the exact prefix, first-seen user/tool messages and the reply; returns the
        reply's reference (None when nothing could be stored)."""
        n = plan.num_prompt
        generated = generated_ids[:-1]  # the last generated id was never fed: it has no KV
        slots = torch.cat([prefill.slot_positions, torch.arange(n, n + len(generated))])
        cache = prefill.cache
        if hf_cache.num_cached(cache) != slots.numel():  # a sliding window dropped early KV
            logger.debug("cache holds %d of %d tokens; nothing packaged", hf_cache.num_cached(cache), slots.numel())
            return None
        self.store_prefix(plan, generated, cache, slots)
        if not self.config.segment_reuse:
            return None  # exact prefix caching only: segments would never be read
        self.record_offsets(plan, agent, cache, slots)
        if self.config.capture_messages:
            # a message holding a known segment (e.g. "Agent 1 said: <reply>") is not stored again
            found = {d.message_index for d in plan.decisions}
            for index, message in enumerate(normalize_messages(messages)):
                kind = message_kind(message)
                content = message.get("content")
                if kind is None or index in found or not isinstance(content, str):
                    continue
                if self.store.find_text(content, self.fingerprint) is None:
                    self.capture_message(layout, index, kind, cache, slots)
        return self.capture_reply(n, generated, reply_text, agent, cache, slots)

    def record_offsets(self, plan: CallPlan, agent: str, cache, slots: torch.Tensor) -> None:
        """Record anchors: ``real - base`` KV of segment tokens computed with exact context before
        them, and of the template piece after each; keep template KV first seen in this call."""
        exact_until = plan.first_reused_run_start()
        if self.anchors is not None and not self.anchors.frozen:
            for seen in plan.observations:
                if seen.length <= 0 or seen.prompt_start + seen.length > exact_until:
                    continue
                keys, values = self._offsets_from(cache, slots, seen.prompt_start, seen.length,
                                                  seen.segment, seen.segment_start)
                self.anchors.record(agent, seen.segment, seen.segment_start, keys, values)
        for piece in plan.pieces:
            if piece.reused:
                continue
            template = self._template(agent, piece, cache, slots)
            if self.anchors is not None and template is not None and piece.observed and piece.end <= exact_until:
                keys, values = self._offsets_from(cache, slots, piece.start, piece.end - piece.start, template, 0)
                self.anchors.record_prefix(agent, piece.after, piece.key, keys, values)

    def _offsets_from(self, cache, slots, prompt_start: int, length: int, base: KVSegment, base_start: int):
        """``[L-1, H, n, D]`` float32 ``real - base`` for prompt positions ``prompt_start..+length``
        against ``base``'s tokens ``base_start..+length`` (keys compared in the canonical frame)."""
        keys, values = kv_at_positions(cache, slots, torch.arange(prompt_start, prompt_start + length))
        shift = prompt_start - base_start
        window = slice(base_start, base_start + length)
        key_offsets = torch.stack([(self.rotator.shift(k, -shift).float() - b[:, :, window].float().to(k.device))[0]
                                   for k, b in zip(keys[1:], base.keys[1:])])
        value_offsets = torch.stack([(v.float() - b[:, :, window].float().to(v.device))[0]
                                     for v, b in zip(values[1:], base.values[1:])])
        return key_offsets, value_offsets

    def _template(self, agent: str, piece, cache, slots) -> Optional[KVSegment]:
        """The agent's template KV of ``piece``: the stored one, else this call's (stored now)."""
        if self.templates is None:
            return None
        template = self.templates.get(agent, piece.key)
        if template is None and not self.templates.frozen:
            template = cut_segment(
                cache=cache, slot_positions=slots, rotator=self.rotator, start=piece.start,
                token_ids=piece.token_ids, char_spans=[None] * len(piece.token_ids), text="",
                kind=(agent, "template"), model_fingerprint=self.fingerprint,
            )
            if not self.templates.put(agent, piece.key, template):
                return None
        return template

    def store_prefix(self, plan: CallPlan, generated: list[int], cache, slots: torch.Tensor) -> None:
        """Keep the exact KV of the prompt plus reply, up to the first re-rotated token."""
        if not self.config.prefix_cache:
            return
        ids = torch.cat([plan.prompt_ids, torch.tensor(generated, dtype=torch.long)])
        exact = plan.first_reused_run_start() if plan.runs else ids.numel()
        if exact < self.config.min_prefix_tokens:
            return
        hit = self.store.longest_prefix(ids[:exact], self.fingerprint)
        if hit is not None and hit[1] >= exact:
            return
        stacked = stacked_kv_at_positions(cache, slots, torch.arange(exact))
        if stacked is not None:
            self.store.put_prefix(ids[:exact], *from_stacked(*stacked), self.fingerprint, stacked=stacked)
        else:
            self.store.put_prefix(ids[:exact], *kv_at_positions(cache, slots, torch.arange(exact)), self.fingerprint)

    def capture_message(self, layout: PromptLayout, index: int, kind: Kind, cache, slots) -> Optional[SegmentRef]:
        """Store message ``index``'s content KV as a segment of ``kind``."""
        span = layout.content_spans[index]
        if span is None:
            return None
        tokens = layout.tokens_within(*span)
        if len(tokens) < self.config.min_match_tokens:
            return None
        char_spans = [(s - span[0], e - span[0]) for s, e in layout.offsets[tokens.start : tokens.stop]]
        segment = cut_segment(
            cache=cache, slot_positions=slots, rotator=self.rotator, start=tokens.start,
            token_ids=layout.ids[tokens.start : tokens.stop].tolist(), char_spans=char_spans,
            text=layout.text[span[0] : span[1]], kind=kind, model_fingerprint=self.fingerprint,
        )
        return segment.ref if self.store.put(segment) else None

    def capture_reply(self, start: int, generated: list[int], text: str, agent: str, cache, slots) -> Optional[SegmentRef]:
        """Store the reply's KV (the ids that map onto its text) as an ``(agent, "assistant")`` segment."""
        spans = align_ids_to_text(self.tokenizer, generated, text)
        last = max((i for i, span in enumerate(spans) if span is not None), default=-1)
        if last + 1 < self.config.min_match_tokens or not text:
            return None  # too short to ever be reused
        segment = cut_segment(
            cache=cache, slot_positions=slots, rotator=self.rotator, start=start,
            token_ids=generated[: last + 1], char_spans=spans[: last + 1], text=text,
            kind=(agent, "assistant"), model_fingerprint=self.fingerprint,
        )
        return segment.ref if self.store.put(segment) else None
