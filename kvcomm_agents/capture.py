"""Keep what a finished call computed, for the calls after it: the exact prefix, the reply's KV,
user/tool messages seen for the first time, and (own-text reuse) the agent's own-text KV.

Segment keys are cut from the call's KV and de-rotated to the canonical frame (first token at
position 0). The call's KV is read through a ``kv_at(positions) -> KVBlock`` accessor, so this
module knows token positions and blocks, not a runtime's cache.
"""

from __future__ import annotations

import difflib
import logging
from typing import Callable, Optional

import torch

from .config import KVCommConfig
from .errors import InvalidRequestError
from .kv.block import KVBlock
from .kv.own_text import OwnTextStore
from .kv.rope import RopeRotator
from .kv.segments import CONTEXT_TOKENS, Kind, KVSegment, SegmentRef, content_hash
from .kv.store import SegmentStore
from .plan import UNSERVED_REFERENCES, CallPlan
from .prompt import PromptLayout

__all__ = ["align_ids_to_text", "message_kind", "CallCapture", "KVAt"]

logger = logging.getLogger("kvcomm_agents")

#: ``positions -> KVBlock``: a pass's KV at ``[n]`` prompt positions, keys at their true positions.
KVAt = Callable[[torch.Tensor], KVBlock]


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


def message_kind(role: Optional[str], name: Optional[str] = None) -> Optional[Kind]:
    """Kind of a user or tool message's segment; None for other roles (not captured). ``name``:
    the tool's name (or call id) for tool messages."""
    if role == "user":
        return ("user", None)
    if role == "tool":
        return (str(name or "tool"), "tool")
    return None


