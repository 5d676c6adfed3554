"""Measurement helpers shared by the protocols, and the end-to-end protocol (each strategy
feeding itself; the whole-graph protocol is :mod:`benchmarks.graph`): dense reference replies
for the research scripts (batched, cached), slot rotation, the fields every call records, where
the shared text sits in a prompt."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable, Optional

import torch
from transformers import LogitsProcessorList

from kvcomm_agents.prompt import render_prompt

from .strategies import CallOutcome, Strategy
from .workloads import Workload

AGREE_K = 32


# ---- dense reference replies ----------------------------------------------------------------
def references(workload: Workload, model, tokenizer, path: Path, *, progress: Callable[[int], None] = lambda n: None,
               batch_size: int = 16) -> dict[str, list[dict]]:
    """Per request key, per agent: the dense greedy reply (``ids``, ``text``), cached at ``path``
    and extended batch by batch (a rerun generates only the missing ones); for the research
    scripts (``offset_sources.py``), not the benchmark, which runs its dense pipeline.

    Replies are generated for a batch of requests at once (left padding), agent by agent: batched
    rounding may pick another token at a near-tie than an unbatched run would. In the forced
    protocol that is harmless (the replies are only the text every strategy is fed, and agreement
    is measured against the dense strategy's own greedy run on the same ids); the end-to-end
    protocol does not use them: it runs its dense pipeline."""
    refs: dict[str, list[dict]] = torch.load(path, weights_only=True) if path.is_file() else {}
    missing = [r for r in workload.requests if r.key not in refs]
    progress(len(workload.requests) - len(missing))
    eos = _eos_ids(model, tokenizer) | (set(tokenizer.all_special_ids) if workload.exact_replies else set())
    teams: dict[int, list] = {}  # a batch runs agent by agent: one team size per batch
    for r in missing:
        teams.setdefault(len(r.agents), []).append(r)
    for team in teams.values():
        for i in range(0, len(team), batch_size):
            chunk = team[i:i + batch_size]
            refs.update(_batched_replies(chunk, workload.reply_tokens, workload.exact_replies, eos, model, tokenizer))
            _save(refs, path)
            progress(len(chunk))
    return refs


def _eos_ids(model, tokenizer) -> set[int]:
    from kvcomm_agents.support import inspect_model

    return set(inspect_model(model, tokenizer, reuse=False).eos_ids)


def _save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def write_json(obj, path: Path) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


@torch.inference_mode()
def _batched_replies(requests, tokens: int, exact: bool, eos: set[int], model, tokenizer) -> dict[str, list[dict]]:
    """Greedy replies for a batch of requests, agent by agent (left padding). ``exact``: exactly
    ``tokens`` tokens, end-of-sequence and special tokens suppressed; otherwise up to ``tokens``,
    cut after the first end-of-sequence id (kept, as the engine keeps it)."""
    device = model.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    replies: dict[str, list[dict]] = {r.key: [] for r in requests}
    for k in range(len(requests[0].agents)):
        prompts = [render_prompt(tokenizer, r.messages(k, [c["text"] for c in replies[r.key]])).ids for r in requests]
        width = max(int(p.numel()) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - p.numel():] = p
            mask[i, width - p.numel():] = 1
        options = {"min_new_tokens": tokens, "suppress_tokens": sorted(eos)} if exact else {"eos_token_id": sorted(eos)}
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=tokens, pad_token_id=pad, logits_processor=_within_vocab(tokenizer),
                             **options)
        for i, r in enumerate(requests):
            new = out[i, width:].tolist()
            ends = [j for j, t in enumerate(new) if t in eos]
            new = new[: ends[0] + 1] if ends and not exact else new
            replies[r.key].append({"ids": new, "text": tokenizer.decode(new, skip_special_tokens=True)})
    return replies


def _within_vocab(tokenizer) -> LogitsProcessorList:
    """Keep generation inside the tokenizer's vocabulary (a ``random:<shape>`` model has the real
    checkpoint's larger vocabulary but the byte-level test tokenizer)."""
    size = len(tokenizer)

    def limit(input_ids, scores):
        scores[:, size:] = float("-inf")
        return scores

    return LogitsProcessorList([limit])


# ---- protocols ------------------------------------------------------------------------------
def _rotated(strategies: list[Strategy], turn: int) -> list[Strategy]:
    """The strategies in the order of slot ``turn``: callers pass request + agent index, so that
    every agent index sees every strategy in every position across requests (a running call
    count would not when the agent count and the strategy count share a factor)."""
    if not strategies:
        return []
    turn %= len(strategies)
    return strategies[turn:] + strategies[:turn]


def agreement_window(ids: list[int], eos_ids, k: int = AGREE_K) -> int:
    """Tokens compared for k-token agreement: up to k, ending at the first end-of-sequence."""
    for i, token in enumerate(ids[:k]):
        if token in eos_ids:
            return i + 1
    return min(k, len(ids))


def _stats_fields(out: CallOutcome) -> dict:
    s = out.stats
    if s is None:
        return {"shared_found": False, "fully_reused": False, "opted_out": False, "recomputed_tokens": 0,
                "own_text_tokens": 0, "prefilled_reasons": [], "mode": "lower-bound"}
    shared = s.shared_decisions
    return {
        "shared_found": bool(shared), "fully_reused": s.fully_reused, "opted_out": s.opted_out,
        "recomputed_tokens": s.recomputed_tokens, "own_text_tokens": s.own_text_tokens, "mode": s.mode,
        "prefilled_reasons": [d.reason for d in shared if d.status == "prefilled"],
        "offsets_off": sum(1 for d in shared if d.gate is not None and d.gate.offsets == "off"),
        "gate": [[d.gate.decision, d.gate.anchors, d.gate.score, d.gate.offsets] for d in shared if d.gate is not None],
        "audit_kl": s.audit_kl,
        "plan_s": s.plan_s, "align_s": s.align_s, "hook_s": s.hook_s, "prefill_s": s.prefill_s,
        "total_s": s.total_s, "framed_s": s.framed_s, "framed_versions": s.framed_versions,
    }


def _record(phase, workload, r, key, warmup, k, agent, strategy, out: CallOutcome, dense) -> dict:
    """The fields every protocol records for one call of one strategy."""
    return {
        "phase": phase, "workload": workload.name, "request": r, "key": key, "warmup": warmup,
        "agent_index": k + 1, "agent": agent, "strategy": strategy.name,
        "prompt_tokens": out.prompt_tokens, "reused_tokens": out.reused_tokens, "ttft_s": out.ttft_s,
        "dense_ttft_s": dense.ttft_s if dense else None, "before_prefill_s": out.before_prefill_s,
        "anchor_bytes": strategy.anchor_bytes(), "kv_bytes": strategy.kv_bytes(),
        "store_evictions": strategy.evictions(), "peak_extra_bytes": out.peak_extra_bytes,
        **_stats_fields(out),
    }


def pipeline_wall_times(records: list[dict]) -> dict[str, dict]:
    """End-to-end time of each strategy's pipelines from an end-to-end run that did not share the
    CPU: per request, the sum of its calls' wall time (prefill and decode, ``total_s``); the
    median over the measured requests, and the median over requests of dense's sum divided by the
    strategy's (dense must have run as a strategy)."""
    sums: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("warmup") or r.get("total_s") is None:
            continue
        sums.setdefault(r["strategy"], {}).setdefault(r["request"], 0.0)
        sums[r["strategy"]][r["request"]] += r["total_s"]
    dense = sums.get("dense", {})
    out = {}
    for name, per_request in sums.items():
        ratios = [dense[q] / t for q, t in per_request.items() if q in dense and t > 0]
        out[name] = {"requests": len(per_request), "median_s": statistics.median(per_request.values()),
                     "speedup_vs_dense": statistics.median(ratios) if ratios else None}
    return out


#: Shortest task or reply text :func:`shared_text_positions` looks for (a named heuristic: about
#: the 8 tokens of ``min_match_tokens`` in English text).
MIN_SHARED_CHARS = 24


def shared_text_positions(tokenizer, messages: list[dict], texts: list[str], prompt_tokens: int) -> Optional[set[int]]:
    """Prompt positions of ``texts`` (the task and earlier agents' replies) in the rendered prompt
    of ``messages``: the tokens whose first character lies inside an occurrence of one of them.
    Texts shorter than ``MIN_SHARED_CHARS`` are left out (a two-character reply would match
    everywhere, and no reuse policy finds runs that short). None when this tokenizer's rendering
    cannot be mapped (no offsets, or another token count than the engine's prompt)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    try:
        encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):
        return None
    offsets = encoded["offset_mapping"]
    if len(offsets) != prompt_tokens:
        return None
    spans = []
    for text in texts:
        text = text.strip()
        start = rendered.find(text) if len(text) >= MIN_SHARED_CHARS else -1
        while start >= 0:
            spans.append((start, start + len(text)))
            start = rendered.find(text, start + len(text))
    return {i for i, (a, _) in enumerate(offsets) for lo, hi in spans if lo <= a < hi}


def reused_positions(stats) -> set[int]:
    """Prompt positions a call served from cache (``CallStats.reused_spans``: exact prefix,
    reused runs and own text, recomputed positions left out)."""
    return set() if stats is None else {p for start, end in stats.reused_spans for p in range(start, end)}


def run_end_to_end(workload: Workload, strategies: list[Strategy], *, warmup: int, phase: str,
                   concurrent: bool = False,
                   progress: Callable[[int], None] = lambda n: None) -> tuple[list[dict], list[dict]]:
    """Each strategy feeds itself (its own replies go downstream), the dense strategy too (the
    dense pipeline, run). Returns per-call records and per-request answers (final answer per
    strategy, gold). ``progress`` gets 1 per strategy call.

    ``concurrent``: each strategy's pipeline runs in its own thread, the CPU threads split
    between them (the pipelines are independent: one engine each, and the model is only read).
    Their times then share the machine: this protocol is for answers, and its records are marked
    ``concurrent``; without it the strategies take turns slot by slot, as in ``run_forced``."""
    run = _pipelines_concurrently if concurrent else _pipelines_interleaved
    outcomes = run(workload, strategies, progress)  # name -> (request, agent index) -> outcome
    records, answers = [], []
    for r, request in enumerate(workload.requests):
        for k, agent in enumerate(request.agents):
            dense = outcomes["dense"][r, k] if "dense" in outcomes else None
            for strategy in strategies:
                out = outcomes[strategy.name][r, k]
                records.append({
                    **_record(phase, workload, r, request.key, r < warmup, k, agent, strategy, out, dense),
                    "lower_bound_ttft_s": None, "generated_tokens": len(out.token_ids), "concurrent": concurrent,
                })
        replies = {s.name: [outcomes[s.name][r, k].text for k in range(len(request.agents))] for s in strategies}
        final = workload.final_answer or (lambda texts: texts[-1])
        answers.append({
            "phase": phase, "request": r, "key": request.key, "warmup": r < warmup, "gold": request.gold,
            "answers": {name: final(texts) for name, texts in replies.items()},
        })
    return records, answers


def _pipeline(workload: Workload, strategy: Strategy, progress) -> dict[tuple[int, int], CallOutcome]:
    """One strategy's pipelines over every request, feeding itself."""
    outcomes = {}
    for r, request in enumerate(workload.requests):
        texts: list[str] = []
        for k, agent in enumerate(request.agents):
            out = outcomes[r, k] = strategy.call(request.messages(k, texts), agent, max_new_tokens=workload.reply_tokens)
            texts.append(out.text)
            progress(1)
    return outcomes


def _pipelines_concurrently(workload: Workload, strategies: list[Strategy], progress) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // max(1, len(strategies))))
    try:
        with ThreadPoolExecutor(max_workers=max(1, len(strategies))) as pool:
            futures = {s.name: pool.submit(_pipeline, workload, s, progress) for s in strategies}
            return {name: future.result() for name, future in futures.items()}
    finally:
        torch.set_num_threads(threads)


def _pipelines_interleaved(workload: Workload, strategies: list[Strategy], progress) -> dict:
    outcomes: dict[str, dict] = {s.name: {} for s in strategies}
    for r, request in enumerate(workload.requests):
        texts: dict[str, list[str]] = {s.name: [] for s in strategies}
        for k, agent in enumerate(request.agents):
            for strategy in _rotated(strategies, r + k):
                out = outcomes[strategy.name][r, k] = strategy.call(
                    request.messages(k, texts[strategy.name]), agent, max_new_tokens=workload.reply_tokens)
                texts[strategy.name].append(out.text)
                progress(1)
    return outcomes
