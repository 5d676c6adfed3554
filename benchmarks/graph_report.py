"""Whole-graph summaries of :mod:`benchmarks.graph` records: per workload and strategy, what a
user waits for (the graph's wall time), what it costs (tokens forwarded), how close it comes
to the workload's limit, beside the readers' time to first token and fidelity (their text:
:mod:`benchmarks.graph_tables`)."""

from __future__ import annotations

import statistics
from typing import Optional

from .report import _order, summarize_calls

__all__ = ["DEFAULT", "summarize_graphs", "further_by_agent", "summarize_decisions", "summarize_by_format",
           "fastest_and_closest", "is_ablation", "noise_floor_readers"]

#: the library's default as a benchmark strategy
DEFAULT = "kvcomm-mean"


def _graphs(records: list[dict]) -> dict[int, dict]:
    """Per request: the graph's wall time, tokens forwarded, decode time and decoded tokens."""
    out: dict[int, dict] = {}
    for r in records:
        g = out.setdefault(r["request"], {"wall": 0.0, "tokens": 0, "decode_s": 0.0, "decoded": 0})
        g["wall"] += r["wall_s"]
        g["tokens"] += r["model_tokens"]
        g["decode_s"] += max(0.0, r["call_s"] - r["ttft_s"])
        g["decoded"] += r["decoded_tokens"]
    return out


def _first_tokens_from_start(records: list[dict]) -> dict[tuple[int, int], float]:
    """Per reader call ``(request, agent index > 1)``: seconds from its graph's start to its first
    token, the calls before it in the graph (their copies, audits and checks included) plus its
    own TTFT: when a user sees that agent answer."""
    out = {}
    for r in records:
        if r["agent_index"] > 1:
            earlier = sum(q["wall_s"] for q in records
                          if q["request"] == r["request"] and q["agent_index"] < r["agent_index"])
            out[(r["request"], r["agent_index"])] = earlier + r["ttft_s"]
    return out


def _from_start_speedup(dense: list[dict], mine: list[dict]) -> Optional[float]:
    """Median over readers, paired by call, of dense's time from the graph's start to the
    reader's first token / the strategy's."""
    d, m = _first_tokens_from_start(dense), _first_tokens_from_start(mine)
    ratios = [d[k] / m[k] for k in m if k in d and m[k] > 0]
    return statistics.median(ratios) if ratios else None


