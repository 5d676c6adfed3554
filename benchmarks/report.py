"""Summaries, printed tables and plots of benchmark records (see ``measure.py`` for the fields)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

DOWNSTREAM = "2..N"


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _p90(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _shared_text_share(records: list[dict]) -> Optional[float]:
    """Of the prompt tokens of the task and earlier agents' replies, the share served from cache."""
    mapped = [r for r in records if r.get("shared_text_tokens")]
    total = sum(r["shared_text_tokens"] for r in mapped)
    return sum(r["shared_text_reused"] for r in mapped) / total if total else None


def summarize_calls(records: list[dict]) -> dict:
    """Metrics of a group of calls (warm-up calls must already be left out)."""
    ttft = [r["ttft_s"] for r in records]
    eligible = [r for r in records if r["shared_found"] and not r["opted_out"]]
    prompt = sum(r["prompt_tokens"] for r in records)
    paired = [r["dense_ttft_s"] / r["ttft_s"] for r in records if r.get("dense_ttft_s")]
    handoff = [r["dense_ttft_s"] / r["handoff_s"] for r in records if r.get("dense_ttft_s") and r.get("handoff_s")]
    of_lb = [r["lower_bound_ttft_s"] / r["ttft_s"] for r in records if r.get("lower_bound_ttft_s")]
    kls = [r["kl"] for r in records if r.get("kl") is not None]
    # a window of 0 (dense itself left the forced reply at once) compares nothing: left out
    compared = [r for r in records if r.get("agree") is not None and r.get("agree_window", 1) > 0]
    agree = [float(r["agree"]) for r in compared]
    peaks = [r["peak_extra_bytes"] for r in records if r.get("peak_extra_bytes") is not None]
    return {
        "calls": len(records),
        "prompt_tokens_mean": prompt / len(records) if records else None,
        "ttft_median_ms": 1000 * _median(ttft) if ttft else None,
        "ttft_p90_ms": 1000 * _p90(ttft) if ttft else None,
        "speedup_vs_dense": _median(paired),
        # the previous agent's framed-version prefill charged to this call (sequential graphs)
        "handoff_speedup_vs_dense": _median(handoff),
        "share_of_lower_bound": _median(of_lb),
        "before_prefill_median_ms": 1000 * _median([r["before_prefill_s"] for r in records]) if records else None,
        "before_prefill_share_of_ttft": _median([r["before_prefill_s"] / r["ttft_s"] for r in records]),
        "reuse_rate": sum(r["fully_reused"] for r in eligible) / len(eligible) if eligible else None,
        "token_share": sum(r["reused_tokens"] for r in records) / prompt if prompt else None,
        "shared_text_share": _shared_text_share(records),
        "recomputed_tokens_mean": _mean([r["recomputed_tokens"] for r in records]),
        "kl_mean": _mean(kls),
        "kl_median": _median(kls),
        "agree_32": _mean(agree),
        "agree_window_mean": _mean([r["agree_window"] for r in compared]),
        "agree_compared": len(compared),
        "anchor_mib": max((r["anchor_bytes"] for r in records), default=0) / 2**20,
        "kv_mib": max((r["kv_bytes"] for r in records), default=0) / 2**20,
        "peak_extra_mib": max(peaks) / 2**20 if peaks else None,
    }


def warmup_cost(records: list[dict], target: float = 0.9) -> dict[str, Optional[int]]:
    """Per strategy, the requests (warm-up included, counted from 1) until the reuse rate
    reaches ``target`` for good: the first request from which every request's reuse rate
    (downstream calls with shared text and reuse allowed, fully reused) is at least ``target``.
    None: not reached within the run (the last request below it). Strategies without reuse
    eligibility (dense, the lower bound) are left out."""
    out: dict[str, Optional[int]] = {}
    for strategy in sorted({r["strategy"] for r in records}, key=_order):
        eligible = [r for r in records if r["strategy"] == strategy and r["shared_found"] and not r["opted_out"]
                    and r["agent_index"] > 1]
        if not eligible or strategy in ("dense", "lower-bound"):
            continue
        requests = sorted({r["request"] for r in eligible})
        rate = {q: _mean([float(r["fully_reused"]) for r in eligible if r["request"] == q]) for q in requests}
        reached = None
        for q in reversed(requests):
            if rate[q] < target:
                break
            reached = q
        out[strategy] = None if reached is None else requests.index(reached) + 1
    return out


