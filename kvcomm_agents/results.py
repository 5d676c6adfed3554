"""What a call returns: the reply, its segment reference and typed statistics."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .cache.segments import SegmentRef
from .plan import SegmentDecision

__all__ = ["CallStats", "ChatResult"]


class CallStats(BaseModel):
    """Measurements of one ``chat`` call. ``reused_tokens + computed_tokens == prompt_tokens``."""

    agent: str
    prompt_tokens: int = Field(description="Tokens of the rendered prompt.")
    reused_tokens: int = Field(description="Prompt tokens whose KV came from the store.")
    computed_tokens: int = Field(description="Prompt tokens the model computed in this call.")
    prefix_tokens: int = Field(description="Of the reused tokens, those from an exact prefix.")
    generated_tokens: int = 0
    ttft_s: float = Field(description="From entering chat to the first generated token id.")
    align_s: float = Field(description="Re-rotation, offsets and cache assembly.")
    plan_s: float = Field(default=0.0, description="Rendering the prompt and planning reuse.")
    prefill_s: float = Field(default=0.0, description="The prefill forward pass alone.")
    total_s: float = 0.0
    mode: Literal["dense", "prefix", "reuse"] = Field(
        description="dense: full prefill; prefix: exact prefix only; reuse: re-rotated segments."
    )
    dense_reason: Optional[str] = Field(
        default=None, description="Why nothing was reused (reuse_off, nothing_to_reuse, ...)."
    )
    decisions: list[SegmentDecision] = Field(default_factory=list)

    @model_validator(mode="after")
    def _tokens_add_up(self) -> "CallStats":
        if self.reused_tokens + self.computed_tokens != self.prompt_tokens:
            raise ValueError("reused_tokens + computed_tokens must equal prompt_tokens")
        return self

    @property
    def reused_share(self) -> float:
        """Share of the prompt's tokens served from the store."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class ChatResult(BaseModel):
    """The reply of one agent call."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    text: str
    token_ids: list[int] = Field(description="Generated ids only (eos included, as generate does).")
    segment: Optional[SegmentRef] = Field(description="Reference to the reply's KV, or None.")
    finish_reason: Literal["stop", "length", "stop_string", "forced"]
    stats: CallStats
    forced_greedy_tokens: Optional[int] = Field(
        default=None,
        description=(
            "With force_reply_ids: how many leading forced ids greedy decoding would also have "
            "produced (teacher forcing), so k-token agreement needs no second run."
        ),
    )
    first_token_logits: Optional[Any] = Field(
        default=None, exclude=True, repr=False,
        description="``[vocab]`` float32 logits of the last prompt token, with ``return_logits=True``.",
    )