def summarize_graphs(records: list[dict]) -> list[dict]:
    """One row per (phase, strategy) over the measured requests every strategy took part in:

    - ``wall_median_s``: median whole-graph wall time; ``speedup_vs_dense``: median over requests
      of dense's wall time / the strategy's (same requests, same run);
    - ``tokens_mean``: tokens forwarded per graph (prompt computed, copies, audits, decoded,
      computed ahead); ``tokens_vs_dense``: their sum / dense's;
    - ``share_of_limit``: the time saved against dense as a share of what the lower bound saves
      (``(1 - 1/x) / (1 - 1/x_limit)`` of the median speed-ups; 100% = the limit);
    - ``tpot_ms``: time per output token after the first, everything the call does after it
      included (decode, copies riding on it or fed after it, the audit, capture; not what a
      strategy computes ahead for its readers);
    - the readers' (agents 2..N) TTFT speed-up, KL, agreement and reuse from
      :func:`benchmarks.report.summarize_calls`;
    - ``reader_from_start_speedup``: the readers' first token counted from the graph's start
      (:func:`_first_tokens_from_start`), median ratio to dense's: work a strategy moves into an
      earlier agent's turn (copies) shows here, not in the readers' TTFT;
    - ``reader_kl_by_agent``: the readers' mean first-token KL per agent index
      (:func:`further_by_agent` compares two strategies' index by index).
    """
    # the noise floor runs the deciding agent's calls only: a reference for decisions, not a graph
    measured = [r for r in records if not r["warmup"] and "wall_s" in r and not r["strategy"].startswith("noise-floor")]
    rows = []
    for phase in sorted({r["phase"] for r in measured}):
        mine = [r for r in measured if r["phase"] == phase]
        mine = [r for r in mine if r["request"] in _everyones(mine)]
        per = {s: _graphs([r for r in mine if r["strategy"] == s]) for s in {r["strategy"] for r in mine}}
        dense = per.get("dense", {})
        speedups = {s: _ratio_median(dense, g) for s, g in per.items()}
        limit = speedups.get("lower-bound")
        for strategy in sorted(per, key=_order):
            graphs, x = per[strategy], speedups[strategy]
            common = [q for q in graphs if q in dense]
            decoded = sum(g["decoded"] for g in graphs.values())
            readers = summarize_calls([r for r in mine if r["strategy"] == strategy and r["agent_index"] > 1])
            rows.append({
                "phase": phase, "strategy": strategy, "requests": len(graphs),
                "wall_median_s": statistics.median(g["wall"] for g in graphs.values()),
                "speedup_vs_dense": x,
                "share_of_limit": (1 - 1 / x) / (1 - 1 / limit) if x and limit and limit > 1 else None,
                "tokens_mean": sum(g["tokens"] for g in graphs.values()) / len(graphs),
                "tokens_vs_dense": (sum(graphs[q]["tokens"] for q in common) / sum(dense[q]["tokens"] for q in common)
                                    if common and sum(dense[q]["tokens"] for q in common) else None),
                "tpot_ms": 1000 * sum(g["decode_s"] for g in graphs.values()) / decoded if decoded else None,
                "reader_ttft_speedup": readers["speedup_vs_dense"], "reader_kl_mean": readers["kl_mean"],
                "reader_agree_32": readers["agree_32"], "reuse_rate": readers["reuse_rate"],
                "shared_text_share": readers["shared_text_share"],
                "reader_from_start_speedup": _from_start_speedup([r for r in mine if r["strategy"] == "dense"],
                                                                 [r for r in mine if r["strategy"] == strategy]),
                "reader_kl_by_agent": _kl_by_agent([r for r in mine if r["strategy"] == strategy and r["agent_index"] > 1]),
            })
    return rows


def _kl_by_agent(records: list[dict]) -> dict[str, float]:
    """Mean first-token KL against dense per agent index (a JSON key: the index as text), over
    the calls that measured one (every strategy's reader calls measure one on a run's graphs, so
    two strategies' means cover the same calls)."""
    out = {}
    for index in sorted({r["agent_index"] for r in records}):
        kls = [r["kl"] for r in records if r["agent_index"] == index and r.get("kl") is not None]
        if kls:
            out[str(index)] = sum(kls) / len(kls)
    return out


def further_by_agent(summary: dict, strategy: str = DEFAULT, reference: str = "rerotate") -> dict[str, float]:
    """Per workload, the most ``strategy``'s readers' mean KL at any agent index exceeds
    ``reference``'s at the same index (negative: closer to dense at every index); workloads
    without both strategies' per-agent KL are left out."""
    out = {}
    for phase, result in summary["phases"].items():
        rows = {r["strategy"]: r.get("reader_kl_by_agent") for r in result.get("graphs") or []}
        mine, theirs = rows.get(strategy), rows.get(reference)
        common = [i for i in (mine or {}) if i in (theirs or {})]
        if common:
            out[phase] = max(mine[i] - theirs[i] for i in common)
    return out


def _everyones(records: list[dict]) -> set[int]:
    """The requests every strategy took part in (the decision strategies' extra requests are
    left out)."""
    sets = [{r["request"] for r in records if r["strategy"] == s} for s in {r["strategy"] for r in records}]
    return set.intersection(*sets) if sets else set()


def _ratio_median(dense: dict[int, dict], graphs: dict[int, dict]) -> Optional[float]:
    ratios = [dense[q]["wall"] / g["wall"] for q, g in graphs.items() if q in dense and g["wall"] > 0]
    return statistics.median(ratios) if ratios else None