def first_request(records: list[dict]) -> dict[str, dict]:
    """Per strategy, its readers (agents 2..N) on the phase's first request, when its engine has
    learned nothing (warm-up or not): the median over reader calls of dense's time to first
    token / the strategy's (same slot), the share of their prompt tokens served from cache and
    their mean first-token KL against dense.
    What a graph's first run, a new deployment, gets. Dense (the reference) and the lower bound
    (its first request prepares the exact KV it is given) are left out."""
    first = min((r["request"] for r in records), default=None)
    out: dict[str, dict] = {}
    for strategy in sorted({r["strategy"] for r in records}, key=_order):
        readers = [r for r in records if r["strategy"] == strategy and r["request"] == first and r["agent_index"] > 1]
        if strategy in ("dense", "lower-bound") or not readers:
            continue
        out[strategy] = {"reader_ttft_speedup": _median([r["dense_ttft_s"] / r["ttft_s"] for r in readers]),
                         "from_cache": sum(r["reused_tokens"] for r in readers) / max(1, sum(r["prompt_tokens"] for r in readers)),
                         "kl": _mean([r["kl"] for r in readers if r.get("kl") is not None]), "readers": len(readers)}
    return out


def summarize(records: list[dict]) -> list[dict]:
    """Rows per (phase, strategy, agent index), plus the downstream aggregate (agents 2..N)."""
    measured = [r for r in records if not r["warmup"]]
    keys = sorted({(r["phase"], r["strategy"]) for r in measured}, key=lambda k: (k[0], _order(k[1])))
    rows = []
    for phase, strategy in keys:
        mine = [r for r in measured if r["phase"] == phase and r["strategy"] == strategy]
        for index in sorted({r["agent_index"] for r in mine}):
            rows.append({"phase": phase, "strategy": strategy, "agent": index,
                         **summarize_calls([r for r in mine if r["agent_index"] == index])})
        rows.append({"phase": phase, "strategy": strategy, "agent": DOWNSTREAM,
                     **summarize_calls([r for r in mine if r["agent_index"] > 1])})
    return rows


def summarize_answers(answers: list[dict]) -> list[dict]:
    """Per strategy: final answers equal to the dense pipeline's, and task accuracy."""
    measured = [a for a in answers if not a["warmup"]]
    if not measured:
        return []
    names = list(measured[0]["answers"])
    rows = []
    for name in names:
        same = [a["answers"][name] == a["answers"].get("dense") for a in measured]
        gold = [a for a in measured if a["gold"] is not None]
        rows.append({
            "strategy": name, "requests": len(measured),
            "final_equal_to_dense": sum(same) / len(same),
            "accuracy": sum(a["answers"][name] == a["gold"] for a in gold) / len(gold) if gold else None,
        })
    return rows


_STRATEGY_ORDER = ["dense", "prefix", "pipelined", "rerotate-messages", "rerotate", "cacheblend", "kvcomm-messages", "kvcomm-mean", "kvcomm-replies-framed", "kvcomm-copies", "kvcomm-unframed", "kvcomm-weighted", "kvcomm-own-text",
                   "kvcomm-paper", "lower-bound"]


def _order(name: str) -> tuple:
    base = name.split("(")[0].strip()
    return (_STRATEGY_ORDER.index(base) if base in _STRATEGY_ORDER else len(_STRATEGY_ORDER), name)


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    return {"ms": f"{value:.1f}", "x": f"{value:.2f}x", "pct": f"{100 * value:.0f}%", "kl": f"{value:.4f}",
            "mib": f"{value:.0f}", "int": f"{value:.0f}"}[kind]


# ---- plots ----------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_by_agent(rows: list[dict], phase: str, title: str, path: Path) -> Path:
    """Median TTFT per agent index, one line per strategy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    mine = [r for r in rows if r["phase"] == phase and r["agent"] != DOWNSTREAM]
    for strategy in sorted({r["strategy"] for r in mine}, key=_order):
        points = sorted((r["agent"], r["ttft_median_ms"]) for r in mine if r["strategy"] == strategy)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=strategy)
    ax.set_yscale("log")
    ax.set_xlabel("agent index")
    ax.set_ylabel("median time to first token (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(sorted({r["agent"] for r in mine}))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_graph_speedups(rows: list[dict], path: Path, order: Optional[list[str]] = None,
                        labels: Optional[dict[str, str]] = None) -> Path:
    """Whole-graph speed-up over dense per workload, one group of bars per workload, one bar per
    strategy (rows of :func:`benchmarks.graph_report.summarize_graphs`), in ``order`` and named
    by ``labels`` where given."""
    plt = _pyplot()
    phases = sorted({r["phase"] for r in rows})
    strategies = sorted({r["strategy"] for r in rows if r["strategy"] != "dense"},
                        key=lambda s: (order.index(s),) if order and s in order else (len(order or ()), *_order(s)))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(phases)), 4.2))
    width = 0.8 / max(1, len(strategies))
    for i, strategy in enumerate(strategies):
        values = [next((r["speedup_vs_dense"] or 0 for r in rows if r["phase"] == p and r["strategy"] == strategy), 0)
                  for p in phases]
        ax.bar([j + i * width for j in range(len(phases))], values, width, label=(labels or {}).get(strategy, strategy))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], [f"({p})" for p in phases])
    ax.set_ylabel("whole-graph speed-up over dense")
    ax.set_title("What a user waits for: whole graphs, every cost counted", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
