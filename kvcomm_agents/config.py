"""``KVCommConfig``: the settings a user of the engine sets, validated, each saying why it exists.

What reproduces the paper's variants (its similarity-weighted estimate, its prefix offsets) and
the anchor pools' details live in :class:`ExperimentalSettings`. Ideas that lost are not settings:
their figures are in ``benchmarks/LAB.md``.
"""

from __future__ import annotations

import os
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .config_names import MOVED, RENAMED, refuse_old_names

__all__ = ["KVCommConfig", "ExperimentalSettings", "Method"]


#: How shared text is reused (``KVCommConfig.method``).
Method = Literal["kvcomm", "rerotate", "exact_prefix", "dense"]


class ExperimentalSettings(BaseModel):
    """The paper's variants and the anchor pools' details. Defaults are the measured best; change
    them to reproduce the paper (``estimator="weighted"``, with ``KVCommConfig(kl_budget=None,
    recorded_versions=False, reply_copies=False, text_copies=False, recompute_head=0,
    recompute_cut_head=0, recompute_tail=0, recompute_short_runs=0, recompute_last_run=0)``) or to
    experiment, not to tune a deployment."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        return refuse_old_names(data, MOVED, "experimental.{name} is no longer an experimental setting: use {new}")

    estimator: Literal["mean", "weighted"] = Field(default="mean", description=(
        "KVCOMM offset estimate from the consulted anchors. 'mean': their plain average, per token. 'weighted': "
        "the paper's similarity weights. On 40 GSM8K debates both cut first-token KL against dense 3x compared "
        "with re-rotation only; 'mean' costs less (docs/fidelity.md)."))
    own_text: Literal["in_context", "reuse"] = Field(
        default="in_context",
        description=(
            "The receiver's own text after a reused segment (role headers, connective text). "
            "'in_context': computed in the prefill forward (exact given the reused KV before it). "
            "'reuse': its KV from the agent's earlier calls, re-rotated, plus the anchors' "
            "estimated own-text offsets (the paper's prefix offsets); pieces without an estimate "
            "are computed."
        ),
    )
    own_text_max_bytes: int = Field(default=64 * 1024**2, ge=0,
                                    description="Byte budget of the agents' own-text KV (own_text='reuse').")
    min_anchors: int = Field(
        default=2, ge=1,
        description="Consulted anchors needed before a segment may be reused (the paper: two; the gate needs two).",
    )
    eviction_window: int = Field(default=5, ge=1, description=(
        "When a pool is full, the least-activated of this many oldest anchors is replaced."))
    activation_top_p: float = Field(
        default=0.9, gt=0.0, le=1.0,
        description="A reuse decision credits the nearest anchors holding this share of the weight.",
    )
    anchor_temperature: float = Field(default=1.0, gt=0.0, description="Softmax temperature of the 'weighted' estimator.")
    min_prefix_tokens: int = Field(default=4, ge=1,
                                   description="Shortest exact prefix worth keeping in the store after a call.")
    rerotation_trust: Literal["clear_sample", "one_sample", "audited"] = Field(
        default="one_sample",
        description=(
            "The re-rotation samples (measured_rerotation) on which a segment the gate would "
            "compute is served re-rotated: 'one_sample' within the KL budget; 'clear_sample' two, "
            "or one within a quarter of it; 'audited' none, the first calls so served audited "
            "(benchmarks/LAB.md, 'Re-rotation trusted on one sample')."
        ),
    )
    rerotate_replies: bool = Field(default=False, description=(
        "Serve a reply no version fits re-rotated alone where re-rotation was measured within the budget, "
        "as other texts are. Off: estimated offsets within the budget, else computed (re-rotated replies "
        "read 0.003-0.5 nats; benchmarks/LAB.md, 'Replies never re-rotated alone')."))
    short_rerotation_sample: bool = Field(default=True, description=(
        "Before the model's first re-rotation sample, measure re-rotation on the reader's prompt with "
        "its long reused runs cut to 128 ids; within a quarter of the KL budget, serve it re-rotated."))
    measured_draft_lengths: bool = Field(default=True, description=(
        "Feed a longer draft (as far as the lookup found ids, up to draft_tokens) where the engine measured a "
        "forward of more ids cheaper than the adapted length's (kvcomm_agents.step_costs): it never keeps fewer."))
    audit_new_readers: bool = Field(
        default=False,
        description=(
            "Audit a receiver's first call served re-rotated on other receivers' samples alone "
            "(an aggregator unlike the pool gets a sample after one call): one dense prefill per "
            "new receiver; lost graph time at equal KL on (g) and (j) (benchmarks/LAB.md)."
        ),
    )


class KVCommConfig(BaseModel):
    """Settings of a :class:`~kvcomm_agents.KVCommEngine`.

    The model is frozen: build a new one (``config.model_copy(update={...})``) to change a
    setting. ``docs/api.md`` lists every field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return refuse_old_names(data, RENAMED, "{name} was renamed: use KVCommConfig({new}=...)")

    @field_validator("remember_measurements", mode="before")
    @classmethod
    def _folder_or_switch(cls, value):
        """A path as its string; "true" / "false" / "1" / "0" as the switch, not a folder."""
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        if isinstance(value, str):
            switch = {"true": True, "1": True, "false": False, "0": False}.get(value.strip().lower())
            if switch is not None or value.strip():
                return value if switch is None else switch
            raise ValueError("remember_measurements: True, False or a folder, not an empty string")
        return value

    method: Method = Field(
        default="kvcomm",
        description=(
            "How shared text is reused. 'kvcomm': re-rotated and corrected with offsets learned from anchors; a "
            "segment the gate judges new is prefilled and becomes an anchor; re-rotation alone is served where "
            "measured within kl_budget (the default). 'rerotate': every shared segment found is re-rotated to its "
            "new position, no correction and nothing measured (as fast as the default on the benchmark's graphs, "
            "with the same computed heads, tails and short runs; nothing checks its fidelity on yours). "
            "'exact_prefix': only the "
            "longest prefix an earlier call computed is reused, exactly (what vLLM and SGLang give; also on models "
            "re-rotation refuses, but dynamic NTK). 'dense': no reuse at all (no KV kept; plain_transformers() also "
            "steps one id at a time, alone); also the way to run any other model."
        ),
    )
    min_match_tokens: int = Field(default=8, ge=1, description=(
        "Shortest run of a shared segment's token ids that is reused. Shorter runs are computed in context "
        "(reason 'too_short' or 'stale'): a few re-rotated ids save little and depend most on their context."))
    prefix_cache: bool = Field(default=True, description=(
        "Reuse, exactly, the longest prefix of a prompt that an earlier prompt (plus its reply) already "
        "computed: a second debate round, a tool loop, a re-sent history."))
    dense_when_cheaper: bool = Field(
        default=True,
        description=(
            "Compute the whole prompt in one causal forward (dense_reason 'little_reuse', the decisions that "
            "reused saying so) when the plan reuses too little of it to pay for the masked forward that reused KV"
            " needs (kvcomm_agents.prefill_cost: a 2,048-token prompt reusing 2% of it costs 1.14x dense on a "
            "CPU). CPU only; False: always reuse what was planned."
        ),
    )
    batched_decode: bool = Field(default=True, description=(
        "Run the decode steps of calls answering at once (a LangGraph fan-out's branches) in one forward, "
        "each call's KV left-padded into a batch (kvcomm_agents.batched_decode): each step streams the "
        "weights once for all. Rows agree with a lone call's up to float rounding; False: every call steps "
        "alone (with draft_recent_replies=0, replies that depend on the request alone, bit for bit)."))
    kv_in_place: bool = Field(default=True, description=(
        "Decode steps write their KV into buffers with room to grow (kvcomm_agents.engines.growing_cache) "
        "instead of copying every layer's whole cache once per step, as transformers' DynamicCache does "
        "(CPU, 300-2,000 cached: a decode forward 0.93-1.01x the time). False: concatenate."))
    weight_layout: Literal["measured", "transposed", "keep"] = Field(default="measured", description=(
        "How the model's linear weights lie in memory on a CPU (the same values; kvcomm_agents.engines."
        "weight_layout): 'measured' times a decode forward with them as loaded and transposed when the engine "
        "is built and keeps the faster (2 cores of an AMD EPYC, MKL: 1 id 40.4 -> 33.8 ms per forward); "
        "'transposed'; 'keep': touch nothing. Changes the model in place; the first engine on it decides. A "
        "measured choice is remembered for the next process where remember_measurements is on."))
    draft_tokens: int = Field(default=8, ge=0, description=(
        "Most ids a decode step drafts from the call's own ids (what followed the reply's last ids where they"
        " occurred before: agents quote the texts passed to them) and checks in the same forward, kept while "
        "the model picks them (kvcomm_agents.drafting): the same reply up to float rounding, in fewer steps. "
        "The length adapts per call; a call decoding while others do steps in their batch instead. 0: one id "
        "per step."))
    draft_recent_replies: int = Field(default=6, ge=0, description=(
        "Replies (the engine's last ones, any request's) a draft n-gram is looked up in where the call's own "
        "ids do not hold it: siblings answering one task word their replies alike. Output changes at most by "
        "float rounding, but a step's time and stats.accepted_tokens tell whether another request's reply "
        "matched a guess: 0 where tenants share an engine (kvcomm_agents.drafting)."))
    capture_messages: bool = Field(
        default=True,
        description=(
            "Keep the KV of every user and tool message, cut from the first prompt that contained it, as a "
            "segment later prompts can reuse."
        ),
    )
    store_max_bytes: Optional[int] = Field(
        default=None, ge=0,
        description=(
            "Byte budget of the segment store (segments and exact prefixes together). The least recently used "
            "entries are evicted beyond it, never one that a running call uses. None: 20% of the memory "
            "available on the model's device at engine start (2 GiB where it cannot be read)."
        ),
    )
    gamma: float = Field(
        default=0.3, ge=0.0, le=1.0,
        description=(
            "KVCOMM's gate threshold (the paper's 0.3): a segment is reused when the entropy of "
            "its anchor weights is at most gamma * log2 N. Higher reuses more, drifts more "
            "(benchmarks/LAB.md, gamma sweep)."
        ),
    )
    max_anchors: int = Field(default=20, ge=1, description="Anchors per segment kind (the paper: 20).")
    anchor_max_bytes: Optional[int] = Field(
        default=None, ge=0,
        description=(
            "Byte budget of all anchor pools together; anchors are evicted beyond it. None: 10% "
            "of the memory available on the model's device at engine start (1 GiB where it "
            "cannot be read)."
        ),
    )
    dense_agents: frozenset[str] = Field(
        default=frozenset(),
        description=(
            "Agents that never reuse (judges, aggregators: reuse is known to perturb their "
            "decisions, arXiv 2601.08343). Their calls are dense and still share their KV."
        ),
    )
    audit_every: int = Field(
        default=16, ge=0,
        description=(
            "Prefill every N-th reused call densely as well (at most: audit_share may hold it back), after its "
            "reply, and record the first-token KL(dense || reuse) in its stats (0 = off: no audits, and KVCOMM's "
            "offsets are never checked). With method='kvcomm' the audit's exact KV is recorded in the anchors, "
            "one more reuse prefill flips one segment kind's offsets, and a kind whose offsets measured worse "
            "than none for a receiver is served re-rotated only (gate record offsets='off'); calls with a kind "
            "sampled fewer than twice for their receiver are audited too, one in 4 of that receiver's reused "
            "calls (docs/anchors.md, 'Offsets checked against dense')."
        ),
    )
    audit_share: Optional[float] = Field(
        default=0.05, gt=0.0, le=1.0,
        description=(
            "Caps the every-N-th audits (audit_every) at this share of the prompt ids reuse spared: a due audit "
            "waits until the ids the engine's reused calls did not prefill, times this share, cover every id "
            "audits have forwarded, its own included (a dense prefill of the prompt, plus the flipped pass with "
            "method='kvcomm'), then runs on the first call where it fits. Warm-up audits and probes of the KL "
            "budget are not held back (the offsets' gate needs them) but are charged to the same account, so they"
            " may go over it and the every-N-th ones then wait. Default 0.05: a twentieth of the prefill reuse "
            "spared. None: a fixed cadence, every audit_every-th reused call."
        ),
    )
    kl_budget: Optional[float] = Field(
        default=0.015, gt=0.0,
        description=(
            "Fidelity budget of KVCOMM's estimated offsets (method='kvcomm'; off with audit_every=0, where "
            "nothing measures it). A receiver reuses a segment kind with estimated offsets only once its audits "
            "measured a mean first-token KL(dense || served) within the budget; until then, and whenever they "
            "measure above it, that kind's segments are prefilled for that receiver (reason 'over_kl_budget', "
            "recorded as anchors) but for one decision in 4 (a probe), reused and always audited to gather the "
            "measure. Versions of a segment computed after the same text are not estimates and are always reused."
            " Default 0.015: on the quick benchmark KL 0.0319 -> 0.0032 on (b) for 3.08x -> 2.11x TTFT "
            "(benchmarks/LAB.md, 'Recorded versions and a KL budget'). None: no budget (the gate alone decides)."
        ),
    )
    recompute_head: int = Field(
        default=16, ge=0,
        description=(
            "Compute the first N tokens of every reused run in context instead of reusing them (cheap fidelity: "
            "the tokens right after a change of context deviate most), so a matched run shorter than N is "
            "computed whole: a few re-rotated ids inside an otherwise exact prompt save little, end the prompt's "
            "exact prefix for later calls and cost a masked forward. Chosen against 4 on the quick benchmark's "
            "development range (benchmarks/LAB.md, 'A 16-token head': whole graph (a) 0.92x -> 1.35x, (h) 0.77x "
            "-> 1.01x dense). Not where a framed copy of the segment (computed in this reader's framing) fits the"
            " text before the run's first token: there the context did not change. 0: off."
        ),
    )
    recompute_cut_head: int = Field(default=64, ge=0, description=(
        "Where recompute_head applies, the head of a run that starts 64 or more ids inside the text whose KV "
        "it takes (a page's later lines, an earlier prompt's middle): that KV followed the text's own earlier"
        " ids, absent here, and deviates further in. Held-out shapes: readers' KL 0.0146 -> 0.0118 (windows "
        "of a page), 0.0083 -> 0.0054 (a tool's page), 3-10% more tokens; the ten graphs +0-3% "
        "(benchmarks/LAB.md, 'A run cut inside its text'). 0: recompute_head's."))
    recompute_tail: int = Field(
        default=8, ge=0,
        description=(
            "Compute the last N tokens of a reused run in context too where the run ends at most 64 ids before "
            "the prompt's end (repairs.TAIL_REACH), as recompute_head does its first (not where a version computed"
            " in this reader's framing fits, nor with own-text reuse): the reader's own text and first token "
            "attend most to the text right before them. Development range, held-out formats (j), a task pasted "
            "after the notes right before the reader's instruction: readers' KL 0.0140 / 0.0335 / 0.0278 -> "
            "0.0022 / 0.0038 / 0.0072, 0-5% more tokens per graph on (a)-(j) (benchmarks/LAB.md, 'The end of a "
            "run before the reader's text'). 0: off."
        ),
    )
    recompute_last_run: int = Field(
        default=256, ge=0,
        description=(
            "Compute whole, in context, a reused run of at most N ids ending within 64 ids of the prompt's end that "
            "follows over 64 more ids than its KV was computed after (kvcomm_agents.repairs), where recompute_head "
            "or recompute_short_runs apply: a task pasted last, after a document it never saw, carries the reader's"
            " first token (benchmarks/LAB.md, 'The run right before the reader's text'). 0: off."
        ),
    )
    recompute_short_runs: int = Field(
        default=64, ge=0,
        description=(
            "Compute in context, whole, every reused run of at most N tokens that no framed copy fitting the text"
            " before it serves (a reply, note or question); longer runs keep only their head (recompute_head). "
            "Re-rotated short runs right before a reader's own text carried nearly all of re-rotation's deviation"
            " on the development range: re-rotation only's readers' KL 0.0144 -> 0.0001 on (h), 0.0364 -> 0.0026 "
            "on (c), 0.0234 -> 0.0006 on (g), for 10-32% more tokens per graph; the default's graph 0.98x -> 1.14x"
            " dense on (c) (benchmarks/LAB.md, 'Short runs computed whole'). 0: only runs within recompute_head."
        ),
    )
    recorded_versions: bool = Field(
        default=True,
        description=(
            "Before the gate (and after a new anchor), reuse the version of a segment computed "
            "after the same text as this prompt has before it (its whole 64-id context window "
            "matches), base first: its own KV as it is, or the offsets a receiver recorded for this very "
            "segment (method='kvcomm'; kvcomm_agents.versions.match). False: only the "
            "receiver's own recorded offsets and the gate's estimates (kept for comparison)."
        ),
    )
    measured_rerotation: bool = Field(
        default=True,
        description=(
            "Measure each receiver's re-rotation on its calls without estimates (one reuse prefill after the "
            "reply, charged to the call; kvcomm_agents.rerotation_check) and, once the samples (every receiver's,"
            " one enough under experimental.rerotation_trust's default; the receiver's own, where it has any, "
            "within the budget too) put it within kl_budget, serve re-rotated what the gate would compute (gate "
            "offsets 'rerotated'; replies only with experimental.rerotate_replies), with no text copy for that "
            "reader (method='kvcomm' with a KL budget and audits on). False: what the gate refuses is computed."
        ),
    )
    remember_measurements: Union[bool, str] = Field(
        default_factory=lambda: os.environ.get("KVCOMM_REMEMBER_MEASUREMENTS", "1").lower() not in ("0", "false"),
        description=(
            "Carry measured_rerotation's samples from one engine to the next on the same model and "
            "measuring settings (kvcomm_agents.anchors.remembered): a restarted process serves its "
            "first graph re-rotated where an earlier one measured that within kl_budget; and the "
            "measured weight_layout, per CPU, torch and weight shapes. True: in "
            "$KVCOMM_CACHE_DIR/measurements (else the user cache); a folder: there; False: off "
            "(the default under KVCOMM_REMEMBER_MEASUREMENTS=0)."
        ),
    )
    reply_copies: bool = Field(
        default=False,
        description=(
            "Compute each reply a second time as its readers will see it (after the text they put before it, "
            "learned from earlier calls), fed with the sender's decode steps and recorded as a version the first "
            "reader reuses (method='kvcomm' with recorded_versions; kvcomm_agents.framing.replies). Off by "
            "default: on one device a copy computes in the sender's turn what its reader would, so the reader's "
            "first token comes sooner and the graph ends later (one H200, the paper's shape: 1.57x dense with, "
            "1.68x without; benchmarks/LAB.md, 'Copies off by default'). True: readers' first token first."
        ),
    )
    text_copies: bool = Field(
        default=False,
        description=(
            "Compute shared prompt text (a task, documents) a second time for each later reader, after that "
            "reader's own prefix (learned from earlier calls), recorded as a version the later readers reuse "
            "(method='kvcomm' with recorded_versions; kvcomm_agents.framing.texts): on CUDA riding on the first "
            "reader's decode steps (up to 256 ids per generated token), on a CPU in a forward of its own after "
            "the reply. None for a reader whose re-rotation was measured within kl_budget. Off by default, as "
            "reply_copies: work moved into the first reader's turn, not removed. True: each later reader "
            "reuses the text as computed after its own prefix."
        ),
    )
    copies_when_cheaper: bool = Field(
        default=True,
        description=(
            "With copies on (reply_copies, text_copies), feed them only while they cost at most the prefill they "
            "spare their readers, per copy id, as measured on this engine's calls (kvcomm_agents.framing.cost): a"
            " copy that costs more only moves work into the sender's turn, and the graph finishes later. Reply "
            "copies are weighed on every device (what the sender's decode steps took beyond plain ones); text "
            "copies too: timed whole where each is computed in a forward of its own (a CPU), with the reply "
            "copies where they ride on the same decode steps (CUDA). A kind loses on the median of two "
            "measurements, or on its first where that costs more than twice the prefill per id (measured: "
            "benchmarks/LAB.md). False: copies whatever they cost."
        ),
    )
    shared_runs: Literal["spans", "anywhere", "messages"] = Field(default="spans", description=(
        "Where shared text is looked for. 'anywhere': besides whole segments per message, any run of "
        "at least min_match_tokens token ids an earlier call computed (its messages, reply or whole "
        "prompt), wherever it sits in a message (a rolling-hash index). 'spans': as 'anywhere', and a "
        "run of an earlier prompt holding short found texts (at most recompute_short_runs ids: none "
        "where it is 0), each after at least 64 ids of the run (an earlier reader's question and "
        "replies, pasted alike), is reused in their place: their KV computed after what precedes them "
        "here. 'messages': only a segment's whole text (or a message's reference), kept for comparison."))
    experimental: ExperimentalSettings = Field(
        default_factory=ExperimentalSettings,
        description="The paper's variants (estimator, own-text offsets) and anchor pool details; see ExperimentalSettings.",
    )

    @classmethod
    def plain_transformers(cls) -> "KVCommConfig":
        """No reuse, one id per decode step, every call alone, KV concatenated, the weights as given:
        token for token what plain transformers computes (the reference every figure is measured
        against)."""
        return cls(method="dense", batched_decode=False, draft_tokens=0, kv_in_place=False, weight_layout="keep")

    @property
    def reuse(self) -> bool:
        """Whether the engine keeps and reuses KV at all (``method != "dense"``)."""
        return self.method != "dense"

    @property
    def measures_rerotation(self) -> bool:
        """Whether re-rotation is measured and trusted on samples: KVCOMM with a KL budget,
        audits on and ``measured_rerotation`` (``kvcomm_agents.rerotation_check``)."""
        return self.method == "kvcomm" and self.measured_rerotation and self.kl_budget is not None and self.audit_every > 0