def noise_floor_readers(records: list[dict], *, every_reader: bool = True) -> Optional[dict]:
    """The readers' (agents 2..N) first-token KL and 32-token agreement against dense for dense
    itself run in another dtype (the noise-floor strategy): what a dtype change alone moves, to
    read a strategy's KL against. None where it did not run. ``every_reader``: it ran every
    reader's call (``--noise-floor``), else the deciding agent's alone ((b) and (i))."""
    mine = [r for r in records if not r["warmup"] and r["strategy"].startswith("noise-floor") and r["agent_index"] > 1]
    if not mine:
        return None
    calls = summarize_calls(mine)
    return {"strategy": mine[0]["strategy"], "kl_mean": calls["kl_mean"], "agree_32": calls["agree_32"],
            "calls": len(mine), "every_reader": every_reader}


def summarize_decisions(answers: list[dict]) -> list[dict]:
    """Per strategy: how often the decider (judge, aggregator) picks what it picks under dense
    prefill on the same candidates (judge consistency), its accuracy where gold is known, and
    ``decider_kl_mean``, the mean first-token KL(dense || strategy) of the decider's calls."""
    measured = [a for a in answers if not a["warmup"]]
    names = sorted({n for a in measured for n in a["answers"]}, key=_order)
    rows = []
    for name in names:
        both = [a for a in measured if name in a["answers"] and "dense" in a["answers"]]
        gold = [a for a in both if a["gold"] is not None]
        kls = [a["kl"][name] for a in both if (a.get("kl") or {}).get(name) is not None]
        rows.append({"strategy": name, "requests": len(both),
                     "decider_kl_mean": statistics.fmean(kls) if kls else None,
                     "same_as_dense": sum(a["answers"][name] == a["answers"]["dense"] for a in both) / len(both)
                     if both else None,
                     "accuracy": sum(a["answers"][name] == a["gold"] for a in gold) / len(gold) if gold else None})
    return rows


#: readers' KL below which a strategy is exact (exact prefixes, pipelined prefill): not a
#: candidate for "closest to dense", which it is by construction
EXACT_KL = 1e-6


def is_ablation(name: str) -> bool:
    """Whether strategy ``name`` is the default or re-rotation only with a setting changed (an
    ablation, not a competitor): every ``kvcomm-*`` strategy but the default and the paper's,
    and every ``rerotate-*`` one."""
    return name.startswith("kvcomm-") and name not in (DEFAULT, "kvcomm-paper") or name.startswith("rerotate-")


def fastest_and_closest(rows: list[dict]) -> dict[str, dict[str, Optional[str]]]:
    """Per phase: the strategy with the fastest whole graph, and, of the approximate ones (readers'
    KL above :data:`EXACT_KL`), the one with the lowest readers' KL (dense, the lower bound and
    the noise floor are references, ablations: none is a candidate)."""
    out = {}
    for phase in sorted({r["phase"] for r in rows}):
        candidates = [r for r in rows if r["phase"] == phase and r["strategy"] not in ("dense", "lower-bound")
                      and not r["strategy"].startswith("noise-floor") and not is_ablation(r["strategy"])]
        timed = [r for r in candidates if r["speedup_vs_dense"] is not None]
        fidel = [r for r in candidates if r["reader_kl_mean"] is not None and r["reader_kl_mean"] > EXACT_KL]
        out[phase] = {"fastest": max(timed, key=lambda r: r["speedup_vs_dense"])["strategy"] if timed else None,
                      "closest": min(fidel, key=lambda r: r["reader_kl_mean"])["strategy"] if fidel else None}
    return out



def summarize_by_format(records: list[dict]) -> dict[str, list[dict]]:
    """:func:`summarize_graphs` per prompt format measured, for workloads whose requests name
    one (``record["format"]``, as (j)'s do); empty for the others."""
    formats = sorted({r["format"] for r in records if r.get("format") and not r["warmup"]})
    return {name: summarize_graphs([r for r in records if r.get("format") == name]) for name in formats}


