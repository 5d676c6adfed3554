"""What a call returns: the reply, its segment reference and typed statistics."""

from __future__ import annotations

from typing import Iterable, Literal, Optional

from pydantic import BaseModel, Field, model_validator

from .kv.segments import SegmentRef
from .plan import SegmentDecision

__all__ = ["CallStats", "ChatResult", "ForwardedTokens", "ReuseSummary"]


class ForwardedTokens(BaseModel):
    """Query tokens one call pushed through the model, by purpose (:mod:`kvcomm_agents.forwards`):
    what the call cost in compute, wherever in the call it ran."""

    prompt: int = Field(default=0, description="The call's prefill: its computed prompt tokens (and a plan "
                        "hook's extra pass, if any).")
    decode: int = Field(default=0, description="Reply tokens fed back (decode steps, or a teacher-forced pass).")
    copies: int = Field(default=0, description="Copies of this call's reply and shared prompt text computed in "
                        "readers' framing, during the decode or after it.")
    audit: int = Field(default=0, description=(
        "A dense audit's prefill and flipped pass, a re-rotation check's prefill, a short first sample's two."))

    @property
    def total(self) -> int:
        return self.prompt + self.decode + self.copies + self.audit


class CallStats(BaseModel):
    """Measurements of one ``chat`` call. ``reused_tokens + computed_tokens == prompt_tokens``."""

    agent: str
    prompt_tokens: int = Field(description="Tokens of the rendered prompt.")
    reused_tokens: int = Field(description="Prompt tokens whose KV came from the store.")
    computed_tokens: int = Field(description="Prompt tokens the model computed in this call.")
    prefix_tokens: int = Field(description="Of the reused tokens, those from an exact prefix.")
    generated_tokens: int = 0
    batched_steps: int = Field(default=0, description=(
        "Of the decode steps, those run in one forward with other calls' (batched_decode: calls answering at once)."))
    drafted_tokens: int = Field(default=0, description=(
        "Draft ids fed with the decode steps, looked up in the call's own ids (draft_tokens); in forwarded.decode."))
    accepted_tokens: int = Field(default=0, description=(
        "Of the draft ids, those the reply kept: generated tokens that cost no decode step of their own."))
    ttft_s: float = Field(description="From entering chat to the first generated token id.")
    align_s: float = Field(description="Re-rotation, offsets and cache assembly.")
    plan_s: float = Field(default=0.0, description=(
        "Rendering the prompt and planning reuse, with what runs before the plan: copies from calls in "
        "flight, and an engine's short first re-rotation sample (its ids in forwarded.audit)."))
    prefill_s: float = Field(default=0.0, description="The prefill forward pass alone.")
    hook_s: float = Field(default=0.0, description="The engine's plan hook, if any (benchmark baselines).")
    recomputed_tokens: int = Field(
        default=0, description="Re-rotated tokens a plan hook handed back to the prefill; counted as computed."
    )
    total_s: float = 0.0
    mode: Literal["dense", "prefix", "reuse"] = Field(
        description="dense: full prefill; prefix: exact prefix only; reuse: re-rotated segments."
    )
    dense_reason: Optional[str] = Field(
        default=None, description="Why nothing was reused (reuse_off, nothing_to_reuse, ...)."
    )
    decisions: list[SegmentDecision] = Field(default_factory=list)
    opted_out: bool = Field(default=False, description="Reuse switched off for this call or agent.")
    own_text_tokens: int = Field(default=0, description="Of the reused tokens, the agent's own text (own-text reuse).")
    reused_spans: list[tuple[int, int]] = Field(
        default_factory=list,
        description="Where the reused tokens sit: ascending [start, end) prompt spans (exact prefix, reused runs, "
                    "own text; recomputed positions left out). Empty where the runtime does not report it.")
    framed_versions: int = Field(
        default=0, description="Versions recorded after the reply: copies of this call's reply in its readers' "
        "framing (reply_copies) and of its shared prompt text after later readers' prefixes "
        "(text_copies), per message segment.")
    framed_s: float = Field(default=0.0, description="Seconds spent after the reply feeding what the copies still "
                            "lacked and recording them (in total_s, not ttft_s).")
    anchors_consulted: int = Field(default=0, description="Anchors the gate consulted, over all segments.")
    anchor_bytes: int = Field(default=0, description="Bytes held by all anchor pools after the call.")
    audit_kl: Optional[float] = Field(
        default=None, description="With audit_every: first-token KL(dense || this call) in nats, if audited."
    )
    forwarded: ForwardedTokens = Field(
        default_factory=ForwardedTokens,
        description="Every token the call forwarded through the model, by purpose (the call's compute).")

    @model_validator(mode="after")
    def _tokens_add_up(self) -> "CallStats":
        if self.reused_tokens + self.computed_tokens != self.prompt_tokens:
            raise ValueError("reused_tokens + computed_tokens must equal prompt_tokens")
        return self

    @property
    def reused_share(self) -> float:
        """Share of the prompt's tokens served from the store."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def shared_decisions(self) -> list[SegmentDecision]:
        """Decisions on shared segments outside the exact prefix (the ones reuse can miss)."""
        return [d for d in self.decisions if d.reason != "exact_prefix"]

    @property
    def fully_reused(self) -> bool:
        """No shared segment of this call was prefilled (the paper's agent-level reuse)."""
        return all(d.status == "reused" for d in self.shared_decisions)


class ReuseSummary(BaseModel):
    """The agent-level reuse rate and the token share over a set of calls.

    Reuse rate: among calls with at least one shared segment found and reuse allowed, the share
    in which no shared segment was prefilled (template text and edge tokens computed in context
    do not count against it). Opted-out calls are counted apart.
    """

    calls: int
    eligible: int = Field(description="Calls with a shared segment found and reuse allowed.")
    fully_reused: int
    opted_out: int
    reuse_rate: Optional[float] = Field(description="fully_reused / eligible (None if no call was eligible).")
    token_share: float = Field(description="Reused prompt tokens / prompt tokens, over calls not opted out.")

    @classmethod
    def of(cls, stats: Iterable[CallStats]) -> "ReuseSummary":
        stats = list(stats)
        allowed = [s for s in stats if not s.opted_out]
        eligible = [s for s in allowed if s.shared_decisions]
        full = sum(s.fully_reused for s in eligible)
        prompt = sum(s.prompt_tokens for s in allowed)
        return cls(
            calls=len(stats), eligible=len(eligible), fully_reused=full, opted_out=len(stats) - len(allowed),
            reuse_rate=full / len(eligible) if eligible else None,
            token_share=sum(s.reused_tokens for s in allowed) / prompt if prompt else 0.0,
        )


class ChatResult(BaseModel):
    """The reply of one agent call."""

    text: str
    token_ids: list[int] = Field(description="Generated ids only (eos included, as generate does).")
    segment: Optional[SegmentRef] = Field(description="Reference to the reply's KV, or None.")
    finish_reason: Literal["stop", "length", "stop_string", "forced"] = Field(
        description="'forced' for ``engine.replay`` (the reply was given)."
    )
    stats: CallStats
