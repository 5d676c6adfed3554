"""Every way of serving an agent call, behind one interface (:mod:`benchmarks.outcome`).

A strategy answers one agent call on the messages every strategy gets (identical ids): a reply
replayed one decode step per token, or its own greedy reply; it returns a :class:`CallOutcome`
with its time to first token and first-token logits. All but the limit are a
:class:`KVCommEngine` with one setting changed, so they share the prompt rendering, the decoding
and the timing points. The competitors every run compares (``DEFAULT_NAMES``):

- ``dense``: full prefill, one id per decode step: plain transformers (``method="dense"``,
  ``draft_tokens=0``, ``batched_decode=False``).
- ``prefix``: exact prefix caching only, what vLLM and SGLang give (``method="exact_prefix"``).
- ``pipelined``: exact prefix caching, and every later reader's known prompt computed exactly in
  the sender's turn (:class:`PipelinedPrefill`).
- ``rerotate``: shared text re-rotated, no offsets (``method="rerotate"``), with the default's
  16-token head and its short runs (at most 64 tokens) computed.
- ``cacheblend``: re-rotation plus CacheBlend-style selective recompute of the given share
  (``benchmarks.cacheblend``, through the engine's plan hook).
- ``kvcomm-paper``: KVCOMM as the paper sets it: the similarity-weighted estimate, the entropy
  gate, ``kl_budget=None``, no audits, versions, copies, head or short runs computed.
- ``kvcomm-mean``: the library default (``KVCommConfig()`` with the run's gamma), remembering
  nothing from earlier engines (``remember_measurements=False``, as every strategy here but
  ``kvcomm-remembered``).
- ``lower-bound``: the workload's limit (:class:`~benchmarks.competitors.LowerBound`).

The baselines without anchors run with ``audit_every=0`` (an audit there only measures). The
ablations behind ``benchmarks/LAB.md`` run when named: ``kvcomm-weighted``, ``kvcomm-own-text``
(the receiver's own text reused with the anchors' own-text offsets), ``rerotate-messages`` /
``kvcomm-messages`` (shared text found only as whole messages), ``kvcomm-no-audit``,
``kvcomm-audits-unpriced`` (every ``audit_every``-th
reused call audited whatever reuse spared, ``audit_share=None``), ``kvcomm-no-versions``, ``kvcomm-no-budget``, ``kvcomm-no-rerotation`` (no measured re-rotation: readers
compute what the default would serve them re-rotated; ``kvcomm-no-rerotation-copies``, the same with
copies on under the cost rule; ``kvcomm-no-rerotation-copies-always``, with copies fed whatever they cost),
``kvcomm-copies`` (reply and text copies on, fed while they cost at most the prefill they spare),
``kvcomm-replies-framed`` (reply copies only, the same rule), ``kvcomm-copies-always`` (copies fed whatever
they cost, ``copies_when_cheaper=False``), ``kvcomm-audit-new`` (a receiver's first call
served on other receivers' samples audited, ``experimental.audit_new_readers``), ``kvcomm-trust-clear`` /
``kvcomm-trust-audited`` (re-rotation trusted on two samples within the KL budget or one within
a quarter of it, or before any with the first calls so served audited: ``experimental.rerotation_trust``),
``dense-drafted`` (dense prefill, decode steps drafting from the call's own ids and the engine's
last replies as the library's do by default: what drafting alone gives), ``kvcomm-no-drafts``
(the default, one id per decode step, ``draft_tokens=0``), ``kvcomm-own-drafts`` (drafts from the
call's own ids only, ``draft_recent_replies=0``), ``kvcomm-fixed-drafts`` (drafts at their adapted
length only, never longer where a forward of more ids was measured cheaper,
``experimental.measured_draft_lengths=False``), ``kvcomm-kv-concatenated`` (the default with each decode
step's KV concatenated onto a copy of the cache, as transformers does, ``kv_in_place=False``), ``kvcomm-no-short-sample`` (no short first sample: a first reader computes its shared text to be
measured, ``experimental.short_rerotation_sample=False``), ``kvcomm-rerotate-replies`` (replies served
re-rotated alone where re-rotation was measured within the budget, ``experimental.rerotate_replies``),
``kvcomm-no-spans`` / ``rerotate-no-spans`` (no run of an earlier prompt preferred over the texts it holds,
``shared_runs="anywhere"``), ``kvcomm-no-cut-head`` (a run starting 64 or more ids inside its text keeps
``recompute_head``'s head, ``recompute_cut_head=0``), ``kvcomm-blend`` (the default, then ``cacheblend``'s selective recompute of ``--recompute-share`` of the
reused tokens), ``kvcomm-remembered`` (the default starting from the re-rotation measurements earlier engines left in
``--remembered FOLDER``, writing its own there: ``remember_measurements``); any engine strategy + ``-head-N`` (the first N
tokens of every reused run computed in context), ``-short-N`` (approximate runs of at most N tokens computed whole),
``-tail-N``, ``-last-N`` (``recompute_tail``, ``recompute_last_run``), ``-budget-N`` (``kl_budget`` N / 10,000).
"""

