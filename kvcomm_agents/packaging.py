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
from .cache.assembly import PrefillResult, kv_at_positions
from .cache.offsets import OffsetPool
from .cache.rope import RopeRotator
from .cache.segments import Kind, KVSegment, SegmentRef
from .cache.store import SegmentStore
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
    keys, values = kv_at_positions(cache, slot_positions, positions)
    keys = [rotator.shift(k, -start) for k in keys]
    return KVSegment.create(
        kind=kind,
        text=text,
        token_ids=token_ids,
        char_spans=char_spans,
        keys=keys,
        values=values,
        model_fingerprint=model_fingerprint,
    )


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
    """

    def __init__(
        self, store: SegmentStore, tokenizer, rotator: RopeRotator, fingerprint: str, config: KVCommConfig,
        offsets: Optional[OffsetPool] = None,
    ):
        self.store = store
        self.offsets = offsets
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
        """Record ``real - base`` KV of segment tokens computed with exact context before them."""
        if self.offsets is None or self.config.offsets == "none" or self.offsets.frozen:
            return
        exact_until = plan.first_reused_run_start()
        for seen in plan.observations:
            if seen.length <= 0 or seen.prompt_start + seen.length > exact_until:
                continue
            keys, values = kv_at_positions(cache, slots, torch.arange(seen.prompt_start, seen.prompt_start + seen.length))
            shift = seen.prompt_start - seen.segment_start
            window = slice(seen.segment_start, seen.segment_start + seen.length)
            key_offsets = [self.rotator.shift(k, -shift).float() - base[:, :, window].float()
                           for k, base in zip(keys, seen.segment.keys)]
            value_offsets = [v.float() - base[:, :, window].float() for v, base in zip(values, seen.segment.values)]
            self.offsets.record(agent, seen.segment.ref.kind, seen.segment_start, key_offsets, value_offsets)

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
        keys, values = kv_at_positions(cache, slots, torch.arange(exact))
        self.store.put_prefix(ids[:exact], keys, values, self.fingerprint)

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
