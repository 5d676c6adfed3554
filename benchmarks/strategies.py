"""Every way of prefilling a downstream agent's prompt, behind one interface.

A strategy answers one agent call: given the messages (identical ids for every strategy) and,
in the fidelity protocol, the reply to force (``engine.replay``), it returns a
:class:`CallOutcome` with its time to first token and first-token logits. All but the lower bound
are a :class:`KVCommEngine` with one setting changed, so they share the prompt rendering, the
decoding and the timing points:

- ``dense``: full prefill (``method="dense"``).
- ``prefix``: exact prefix caching only, what vLLM and SGLang give (``method="exact_prefix"``).
- ``rerotate``: shared segments re-rotated, no offsets (``method="rerotate"``).
- ``cacheblend``: re-rotation plus CacheBlend-style selective recompute of the given share
  (``benchmarks.cacheblend``, through the engine's plan hook).
- ``kvcomm-mean`` / ``kvcomm-weighted``: KVCOMM anchors with either estimator, gamma configurable
  (the library default, audits included: ``audit_every=16``).

The baselines without anchors (``prefix``, ``rerotate``, ``cacheblend`` and their variants) run
with ``audit_every=0``: an audit there only measures, and its dense pass would be charged to the
method's end-to-end time. The re-rotation baselines also run without the default head recompute
(``recompute_head=0``): they are the method alone, the reference of issue 12's targets.
- ``rerotate-messages`` / ``kvcomm-messages``: the same with shared text found only as whole
  segments per message (``experimental.shared_runs="messages"``, before token runs).
- ``kvcomm-only-itself``: ``kvcomm-mean`` where a segment judged new is computed alone
  (``experimental.new_segment="only_itself"``) instead of with everything after it.
- ``kvcomm-any-length``: ``kvcomm-mean`` whose gate consults anchors shorter than the segment
  too (``experimental.anchor_lengths="any"``); ``kvcomm-most-length`` those at least 3/4 as long
  (``"most"``).
- ``kvcomm-no-audit``: ``kvcomm-mean`` without audits (``audit_every=0``): the default before
  offsets were checked against dense (no warm-up audits, no offsets turned off).
- ``kvcomm-no-versions``: ``kvcomm-mean`` without recorded versions and without the KL budget
  (``experimental.recorded_versions=False``, ``kl_budget=None``): the default before both.
- ``kvcomm-no-budget``: ``kvcomm-mean`` without the KL budget (``kl_budget=None``): estimated
  offsets wherever the entropy gate lets a segment through, measured or not.
- ``kvcomm-unframed``: ``kvcomm-mean`` without framed copies of replies or shared text
  (``experimental.framed_replies=False, framed_texts=False``): the first reader of each reply
  computes it (the default before both).
- ``kvcomm-replies-framed``: ``kvcomm-mean`` with framed replies but no framed copies of shared
  prompt text (``experimental.framed_texts=False``): the default before text copies. Compare ``x dense`` (the reader's TTFT) with ``x hand-off`` (the
  sender's framing work after its reply charged to the reader).
- ``<engine strategy>-head-N`` (e.g. ``kvcomm-mean-head-8``, ``rerotate-head-8``): the first N
  tokens of every reused run computed in context (``experimental.recompute_head=N``), the
  cheap-fidelity idea.
- ``<engine strategy>-spread-P`` (e.g. ``kvcomm-no-budget-spread-20``, after ``-head-N`` if both):
  P% of the tokens reused with estimated offsets computed in context, those whose anchors
  disagree most (``experimental.recompute_spread=P/100``).
- ``kvcomm-own-text``: ``kvcomm-mean`` that also reuses the receiver's own text (role headers
  between messages) with the anchors' own-text offsets, as the paper does with its prefixes.
- ``lower-bound``: one forward of only the last prompt token over a ready exact cache (built
  untimed): the fastest any reuse can be. Its timed part renders the prompt too, as every
  strategy must.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch

from kvcomm_agents import ExperimentalSettings, KVCommConfig, KVCommEngine
from kvcomm_agents.engines import hf
from kvcomm_agents.prompt import render_prompt

from .cacheblend import CacheBlend

__all__ = ["CallOutcome", "Strategy", "EngineStrategy", "LowerBound", "build", "known", "NAMES", "DEFAULT_NAMES"]

#: byte budgets of each engine's segment store and anchor pools (several engines live side by
#: side): CPU runs keep the library defaults' order of magnitude, a GPU run sizes for an 8B model
#: (128 KiB of bf16 KV per token) so that no strategy loses its cache to the budget
BUDGETS_GIB = {"cpu": (1, 1), "cuda": (6, 12)}

NAMES = ("dense", "prefix", "pipelined", "rerotate", "cacheblend", "kvcomm-mean", "kvcomm-weighted", "kvcomm-own-text",
         "rerotate-messages", "kvcomm-messages", "kvcomm-only-itself", "kvcomm-any-length", "kvcomm-most-length",
         "kvcomm-no-audit", "kvcomm-no-versions", "kvcomm-no-budget", "kvcomm-unframed", "kvcomm-replies-framed",
         "kvcomm-paper", "lower-bound")
#: what a benchmark run compares unless ``--strategies`` says otherwise (the ablations of the
#: matching and gate ideas run when named: they would double the default profile's duration)
DEFAULT_NAMES = ("dense", "prefix", "pipelined", "rerotate", "cacheblend", "kvcomm-paper", "kvcomm-mean",
                 "lower-bound")

@dataclass
class CallOutcome:
    """One agent call under one strategy.

    Attributes:
        ttft_s: time to first token (entering the call to the first token id, device synced).
        before_prefill_s: rendering, planning, anchor matching, offsets, recompute selection and
            cache assembly: everything before the prefill forward ("time aligning").
        logits: ``[vocab]`` float32 first-token logits (CPU), None for a free (end-to-end) run.
        greedy_prefix: leading forced reply ids greedy decoding also gives (teacher forcing).
        token_ids / text: the reply (generated or forced).
        stats: the engine's ``CallStats`` (None for the lower bound).
        peak_extra_bytes: CUDA memory allocated at the call's peak beyond its start (None on CPU).
    """

    ttft_s: float
    before_prefill_s: float
    prompt_tokens: int
    reused_tokens: int
    logits: Optional[torch.Tensor]
    greedy_prefix: Optional[int]
    token_ids: list[int]
    text: str
    stats: object = None
    peak_extra_bytes: Optional[int] = None
    untimed_tokens: int = 0  # forwards the strategy ran that its figure leaves out (the lower bound's exact cache)
    untimed_s: float = 0.0  # and the seconds they took


class Strategy:
    """Interface: ``call(messages, agent, forced_ids=None, max_new_tokens=...)``.

    Attributes:
        generates: can run end to end (feeding itself).
        keeps_replies: later calls reuse what this strategy keeps of a forced reply, so the
            forced protocol feeds it the whole reply (except the last agent's, which feeds
            nobody); the others get only the agreement window, but for dense (the reference),
            which gets the whole reply so that ``run_forced`` records how far it follows it.
        requests: indices of the requests it takes part in (None: all), for the rows measured
            on a subset (the noise floor, the gamma sweep).
    """

    name: str
    generates: bool = True
    keeps_replies: bool = False
    computes_ahead: bool = False
    requests: Optional[range] = None

    def takes_part(self, request: int) -> bool:
        return self.requests is None or request in self.requests

    def call(self, messages: list[dict], agent: str, forced_ids: Optional[Sequence[int]] = None,
             max_new_tokens: int = 128, *, stepwise: bool = True, shared_texts: Sequence[str] = ()) -> CallOutcome:
        """One agent call: ``forced_ids`` replayed (``stepwise``: one decode step per token, as a
        generated reply costs), or, without them, a greedy reply of at most ``max_new_tokens``.
        ``shared_texts``: the texts of the prompt an earlier agent already read or wrote (only
        the lower bound uses them)."""
        raise NotImplementedError

    def ahead(self, prompts: Sequence[torch.Tensor]) -> None:
        """While a sender decodes: what this strategy computes of its readers' ``prompts`` (each
        ``[n]`` ids, a reader's prompt as far as it is known); only if ``computes_ahead``."""

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Calls inside the block leave what the strategy learns unchanged where it can (an
        engine's anchors); for measurements outside the graph."""
        yield

    def kv_bytes(self) -> int:
        """KV this strategy holds between calls (store, anchors, own text)."""
        return 0

    def anchor_bytes(self) -> int:
        return 0

    def evictions(self) -> int:
        """Store entries evicted for the byte budget so far."""
        return 0


def _cuda_peak_start(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _cuda_peak_extra(device: torch.device, start: Optional[int]) -> Optional[int]:
    return None if start is None else torch.cuda.max_memory_allocated(device) - start


class EngineStrategy(Strategy):
    """A :class:`KVCommEngine` with the given settings (its own store and anchors)."""

    def __init__(self, name: str, model, tokenizer, settings: dict, plan_hook=None):
        self.name = name
        self.device = model.get_input_embeddings().weight.device
        store_gib, anchor_gib = BUDGETS_GIB.get(self.device.type, BUDGETS_GIB["cpu"])
        self.settings = {"store_max_bytes": store_gib * 1024**3, "anchor_max_bytes": anchor_gib * 1024**3, **settings}
        self.engine = KVCommEngine(model, tokenizer, config=KVCommConfig(**self.settings), plan_hook=plan_hook)
        self.keeps_replies = self.engine.config.reuse

    def call(self, messages, agent, forced_ids=None, max_new_tokens=128, *, stepwise=True,
             shared_texts=()) -> CallOutcome:
        start = _cuda_peak_start(self.device)
        if forced_ids is not None:
            replay = self.engine.replay(messages, agent=agent, reply_ids=forced_ids, stepwise=stepwise)
        else:
            replay = self.engine.greedy(messages, agent=agent, max_new_tokens=max_new_tokens)
        result, logits, greedy = replay.result, replay.first_token_logits, replay.greedy_prefix
        s = result.stats
        return CallOutcome(
            ttft_s=s.ttft_s, before_prefill_s=s.plan_s + s.hook_s + s.align_s, prompt_tokens=s.prompt_tokens,
            reused_tokens=s.reused_tokens, logits=logits, greedy_prefix=greedy, token_ids=result.token_ids,
            text=result.text, stats=s, peak_extra_bytes=_cuda_peak_extra(self.device, start),
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


class LowerBound(Strategy):
    """The workload's limit: the same call with the prefill of shared text removed. The prompt's
    positions holding ``shared_texts`` (text an earlier agent already read or wrote), and its
    longest exact prefix any earlier call computed (what prefix caching gives every strategy),
    take exact KV from a dense prefill run beforehand, left out of the figure
    (``untimed_tokens``, ``untimed_s``); the call computes only the rest of its prompt, under the
    position mask, and decodes its reply: a reuse method that lost nothing and cost nothing."""

    generates = False

    def __init__(self, model, tokenizer):
        self.name = "lower-bound"
        self.model, self.tokenizer = model, tokenizer
        self.device = model.get_input_embeddings().weight.device
        self.seen: list[torch.Tensor] = []  # every earlier call's prompt and reply ids

    def _prefix(self, ids: torch.Tensor) -> int:
        """The longest common prefix of ``ids`` with an earlier call's prompt and reply."""
        best = 0
        for earlier in self.seen:
            n = min(earlier.numel(), ids.numel())
            differ = (earlier[:n] != ids[:n]).nonzero()
            best = max(best, int(differ[0, 0]) if differ.numel() else n)
        return best

    @torch.inference_mode()
    def call(self, messages, agent, forced_ids=None, max_new_tokens=128, *, stepwise=True,
             shared_texts=()) -> CallOutcome:
        from .measure import shared_text_positions

        ids = render_prompt(self.tokenizer, messages).ids
        n = int(ids.numel())
        if not stepwise:  # a warm-up call: only what prefix caching would remember of it
            reply = list(forced_ids or [])
            self.seen.append(torch.cat([ids, torch.tensor(reply[:-1], dtype=torch.long)]))
            return CallOutcome(ttft_s=0.0, before_prefill_s=0.0, prompt_tokens=n, reused_tokens=0, logits=None,
                               greedy_prefix=None, token_ids=reply, text="")
        found = shared_text_positions(self.tokenizer, messages, list(shared_texts), n) if shared_texts else None
        shared = sorted(p for p in set(found or ()) | set(range(self._prefix(ids))) if p < n - 1)
        untimed = time.perf_counter()
        dense = hf.prefill(self.model, ids, torch.arange(n)) if shared else None
        reused_positions = torch.tensor(shared, dtype=torch.long)
        computed = torch.tensor(sorted(set(range(n)) - set(shared)), dtype=torch.long)
        block = hf.kv_at_positions(dense.cache, dense.slot_positions, reused_positions) if shared else None
        untimed = time.perf_counter() - untimed
        start = _cuda_peak_start(self.device)
        t0 = time.perf_counter()
        layout = render_prompt(self.tokenizer, messages)  # timed: every strategy renders its prompt
        pre = hf.prefill(self.model, layout.ids, computed, block, reused_positions if shared else None,
                         masked=bool(shared))
        first = int(torch.argmax(pre.logits))  # waits for the device
        ttft = time.perf_counter() - t0
        reply = list(forced_ids) if forced_ids is not None else [first]
        rows = [pre.logits]
        for i, token in enumerate(reply[:-1]):
            rows.append(hf.run_forward(self.model, torch.tensor([[token]], device=self.device), pre.cache,
                                       position_ids=torch.tensor([[n + i]], device=self.device))[0, -1].float())
        greedy = 0
        while greedy < len(reply) and int(torch.argmax(rows[greedy])) == reply[greedy]:
            greedy += 1
        self.seen.append(torch.cat([ids, torch.tensor(reply[:-1], dtype=torch.long)]))
        return CallOutcome(
            ttft_s=ttft, before_prefill_s=0.0, prompt_tokens=n, reused_tokens=len(shared), logits=pre.logits.cpu(),
            greedy_prefix=greedy, token_ids=reply, text="", peak_extra_bytes=_cuda_peak_extra(self.device, start),
            untimed_tokens=n if shared else 0, untimed_s=untimed,
        )


#: the research method alone: no head recompute; the paper's KVCOMM also without recorded
#: versions or copies, with its similarity-weighted estimate
PURE = ExperimentalSettings(recompute_head=0)
PAPER = ExperimentalSettings(recompute_head=0, estimator="weighted", recorded_versions=False, framed_replies=False,
                             framed_texts=False)


#: suffixes an engine strategy's name may take (each at most once, in this order), and the
#: experimental setting each sets: ``-head-N`` recomputes the first N tokens of each reused run,
#: ``-spread-P`` the P% of estimated tokens whose anchors disagree most
_SUFFIXES = re.compile(r"(?P<base>.+?)(?:-head-(?P<head>\d+))?(?:-spread-(?P<spread>\d+))?")


def _split(name: str) -> tuple[str, dict]:
    """A strategy name as its base name and the experimental settings its suffixes set."""
    match = _SUFFIXES.fullmatch(name)
    update = {}
    if match["head"] is not None:
        update["recompute_head"] = int(match["head"])
    if match["spread"] is not None:
        update["recompute_spread"] = int(match["spread"]) / 100
    return match["base"], update


def known(name: str) -> bool:
    """A strategy name: one of ``NAMES``, or an engine strategy of them followed by ``-head-N``
    and/or ``-spread-P``."""
    base, update = _split(name)
    return name in NAMES or bool(update and base in NAMES and base != "lower-bound")


def settings_of(name: str, *, gamma: float = 0.3) -> dict:
    """The engine settings a strategy name stands for."""
    table = {
        "dense": {"method": "dense"},
        "prefix": {"method": "exact_prefix", "audit_every": 0},
        "pipelined": {"method": "exact_prefix", "audit_every": 0},
        "rerotate": {"method": "rerotate", "audit_every": 0},
        "cacheblend": {"method": "rerotate", "audit_every": 0, "experimental": PURE},
        "kvcomm-paper": {"method": "kvcomm", "gamma": gamma, "audit_every": 0, "kl_budget": None,
                         "experimental": PAPER},
        "kvcomm-mean": {"method": "kvcomm", "gamma": gamma},
        "kvcomm-weighted": {"method": "kvcomm", "gamma": gamma, "experimental": ExperimentalSettings(estimator="weighted")},
        "kvcomm-own-text": {"method": "kvcomm", "gamma": gamma, "experimental": ExperimentalSettings(own_text="reuse")},
        "rerotate-messages": {"method": "rerotate", "audit_every": 0,
                              "experimental": PURE.model_copy(update={"shared_runs": "messages"})},
        "kvcomm-messages": {"method": "kvcomm", "gamma": gamma,
                            "experimental": ExperimentalSettings(shared_runs="messages")},
        "kvcomm-only-itself": {"method": "kvcomm", "gamma": gamma,
                               "experimental": ExperimentalSettings(new_segment="only_itself")},
        "kvcomm-no-audit": {"method": "kvcomm", "gamma": gamma, "audit_every": 0, "kl_budget": None},
        "kvcomm-no-budget": {"method": "kvcomm", "gamma": gamma, "kl_budget": None},
        "kvcomm-unframed": {"method": "kvcomm", "gamma": gamma,
                            "experimental": ExperimentalSettings(framed_replies=False, framed_texts=False)},
        "kvcomm-replies-framed": {"method": "kvcomm", "gamma": gamma,
                                  "experimental": ExperimentalSettings(framed_texts=False)},
        "kvcomm-no-versions": {"method": "kvcomm", "gamma": gamma, "kl_budget": None,
                               "experimental": ExperimentalSettings(recorded_versions=False)},
        "kvcomm-any-length": {"method": "kvcomm", "gamma": gamma,
                              "experimental": ExperimentalSettings(anchor_lengths="any")},
        "kvcomm-most-length": {"method": "kvcomm", "gamma": gamma,
                               "experimental": ExperimentalSettings(anchor_lengths="most")},
    }
    base, update = _split(name)
    if update and base in table:  # any engine strategy with recompute_head=N / recompute_spread=P%
        settings = dict(table[base])
        experimental = settings.get("experimental", ExperimentalSettings())
        settings["experimental"] = experimental.model_copy(update=update)
        return settings
    if name not in table:
        raise ValueError(f"unknown strategy '{name}'; known: {', '.join(NAMES)}, or an engine strategy "
                         "followed by -head-N and/or -spread-P")
    return table[name]


def build(name: str, model, tokenizer, *, gamma: float = 0.3, recompute_share: float = 0.15) -> Strategy:
    """A fresh strategy (fresh store and anchors) by name."""
    if name == "lower-bound":
        return LowerBound(model, tokenizer)
    hook = CacheBlend(recompute_share) if name == "cacheblend" else None
    kind = PipelinedPrefill if name == "pipelined" else EngineStrategy
    return kind(name, model, tokenizer, settings_of(name, gamma=gamma), hook)


def noise_floor(model, tokenizer, dtype: torch.dtype = torch.bfloat16, requests: Optional[range] = None) -> EngineStrategy:
    """Dense prefill of a copy of the model in another dtype: the drift that is not reuse's
    (only on ``requests``, if given: on a CPU, bf16 is several times slower than fp32)."""
    other = copy.deepcopy(model).to(dtype)
    strategy = EngineStrategy(f"noise-floor (dense {str(dtype).replace('torch.', '')})", other, tokenizer, {"method": "dense"})
    strategy.requests = requests
    return strategy
