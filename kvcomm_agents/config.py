"""``KVCommConfig``: every setting of the engine in one validated pydantic model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KVCommConfig"]


class KVCommConfig(BaseModel):
    """Settings of a :class:`~kvcomm_agents.KVCommEngine`.

    Every field says *why* it exists. The model is frozen: build a new one (``config.model_copy(
    update={...})``) to change a setting.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reuse: bool = Field(
        default=True,
        description=(
            "Master switch. False makes every call plain dense prefill (the engine is then "
            "exactly transformers, token for token) and stores no KV. Use it for models that "
            "cannot be re-rotated, or as the baseline in measurements."
        ),
    )
    min_match_tokens: int = Field(
        default=8,
        ge=1,
        description=(
            "Shortest run of a shared segment's token ids that is reused. Shorter runs are "
            "computed in context (decision reason 'too_short' or 'stale'): re-rotating a few "
            "tokens saves little and their KV depends most on the surrounding text."
        ),
    )
    prefix_cache: bool = Field(
        default=True,
        description=(
            "Reuse, exactly, the longest prefix of a prompt that an earlier prompt (plus its reply) "
            "already computed: a second debate round, a tool loop, a re-sent history."
        ),
    )
    min_prefix_tokens: int = Field(
        default=4,
        ge=1,
        description="Shortest exact prefix worth keeping in the store after a call.",
    )
    capture_messages: bool = Field(
        default=True,
        description=(
            "Package the KV of every user and tool message, cut from the first prompt that "
            "contained it, as a segment that later prompts can reuse."
        ),
    )
    store_max_bytes: int = Field(
        default=2 * 1024**3,
        ge=0,
        description=(
            "Byte budget of the segment store (segments and exact prefixes together). The least "
            "recently used entries are evicted beyond it, never one that a running call uses. "
            "Without a budget, per-call KV grows without bound over a dataset."
        ),
    )
    offsets: Literal["none", "mean"] = Field(
        default="none",
        description=(
            "Context correction added to reused segments above layer 0. 'none': re-rotation only "
            "(positions exact, context not corrected). 'mean': KVCOMM-style offsets learned online, "
            "the running mean of (real - base) KV per receiver agent and segment kind, in the "
            "canonical frame; segments of a kind a receiver has seen fewer than min_anchors times "
            "are prefilled densely (from there on) to record them."
        ),
    )
    min_anchors: int = Field(
        default=2,
        ge=1,
        description=(
            "With offsets='mean': observations of a (receiver, kind) needed before its segments "
            "are reused; before that they are prefilled, which keeps them exact and records them. "
            "The paper's gate also treats fewer than two anchors as 'new anchor'."
        ),
    )
    anchor_max_bytes: int = Field(
        default=512 * 1024**2,
        ge=0,
        description="Byte budget of all learned offsets; least recently used pools go beyond it.",
    )
    verify_rope: bool = Field(
        default=True,
        description=(
            "Run the numerical re-rotation self-check at load. It catches interleaved or partial "
            "rotary dimensions and attention scaling that a config check misses; keep it on."
        ),
    )
