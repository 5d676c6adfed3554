"""``KVCommConfig``: every setting of the engine in one validated pydantic model."""

from __future__ import annotations

from typing import Literal, Optional

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
    segment_reuse: bool = Field(
        default=True,
        description=(
            "Re-rotate shared segments found anywhere in a prompt. False keeps only exact prefix "
            "caching (what vLLM and SGLang give): faithful, but it misses every shared text that "
            "does not start the prompt (decision reason 'exact_only')."
        ),
    )
    recompute_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description=(
            "CacheBlend-style selective recompute (arXiv 2405.16444): after re-rotation, run the "
            "first recompute_probe_layers layers densely, and recompute in the prefill forward this "
            "share of the re-rotated tokens whose KV deviates most there. 0 = off. The probe costs "
            "time to first token; docs/benchmarks.md compares it with KVCOMM's offsets."
        ),
    )
    recompute_probe_layers: int = Field(
        default=2, ge=2,
        description="Layers run to rank the deviation (measured at the last; layer 0 is exact after re-rotation).",
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
    offsets: Literal["none", "mean", "weighted"] = Field(
        default="mean",
        description=(
            "Context correction added to reused segments above layer 0 (KVCOMM's anchors). "
            "'none': re-rotation only (positions exact, context not corrected, every found segment "
            "reused). 'mean': the average offset (real - base KV) of the anchors the gate "
            "consulted, per token, in the canonical frame. 'weighted': the paper's similarity "
            "weights over those anchors. With either, a segment the gate judges new is prefilled "
            "(densely from there on) and becomes an anchor. Default 'mean': on 40 GSM8K debates it "
            "cut first-token KL against dense 3x compared with 'none', as much as 'weighted' did, "
            "at less cost (docs/fidelity.md)."
        ),
    )
    template: Literal["in_context", "reuse"] = Field(
        default="in_context",
        description=(
            "The receiver's own text after a reused segment (role headers, connective text). "
            "'in_context': computed in the prefill forward (exact given the reused KV before it). "
            "'reuse': its KV from the agent's earlier calls, re-rotated, plus the anchors' estimated "
            "prefix offsets (zero with offsets='none'); pieces without an estimate are computed."
        ),
    )
    gate: Literal["entropy", "error"] = Field(
        default="entropy",
        description=(
            "Shareability gate. 'entropy' (the paper): p = softmax(-||V_new - V_i||) over the "
            "consulted anchors, reuse if H(p) <= gamma * log2 N. 'error': reuse if the measured "
            "relative KV error of this receiver's estimates for the kind (checked against dense "
            "each time an anchor is recorded) is at most max_error."
        ),
    )
    gamma: float = Field(default=0.3, ge=0.0, le=1.0, description="Entropy gate threshold (paper: 0.3).")
    max_error: float = Field(
        default=0.5, gt=0.0,
        description="Error gate threshold: ||estimate - real|| / ||real|| of the offsets, keys and values together.",
    )
    offset_max_error: Optional[float] = Field(
        default=None, gt=0.0,
        description=(
            "If set, a receiver's offsets for a segment kind are applied only while their measured "
            "relative error (as for gate='error') is below this; above it the segment is still "
            "reused, re-rotated without offsets (an estimate worse than none is not added)."
        ),
    )
    min_anchors: int = Field(
        default=2,
        ge=1,
        description=(
            "Consulted anchors needed before a segment may be reused; fewer means 'new anchor' "
            "(the paper uses two; the entropy gate needs at least two)."
        ),
    )
    max_anchors: int = Field(default=20, ge=1, description="Anchors per segment kind (paper: 20).")
    eviction_window: int = Field(
        default=5, ge=1,
        description="When a pool is full, the least-activated of this many oldest anchors is replaced.",
    )
    activation_top_p: float = Field(
        default=0.9, gt=0.0, le=1.0,
        description="A reuse decision credits the nearest anchors holding this share of the weight.",
    )
    anchor_temperature: float = Field(default=1.0, gt=0.0, description="Softmax temperature of the anchor weights.")
    anchor_max_bytes: int = Field(
        default=1024**3,
        ge=0,
        description="Byte budget of all anchor pools together; anchors are evicted beyond it.",
    )
    template_max_bytes: int = Field(
        default=64 * 1024**2, ge=0, description="Byte budget of the agents' template KV (template='reuse')."
    )
    dense_agents: frozenset[str] = Field(
        default=frozenset(),
        description=(
            "Agents that never reuse (judges, aggregators: reuse is known to perturb their "
            "decisions, arXiv 2601.08343). Their calls are dense and still share their KV."
        ),
    )
    audit_every: int = Field(
        default=0,
        ge=0,
        description=(
            "Also prefill every N-th reused call densely and record the first-token KL(dense || "
            "reuse) in its stats (0 = off), so a deployment can watch its own drift. With KVCOMM "
            "offsets the audit's exact KV is also recorded as anchors, which keeps the error "
            "gate's measurement fresh while calls are being reused."
        ),
    )
    verify_rope: bool = Field(
        default=True,
        description=(
            "Run the numerical re-rotation self-check at load. It catches interleaved or partial "
            "rotary dimensions and attention scaling that a config check misses; keep it on."
        ),
    )