from __future__ import annotations

import copy
import re
from typing import Optional

import torch

from kvcomm_agents import ExperimentalSettings, KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf

from .cacheblend import CacheBlend
from .competitors import LowerBound
from .outcome import CallOutcome, Strategy, cuda_peak_extra, cuda_peak_start

__all__ = ["CallOutcome", "Strategy", "EngineStrategy", "PipelinedPrefill", "LowerBound", "build", "known", "NAMES",
           "DEFAULT_NAMES"]

#: byte budgets of each engine's segment store and anchor pools (several engines live side by
#: side): CPU runs keep the library defaults' order of magnitude, a GPU run sizes for an 8B model
#: (128 KiB of bf16 KV per token) so that no strategy loses its cache to the budget
BUDGETS_GIB = {"cpu": (1, 1), "cuda": (6, 12)}

NAMES = ("dense", "prefix", "pipelined", "rerotate", "cacheblend", "kvcomm-mean", "kvcomm-weighted", "kvcomm-own-text",
         "rerotate-messages", "kvcomm-messages", "kvcomm-no-audit", "kvcomm-audits-unpriced", "kvcomm-no-versions", "kvcomm-no-budget", "kvcomm-copies", "kvcomm-replies-framed",
         "kvcomm-copies-always", "kvcomm-no-rerotation", "kvcomm-no-rerotation-copies",
         "kvcomm-no-rerotation-copies-always", "kvcomm-audit-new", "kvcomm-trust-clear", "kvcomm-trust-audited",
         "kvcomm-no-short-sample", "dense-batched", "kvcomm-mean-steps-alone", "dense-drafted", "kvcomm-no-drafts",
         "kvcomm-own-drafts", "kvcomm-fixed-drafts", "kvcomm-kv-concatenated", "kvcomm-rerotate-replies", "kvcomm-no-spans", "kvcomm-no-cut-head", "rerotate-no-spans", "kvcomm-remembered", "kvcomm-blend", "kvcomm-paper", "lower-bound")
#: what a benchmark run compares unless ``--strategies`` says otherwise (the ablations of the
#: matching and gate ideas run when named: they would double the default profile's duration)
DEFAULT_NAMES = ("dense", "prefix", "pipelined", "rerotate", "cacheblend", "kvcomm-paper", "kvcomm-mean",
                 "lower-bound")

