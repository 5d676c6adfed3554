"""The KV segment asset and the small JSON-safe reference that travels with messages.

A :class:`KVSegment` holds the KV of one piece of shared text (a reply, a user message, a tool
result, a document) for every layer as a :class:`~.block.KVBlock`, keys in the canonical frame
(de-rotated so its first token sits at position 0). Tensors never leave the engine's store; messages carry a :class:`SegmentRef`.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from .block import KVBlock

__all__ = ["SegmentRef", "KVSegment", "content_hash", "Kind", "CONTEXT_TOKENS", "is_reply"]

#: How many ids before a segment (or an anchor's recorded offsets) are kept to say in which
#: context its KV was computed: the nearest text shapes a token's KV most.
CONTEXT_TOKENS = 64

#: What produced a segment: ``(agent, "assistant")`` for replies, ``("user", None)`` for user
#: text, ``(tool_name, "tool")`` for tool results, ``("document", None)`` for ``add_segment``.
Kind = tuple[str, Optional[str]]


def is_reply(kind: Kind) -> bool:
    """Whether a segment of ``kind`` is an agent's reply (``(agent, "assistant")``)."""
    return kind[1] == "assistant"


def content_hash(text: str, token_ids: tuple[int, ...] | list[int]) -> str:
    """SHA-256 (hex, 32 chars) of a segment's text and token ids: an edited message never matches."""
    digest = hashlib.sha256()
    digest.update(text.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(",".join(map(str, token_ids)).encode("ascii"))
    return digest.hexdigest()[:32]


class SegmentRef(BaseModel):
    """Reference to a KV segment held by an engine's store; JSON-safe, small, immutable.

    Put it in a message as ``{"role": ..., "content": ..., "segment": ref}`` (or its
    ``model_dump()``) to tell the engine where the content came from.
    """

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Unique id of the segment in its store.")
    kind: tuple[str, Optional[str]] = Field(description="Producer and role, see ``Kind``.")
    num_tokens: int = Field(ge=0, description="Token ids the segment holds KV for.")
    text_hash: str = Field(description="Hash of the segment's text and ids (``content_hash``).")
    fingerprint: str = Field(description="Fingerprint of the model and tokenizer that computed the KV.")

    @classmethod
    def coerce(cls, value: "SegmentRef | dict[str, Any]") -> "SegmentRef":
        """Accept a ref or its ``model_dump()`` (as it comes back from JSON graph state)."""
        return value if isinstance(value, cls) else cls.model_validate(value)


@dataclass(eq=False)
class KVSegment:
    """KV of one shared text, in the canonical frame.

    Attributes:
        ref: the reference handed out for it.
        text: the text the KV belongs to.
        token_ids: ``T`` ids, the ones the producer computed KV for.
        char_spans: for each id, its ``(start, end)`` character span in ``text``, or ``None``
            for ids that do not map onto ``text`` exactly (never matched).
        kv: the KV of those ``T`` tokens, post-RoPE keys de-rotated so that token ``i`` sits at
            position ``i``.
        context_ids: the last ids (at most :data:`CONTEXT_TOKENS`) before the segment's first
            token where its KV was computed (empty where nothing preceded it or it is unknown):
            which context the KV belongs to (:mod:`kvcomm_agents.versions.match`).
        computed_at: the prompt position its first token had where its KV was computed (None:
            unknown): how far a later prompt moved it past text it never saw
            (:func:`kvcomm_agents.repairs.moved_past_its_context`).
    """

    ref: SegmentRef
    text: str
    token_ids: tuple[int, ...]
    char_spans: tuple[Optional[tuple[int, int]], ...]
    kv: KVBlock
    context_ids: tuple[int, ...] = ()
    computed_at: Optional[int] = None
    _index: dict[tuple[int, int], int] | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        *,
        kind: Kind,
        text: str,
        token_ids: list[int] | tuple[int, ...],
        char_spans: list[Optional[tuple[int, int]]] | tuple[Optional[tuple[int, int]], ...],
        kv: KVBlock,
        fingerprint: str,
        context_ids: list[int] | tuple[int, ...] = (),
        computed_at: Optional[int] = None,
    ) -> "KVSegment":
        """Build a segment and its reference (a fresh id)."""
        token_ids = tuple(int(t) for t in token_ids)
        if len(char_spans) != len(token_ids):
            raise ValueError("char_spans must give one span (or None) per token id")
        if kv.num_tokens != len(token_ids):
            raise ValueError(f"KV holds {kv.num_tokens} tokens, ids {len(token_ids)}")
        ref = SegmentRef(
            id=uuid.uuid4().hex,
            kind=kind,
            num_tokens=len(token_ids),
            text_hash=content_hash(text, token_ids),
            fingerprint=fingerprint,
        )
        context = tuple(int(t) for t in context_ids)[-CONTEXT_TOKENS:] if CONTEXT_TOKENS else ()
        return cls(ref, text, token_ids, tuple(char_spans), kv, context,
                   None if computed_at is None else int(computed_at))

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the model that computed the KV (as on every store entry)."""
        return self.ref.fingerprint

    def ids_tensor(self) -> torch.Tensor:
        """``[T]`` int64 (CPU): the ids the KV is for (as on every store entry)."""
        return torch.tensor(self.token_ids, dtype=torch.long)

    @property
    def nbytes(self) -> int:
        """Bytes held by the KV tensors."""
        return self.kv.nbytes

    def index_of(self, char_start: int, token_id: int) -> int | None:
        """Position of the token with this id starting at ``char_start`` of ``text``, if any."""
        if self._index is None:
            self._index = {}
            for i, (span, tid) in enumerate(zip(self.char_spans, self.token_ids)):
                if span is not None:
                    self._index.setdefault((span[0], tid), i)
        return self._index.get((char_start, token_id))