class CallCapture:
    """Stores what a finished call computed.

    Args:
        store: where segments and exact prefixes go.
        tokenizer: to align generated ids with the reply text.
        rotator: de-rotates keys to the canonical frame.
        fingerprint: the engine's model fingerprint, stamped on every segment.
        config: ``prefix_cache``, ``capture_messages``, ``min_match_tokens``, the method.
        own_texts: where the agents' own-text KV goes (own-text reuse), or None.
    """

    def __init__(self, store: SegmentStore, tokenizer, rotator: Optional[RopeRotator], fingerprint: str,
                 config: KVCommConfig, own_texts: Optional[OwnTextStore] = None):
        self.store, self.tokenizer, self.rotator = store, tokenizer, rotator
        self.fingerprint, self.config = fingerprint, config
        self.own_texts = own_texts if config.experimental.own_text == "reuse" else None

    def cut(self, kv_at: KVAt, start: int, token_ids: list[int], char_spans: list, text: str, kind: Kind,
            context_ids: list[int] | tuple[int, ...] = ()) -> KVSegment:
        """Prompt positions ``start .. start + len(token_ids)`` as a segment (keys de-rotated by
        ``-start``, computed at ``start``); ``context_ids``: the ids before ``start`` (the KV's
        context)."""
        if self.rotator is None and start:
            raise InvalidRequestError("this model's KV cannot be re-rotated (method='exact_prefix' on a model that "
                                      "re-rotation refuses), so no segment can be kept for other prompts")
        block = kv_at(torch.arange(start, start + len(token_ids))).shifted(self.rotator, -start)
        return KVSegment.create(kind=kind, text=text, token_ids=token_ids, char_spans=char_spans, kv=block,
                                fingerprint=self.fingerprint, context_ids=context_ids[-CONTEXT_TOKENS:],
                                computed_at=start)

    def keep_call(self, plan: CallPlan, agent: str, generated: list[int], reply: str, kv_at: KVAt,
                  anchors=None, layout: Optional[PromptLayout] = None,
                  roles: Optional[list[tuple[Optional[str], Optional[str]]]] = None) -> Optional[SegmentRef]:
        """Everything a finished call leaves for later calls: its exact prefix, own-text KV and
        anchor observations (:meth:`observe`), user/tool messages seen for the first time (given
        ``layout`` and ``roles``) and its reply. Returns the reply's reference, or None.

        Args:
            plan: the call's plan, as the runtime ran it.
            agent: the receiving agent.
            generated: reply ids whose KV the pass holds (the last sampled id has none).
            reply: the reply text those ids decode to.
            kv_at: the pass's KV at prompt-and-reply positions.
            anchors: the KVCOMM anchors to feed (``method="kvcomm"``), or None.
        """
        n = plan.num_prompt
        self.store_prefix(plan, generated, kv_at)
        if not self.keeps_segments:
            return None
        self.observe(plan, agent, kv_at, anchors)
        if layout is not None and roles is not None:
            self.capture_messages(layout, roles, plan, kv_at)
        exact = plan.first_estimated() >= n  # no estimated KV before the reply: it may serve as a version
        return self.capture_reply(n, generated, reply, agent, kv_at, plan.prompt_ids if exact else None)

    @property
    def keeps_segments(self) -> bool:
        """Whether calls keep segments (messages, replies): not under exact prefix only, which
        would never read them."""
        return self.config.method != "exact_prefix"

    def observe(self, plan: CallPlan, agent: str, kv_at: KVAt, anchors=None) -> None:
        """Own-text KV first seen, then (``anchors`` given) the anchors' observations of the pass."""
        bases = self.keep_own_text(plan, agent, kv_at)
        if anchors is not None:
            anchors.observe(agent, plan, lambda start, length: kv_at(torch.arange(start, start + length)),
                            self.rotator, bases)

    def store_prefix(self, plan: CallPlan, generated: list[int], kv_at: KVAt) -> None:
        """Keep the exact KV of the prompt plus reply, up to the first re-rotated token."""
        if not self.config.prefix_cache:
            return
        ids = torch.cat([plan.prompt_ids, torch.tensor(generated, dtype=torch.long)])
        exact = plan.first_rerotated() if plan.runs else ids.numel()
        if exact < self.config.experimental.min_prefix_tokens:
            return
        if self.store.covers(ids[:exact], self.fingerprint):
            return  # the KV is not gathered
        self.store.put_prefix(ids[:exact], kv_at(torch.arange(exact)), self.fingerprint)

    def keep_own_text(self, plan: CallPlan, agent: str, kv_at: KVAt) -> dict[int, KVSegment]:
        """The agent's own-text KV of every piece the call computed: the stored one, else this
        call's (stored now). Returns it by piece start (empty without own-text reuse)."""
        bases: dict[int, KVSegment] = {}
        if self.own_texts is None:
            return bases
        for piece in plan.pieces:
            if piece.reused:
                continue
            kept = self.own_texts.get(agent, piece.key)
            if kept is None and not self.own_texts.frozen:
                kept = self.cut(kv_at, piece.start, list(piece.token_ids), [None] * len(piece.token_ids), "",
                                (agent, "own_text"))
                if not self.own_texts.put(agent, piece.key, kept):
                    kept = None
            if kept is not None:
                bases[piece.start] = kept
        return bases

    def capture_messages(self, layout: PromptLayout, roles: list[tuple[Optional[str], Optional[str]]],
                         plan: CallPlan, kv_at: KVAt) -> None:
        """Store each user/tool message seen for the first time. ``roles``: per message,
        ``(role, tool name)``. A message holding a known segment (e.g. "Agent 1 said: <reply>")
        is not stored again."""
        if not self.config.capture_messages:
            return
        # partly shared: kept; a span holds found texts (their message is not new either); a
        # reference this store could not serve: kept, so that later readers find the text here
        found = {d.message_index for d in plan.decisions
                 if d.found_by != "tokens" and d.reason not in UNSERVED_REFERENCES}
        for index, (role, name) in enumerate(roles):
            kind = message_kind(role, name)
            content = layout.content(index)
            if kind is None or index in found or content is None:
                continue
            if self.store.find_text(content, self.fingerprint) is None:
                self.capture_message(layout, index, kind, kv_at, plan.first_estimated())

    def capture_message(self, layout: PromptLayout, index: int, kind: Kind, kv_at: KVAt,
                        exact_before: Optional[int] = None) -> Optional[SegmentRef]:
        """Store message ``index``'s content KV as a segment of ``kind``. Its context ids are kept
        (it may serve as a version, :mod:`.versions.match`) only when it lies before
        ``exact_before`` (the pass's first token whose KV was estimated; None: exact throughout)."""
        span = layout.content_spans[index]
        if span is None:
            return None
        tokens = layout.tokens_within(*span)
        if len(tokens) < self.config.min_match_tokens:
            return None
        char_spans = [(s - span[0], e - span[0]) for s, e in layout.offsets[tokens.start : tokens.stop]]
        segment = self.cut(kv_at, tokens.start, layout.ids[tokens.start : tokens.stop].tolist(), char_spans,
                           layout.text[span[0] : span[1]], kind,
                           layout.ids[max(0, tokens.start - CONTEXT_TOKENS) : tokens.start].tolist()
                           if exact_before is None or tokens.stop <= exact_before else ())
        return segment.ref if self.store.put(segment) else None

    def capture_reply(self, start: int, generated: list[int], text: str, agent: str, kv_at: KVAt,
                      prompt_ids: Optional[torch.Tensor] = None) -> Optional[SegmentRef]:
        """Store the reply's KV (the ids that map onto its text) as an ``(agent, "assistant")``
        segment; ``prompt_ids``: the ``[start]`` ids it was generated after (its context; None
        where part of the prompt's KV was estimated, so that the reply is no version)."""
        spans = align_ids_to_text(self.tokenizer, generated, text)
        last = max((i for i, span in enumerate(spans) if span is not None), default=-1)
        if last + 1 < self.config.min_match_tokens or not text:
            return None  # too short to ever be reused
        kind = (agent, "assistant")
        same = self.store.find_by_hash(content_hash(text, generated[: last + 1]), self.fingerprint)
        if same is not None and same.ref.kind == kind:
            return same.ref  # the same reply, same ids, same agent: stored once
        context = prompt_ids[-CONTEXT_TOKENS:].tolist() if prompt_ids is not None else ()
        segment = self.cut(kv_at, start, generated[: last + 1], spans[: last + 1], text, kind, context)
        return segment.ref if self.store.put(segment) else None