class EngineStrategy(Strategy):
    """A :class:`KVCommEngine` with the given settings (its own store and anchors; nothing
    remembered from earlier engines unless ``settings`` say so: a run does not depend on what
    ran on the machine before it)."""

    def __init__(self, name: str, model, tokenizer, settings: dict, plan_hook=None):
        self.name = name
        self.device = model.get_input_embeddings().weight.device
        store_gib, anchor_gib = BUDGETS_GIB.get(self.device.type, BUDGETS_GIB["cpu"])
        self.settings = {"store_max_bytes": store_gib * 1024**3, "anchor_max_bytes": anchor_gib * 1024**3,
                         "remember_measurements": False, **settings}
        self.engine = KVCommEngine(model, tokenizer, config=KVCommConfig(**self.settings), plan_hook=plan_hook)

    def call(self, messages, agent, forced_ids=None, max_new_tokens=128, *, stepwise=True,
             shared_texts=()) -> CallOutcome:
        start = cuda_peak_start(self.device)
        if forced_ids is not None:
            replay = self.engine.replay(messages, agent=agent, reply_ids=forced_ids, stepwise=stepwise)
        else:
            replay = self.engine.greedy(messages, agent=agent, max_new_tokens=max_new_tokens)
        result, logits, greedy = replay.result, replay.first_token_logits, replay.greedy_prefix
        s = result.stats
        return CallOutcome(
            ttft_s=s.ttft_s, before_prefill_s=s.plan_s + s.hook_s + s.align_s, prompt_tokens=s.prompt_tokens,
            reused_tokens=s.reused_tokens, logits=logits, greedy_prefix=greedy, token_ids=result.token_ids,
            text=result.text, stats=s, peak_extra_bytes=cuda_peak_extra(self.device, start),
        )

    def frozen(self):
        return self.engine.freeze_anchors()

    def kv_bytes(self) -> int:
        return self.engine.store.stats().bytes + self.engine.anchors.nbytes() + self.engine.own_texts.nbytes()

    def anchor_bytes(self) -> int:
        return self.engine.anchors.nbytes()

    def evictions(self) -> int:
        return self.engine.store.stats().evictions


class PipelinedPrefill(EngineStrategy):
    """Pipelined exact prefill, the simplest honest competitor of copies: while a sender decodes,
    each later reader's prompt, as far as it is known (its own text, the task, the replies
    already written), is computed exactly and kept as an exact prefix; the reader then computes
    only what follows (the sender's reply and after it). Exact prefix caching underneath: no
    re-rotation, no anchors. (FlashAgents, MLSys'26, does this on SGLang.)

    Shortcut: the readers' prefixes are computed right after the sender's reply, in the
    sender's turn, not batched into its decode steps: on one device the work is the same, done
    serially; riding on memory-bound decode steps, as copies do, could make it cheaper."""

    computes_ahead = True

    @torch.inference_mode()
    def ahead(self, prompts):
        engine = self.engine
        for ids in prompts:
            ids = torch.as_tensor(ids, dtype=torch.long)
            hit = engine.store.longest_prefix(ids, engine.fingerprint)
            known = hit[1] if hit is not None else 0
            if known >= ids.numel():
                continue
            reused = hit[0].kv.window(0, known) if known else None
            pre = hf.prefill(engine.model, ids, torch.arange(known, ids.numel()), reused,
                             torch.arange(known) if known else None)
            kv = hf.kv_at_positions(pre.cache, pre.slot_positions, torch.arange(ids.numel()))
            engine.store.put_prefix(ids, kv, engine.fingerprint)


#: the paper's KVCOMM: no head recompute, no recorded versions or copies, its similarity-weighted
#: estimate, no KL budget or audits
PAPER = {"kl_budget": None, "audit_every": 0, "recompute_head": 0, "recompute_tail": 0, "recompute_short_runs": 0,
         "recompute_last_run": 0, "recorded_versions": False, "reply_copies": False,
         "text_copies": False, "experimental": ExperimentalSettings(estimator="weighted")}


#: reply and text copies on (both off in the default)
COPIES = {"reply_copies": True, "text_copies": True}

#: the suffixes an engine strategy's name may take: ``-head-N`` recomputes the first N tokens of
#: each reused run, ``-short-N`` computes whole every approximate run of at most N tokens,
#: ``-tail-N`` and ``-last-N`` set ``recompute_tail`` and ``recompute_last_run``, ``-budget-N``
#: sets ``kl_budget`` to N / 10,000 (``-budget-50``: 0.005)
_SUFFIXES = re.compile(r"(?P<base>.+?)(?:-head-(?P<head>\d+))?(?:-short-(?P<short>\d+))?(?:-tail-(?P<tail>\d+))?"
                       r"(?:-last-(?P<last>\d+))?(?:-budget-(?P<budget>\d+))?")


def _split(name: str) -> tuple[str, dict]:
    """A strategy name as its base name and the settings its suffixes set."""
    match = _SUFFIXES.fullmatch(name)
    update = {} if match["head"] is None else {"recompute_head": int(match["head"])}
    if match["short"] is not None:
        update["recompute_short_runs"] = int(match["short"])
    if match["tail"] is not None:
        update["recompute_tail"] = int(match["tail"])
    if match["last"] is not None:
        update["recompute_last_run"] = int(match["last"])
    if match["budget"] is not None:
        update["kl_budget"] = int(match["budget"]) / 10_000
    return match["base"], update


def known(name: str) -> bool:
    """A strategy name: one of ``NAMES``, or an engine strategy of them followed by any of
    ``-head-N``, ``-short-N``, ``-tail-N``, ``-last-N``, ``-budget-N`` (in that order)."""
    base, update = _split(name)
    return name in NAMES or bool(update and base in NAMES and base != "lower-bound")


def settings_of(name: str, *, gamma: float = 0.3) -> dict:
    """The engine settings a strategy name stands for."""
    table = {
        "dense": KVCommConfig.plain_transformers().model_dump(exclude_defaults=True),
        "dense-batched": {"method": "dense", "draft_tokens": 0},  # no reuse; parallel calls' decode steps in one forward
        "dense-drafted": {"method": "dense", "batched_decode": False},  # no reuse; drafts as the default decodes
        "prefix": {"method": "exact_prefix", "audit_every": 0},
        "pipelined": {"method": "exact_prefix", "audit_every": 0},
        "rerotate": {"method": "rerotate", "audit_every": 0},
        "cacheblend": {"method": "rerotate", "audit_every": 0, "recompute_head": 0, "recompute_tail": 0, "recompute_short_runs": 0,
                       "recompute_last_run": 0},
        "kvcomm-paper": {"method": "kvcomm", "gamma": gamma, **PAPER},
        "kvcomm-mean": {"method": "kvcomm", "gamma": gamma},
        "kvcomm-mean-steps-alone": {"method": "kvcomm", "gamma": gamma, "batched_decode": False},
        "kvcomm-no-drafts": {"method": "kvcomm", "gamma": gamma, "draft_tokens": 0},
        "kvcomm-kv-concatenated": {"method": "kvcomm", "gamma": gamma, "kv_in_place": False},
        "kvcomm-own-drafts": {"method": "kvcomm", "gamma": gamma, "draft_recent_replies": 0},
        "kvcomm-fixed-drafts": {"method": "kvcomm", "gamma": gamma,
                                "experimental": ExperimentalSettings(measured_draft_lengths=False)},
        "kvcomm-weighted": {"method": "kvcomm", "gamma": gamma, "experimental": ExperimentalSettings(estimator="weighted")},
        "kvcomm-own-text": {"method": "kvcomm", "gamma": gamma, "experimental": ExperimentalSettings(own_text="reuse")},
        "rerotate-messages": {"method": "rerotate", "audit_every": 0, "recompute_head": 0, "recompute_tail": 0, "recompute_short_runs": 0,
                              "recompute_last_run": 0,
                              "shared_runs": "messages"},
        "kvcomm-messages": {"method": "kvcomm", "gamma": gamma, "shared_runs": "messages"},
        "kvcomm-no-audit": {"method": "kvcomm", "gamma": gamma, "audit_every": 0, "kl_budget": None},
        "kvcomm-audits-unpriced": {"method": "kvcomm", "gamma": gamma, "audit_share": None},
        "kvcomm-no-budget": {"method": "kvcomm", "gamma": gamma, "kl_budget": None},
        "kvcomm-copies": {"method": "kvcomm", "gamma": gamma, **COPIES},
        "kvcomm-replies-framed": {"method": "kvcomm", "gamma": gamma, "reply_copies": True},
        "kvcomm-copies-always": {"method": "kvcomm", "gamma": gamma, **COPIES, "copies_when_cheaper": False},
        "kvcomm-no-versions": {"method": "kvcomm", "gamma": gamma, "kl_budget": None, "recorded_versions": False},
        "kvcomm-no-rerotation": {"method": "kvcomm", "gamma": gamma, "measured_rerotation": False},
        "kvcomm-no-rerotation-copies": {"method": "kvcomm", "gamma": gamma, "measured_rerotation": False, **COPIES},
        "kvcomm-no-rerotation-copies-always": {"method": "kvcomm", "gamma": gamma, "measured_rerotation": False,
                                               **COPIES, "copies_when_cheaper": False},
        "kvcomm-audit-new": {"method": "kvcomm", "gamma": gamma,
                             "experimental": ExperimentalSettings(audit_new_readers=True)},
        "kvcomm-trust-clear": {"method": "kvcomm", "gamma": gamma,
                               "experimental": ExperimentalSettings(rerotation_trust="clear_sample")},
        "kvcomm-trust-audited": {"method": "kvcomm", "gamma": gamma,
                                 "experimental": ExperimentalSettings(rerotation_trust="audited")},
        "kvcomm-no-short-sample": {"method": "kvcomm", "gamma": gamma,
                                   "experimental": ExperimentalSettings(short_rerotation_sample=False)},
        "kvcomm-rerotate-replies": {"method": "kvcomm", "gamma": gamma,
                                    "experimental": ExperimentalSettings(rerotate_replies=True)},
        "kvcomm-no-spans": {"method": "kvcomm", "gamma": gamma, "shared_runs": "anywhere"},
        "kvcomm-no-cut-head": {"method": "kvcomm", "gamma": gamma, "recompute_cut_head": 0},
        "rerotate-no-spans": {"method": "rerotate", "audit_every": 0, "shared_runs": "anywhere"},
        # the default remembering what earlier engines measured (the folder: ``build(remembered=...)``)
        "kvcomm-remembered": {"method": "kvcomm", "gamma": gamma},
        # the default, then CacheBlend-style recompute of the reused tokens that deviate most
        "kvcomm-blend": {"method": "kvcomm", "gamma": gamma},
    }
    base, update = _split(name)
    if update and base in table:  # any engine strategy with its suffixes' settings
        return {**table[base], **update}
    if name not in table:
        raise ValueError(f"unknown strategy '{name}'; known: {', '.join(NAMES)}, or an engine strategy "
                         "followed by -head-N, -short-N, -tail-N, -last-N, -budget-N")
    return table[name]


def build(name: str, model, tokenizer, *, gamma: float = 0.3, recompute_share: float = 0.15,
          remembered: Optional[str] = None) -> Strategy:
    """A fresh strategy (fresh store and anchors) by name; ``remembered``: the folder whose
    measurements ``kvcomm-remembered`` engines start from and write to
    (``KVCommConfig.remember_measurements``; every other strategy remembers nothing)."""
    if name == "lower-bound":
        return LowerBound(model, tokenizer)
    hook = CacheBlend(recompute_share) if _split(name)[0] in ("cacheblend", "kvcomm-blend") else None
    kind = PipelinedPrefill if name == "pipelined" else EngineStrategy
    settings = settings_of(name, gamma=gamma)
    if _split(name)[0] == "kvcomm-remembered":
        if remembered is None:
            raise ValueError("kvcomm-remembered needs the folder it remembers in (--remembered FOLDER)")
        settings = {**settings, "remember_measurements": remembered}
    return kind(name, model, tokenizer, settings, hook)


def _copy_without_hooks(model):
    """A deep copy of ``model`` without the hooks on it: the benchmark's token meter hooks the
    model, and its handles (to models already freed) cannot be copied."""
    held = []
    for module in model.modules():
        for name, value in vars(module).items():
            if name.endswith("_hooks") and name.startswith(("_forward", "_backward")) and value:
                held.append((module, name, value))
    try:
        for module, name, _ in held:
            setattr(module, name, type(getattr(module, name))())
        return copy.deepcopy(model)
    finally:
        for module, name, value in held:
            setattr(module, name, value)


def noise_floor(model, tokenizer, dtype: Optional[torch.dtype] = None, requests: Optional[range] = None) -> EngineStrategy:
    """Dense prefill of a copy of the model in another dtype (None: bfloat16, or float32 for a
    bfloat16 model, whose copy in its own dtype would measure nothing): the drift that is not reuse's,
    measured on the deciding agent's calls only (``decider_only``; on a CPU bf16 runs several
    times slower than fp32) unless a run names the phase in ``--noise-floor`` (every reader's
    call), on ``requests`` if given."""
    if dtype is None:
        dtype = torch.float32 if next(model.parameters()).dtype == torch.bfloat16 else torch.bfloat16
    other = _copy_without_hooks(model).to(dtype)
    strategy = EngineStrategy(f"noise-floor (dense {str(dtype).replace('torch.', '')})", other, tokenizer, {"method": "dense"})
    strategy.requests = requests
    strategy.decider_only = True
    return strategy
