"""Whole-graph summaries of :mod:`benchmarks.graph` records: per workload and strategy, what a
user waits for (the graph's wall time), what it costs (tokens forwarded), how close it comes
to the workload's limit, beside the readers' time to first token and fidelity."""

from __future__ import annotations

import statistics
from typing import Optional

from .report import _order, summarize_calls

__all__ = ["summarize_graphs", "further_by_agent", "summarize_decisions", "summarize_by_format", "format_graphs", "format_table",
           "fastest_and_closest", "noise_floor_readers", "noise_floor_line", "phase_console", "GRAPH_LEGEND"]


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


def further_by_agent(summary: dict, strategy: str = "kvcomm-mean", reference: str = "rerotate") -> dict[str, float]:
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


def _floor_dtype(summary: dict) -> str:
    """The dtype the run's noise floor ran dense in, short ("bf16" where none ran)."""
    names = [p["noise_floor"]["strategy"] for p in summary["phases"].values() if (p.get("noise_floor") or {}).get("every_reader")]
    dtype = names[0].split("dense ")[-1].rstrip(")") if names else "bfloat16"
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def noise_floor_line(floor: dict) -> str:
    """One sentence on :func:`noise_floor_readers`' figures."""
    whose = "the same reader calls" if floor.get("every_reader", True) else "the deciding agent's calls"
    return (f"Dense in {floor['strategy'].split('dense ')[-1].rstrip(')')}, {whose} (the noise floor: "
            f"drift that is not reuse's): KL {_f(floor['kl_mean'], 'kl')}, 32-token agreement "
            f"{_f(floor['agree_32'], 'pct')} ({floor['calls']} calls).")


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


def _f(value, kind: str) -> str:
    if value is None:
        return "-"
    return {"s": f"{value:.1f}", "x": f"{value:.2f}x", "pct": f"{100 * value:.0f}%", "kl": f"{value:.4f}",
            "n": f"{value:,.0f}", "ms": f"{value:.0f}"}[kind]


GRAPH_COLUMNS = [("strategy", "strategy", None), ("graph s", "wall_median_s", "s"), ("x dense", "speedup_vs_dense", "x"),
                 ("of limit", "share_of_limit", "pct"), ("tokens", "tokens_mean", "n"),
                 ("x dense tok", "tokens_vs_dense", "x"), ("TPOT ms", "tpot_ms", "ms"),
                 ("reader TTFT x", "reader_ttft_speedup", "x"), ("from start x", "reader_from_start_speedup", "x"),
                 ("reader KL", "reader_kl_mean", "kl"),
                 ("agree 32", "reader_agree_32", "pct"), ("reuse", "reuse_rate", "pct"),
                 ("from cache", "shared_text_share", "pct")]


def format_graphs(rows: list[dict]) -> str:
    """A plain-text table of :func:`summarize_graphs` rows (one phase)."""
    cells = [[h for h, _, _ in GRAPH_COLUMNS]]
    cells += [[str(r[k]) if kind is None else _f(r.get(k), kind) for _, k, kind in GRAPH_COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def phase_console(phase: str, result: dict) -> str:
    """What ``python -m benchmarks`` prints for one phase: its table, verdict, decisions, end-to-end
    answers, formats, noise floor, first request and warm-up cost, as plain text."""
    out = []
    requests = result["requests"]
    out.append(f"\n== ({phase}) {result['title']}: {requests['measured']} measured requests after {requests['warmup']} "
               f"warm-up, {result['elapsed_s']:.0f} s ==")
    if result["graphs"]:
        out.append(format_graphs(result["graphs"]))
        verdict = result.get("verdict") or {}
        out.append(f"  fastest whole graph: {verdict.get('fastest')}; closest to dense of the approximate ones (readers' KL): {verdict.get('closest')}")
    for row in result.get("decisions") or []:
        same = "-" if row["same_as_dense"] is None else f"{100 * row['same_as_dense']:.0f}%"
        accuracy = "-" if row["accuracy"] is None else f"{100 * row['accuracy']:.0f}%"
        out.append(f"  decider {row['strategy']:<16} picks what it picks under dense in {same} of {row['requests']} "
                   f"requests, accuracy {accuracy}")
    for name, wall in (result.get("pipeline_wall") or {}).items():
        ratio = "-" if wall["speedup_vs_dense"] is None else f"{wall['speedup_vs_dense']:.2f}x"
        out.append(f"  end to end {name:<14} wall time per pipeline (median of {wall['requests']}): "
                   f"{wall['median_s']:.1f} s, {ratio} dense")
    for answer in result.get("answers") or []:
        accuracy = "-" if answer["accuracy"] is None else f"{100 * answer['accuracy']:.0f}%"
        out.append(f"  end to end {answer['strategy']:<14} final answer = dense pipeline's "
                   f"{100 * answer['final_equal_to_dense']:.0f}%  accuracy {accuracy}  ({answer['requests']} requests)")
    if result.get("by_format"):
        out.append("  per prompt format (graph x dense, readers' TTFT x dense, readers' KL):")
        out.append("\n".join("  " + line for line in format_table(result["by_format"]).split("\n")))
    if result.get("noise_floor"):
        out.append("  " + noise_floor_line(result["noise_floor"]))
    first = result.get("first_request") or {}
    if first:
        out.append("  first request (nothing learned yet), readers' TTFT x dense, from cache, KL: "
                   + ", ".join(f"{name} {row['reader_ttft_speedup']:.2f}x {100 * row['from_cache']:.0f}% "
                               f"{row['kl'] if row['kl'] is None else round(row['kl'], 4)}"
                               for name, row in first.items()))
    cost = result.get("warmup_cost") or {}
    if cost:
        out.append("  warm-up cost (requests until every later request reuses >= 90% of its eligible calls): "
                   + ", ".join(f"{name} {'not reached' if n is None else n}" for name, n in cost.items()))
    return "\n".join(out)


GRAPH_LEGEND = (
    "graph s: median whole-graph wall time per request (every call, its copies, audits and what was computed "
    "ahead; strategies take turns); x dense: median over requests of dense's graph time / the strategy's; "
    "of limit: time saved as a share of what the lower bound (shared text's prefill removed) saves; tokens: "
    "tokens forwarded through the model per graph (counted by a hook on the model); TPOT: time per output token "
    "after the first, everything after it included; reader TTFT x / KL / agree 32: agents 2..N against dense on "
    "the same ids; from start x: the readers' first token counted from the graph's start (the calls before "
    "them included), median ratio to dense's; reuse: calls with no shared text prefilled; from cache: the task's and replies' tokens "
    "served from cache.")


# ---- Markdown: the front table of docs/benchmarks.md, generated from a run's summary JSON ----
LABELS = {"dense": "dense", "prefix": "exact prefix", "pipelined": "pipelined exact prefill",
          "rerotate": "re-rotation only", "cacheblend": "CacheBlend-style 15%", "kvcomm-paper": "KVCOMM as in the paper",
          "kvcomm-mean": "**default**", "lower-bound": "limit (no shared prefill)",
          "kvcomm-mean-tail-0": "default without the run tail (`recompute_tail=0`)",
          "kvcomm-mean-last-0": "default without the last run computed (`recompute_last_run=0`)",
          "kvcomm-trust-clear": "default trusting re-rotation on a clear sample (`rerotation_trust=\"clear_sample\"`)",
          "kvcomm-remembered": "default, measurements remembered from earlier engines (`remember_measurements`)",
          "kvcomm-no-short-sample": "default without the short first sample (`short_rerotation_sample=False`)",
          "kvcomm-no-drafts": "default without drafts (`draft_tokens=0`)",
          "kvcomm-own-drafts": "default, drafts from the call's own ids only (`draft_recent_replies=0`)",
          "kvcomm-rerotate-replies": "default, replies re-rotated alone too (`rerotate_replies=True`)",
          "kvcomm-no-spans": "default, texts matched alone (`shared_runs=\"anywhere\"`)",
          "kvcomm-no-cut-head": "default, runs cut inside their text with the plain head (`recompute_cut_head=0`)",
          "rerotate-no-spans": "re-rotation only, texts matched alone (`shared_runs=\"anywhere\"`)",
          "kvcomm-kv-concatenated": "default, each step's KV concatenated (`kv_in_place=False`)",
          "dense-drafted": "dense prefill, drafted decode"}
DEFAULT = "kvcomm-mean"


def _label(name: str) -> str:
    return LABELS.get(name, name)


def front_table(summary: dict) -> str:
    """One row per workload: dense's whole-graph time, the default's and the fastest
    competitor's speed-up, the limit, the default's share of it and its compute, the readers'
    TTFT speed-up and KL (re-rotation only's beside it, and dense in bf16's where the run measured
    it on every reader: ``--noise-floor``), the verdict."""
    out = ["| workload | requests | dense graph s | default × dense | fastest other (× dense) | limit × dense | "
           "default: % of limit | default tokens × dense | default reader TTFT × (from the graph's start) | "
           f"default KL (re-rotation's; dense in {_floor_dtype(summary)}) | fastest / closest approximate |",
           "|---" * 11 + "|"]
    for phase, info in summary["phases"].items():
        rows = {r["strategy"]: r for r in info.get("graphs", [])}
        if DEFAULT not in rows or "dense" not in rows:
            continue
        d, base = rows[DEFAULT], rows["dense"]
        others = [r for n, r in rows.items() if n not in ("dense", DEFAULT, "lower-bound")
                  and not n.startswith("noise-floor") and not is_ablation(n)
                  and r["speedup_vs_dense"] is not None]
        best = max(others, key=lambda r: r["speedup_vs_dense"], default=None)
        limit = rows.get("lower-bound", {}).get("speedup_vs_dense")
        rerotate = rows.get("rerotate", {}).get("reader_kl_mean")
        verdict = fastest_and_closest(info["graphs"]).get(phase, {})
        floor = info.get("noise_floor") or {}
        floor_kl = f"; {_f(floor['kl_mean'], 'kl')}" if floor.get("every_reader") else ""
        out.append(
            f"| ({phase}) {info['title'].split(') ', 1)[-1]} | {d['requests']} | {_f(base['wall_median_s'], 's')} | "
            f"**{_f(d['speedup_vs_dense'], 'x')}** | "
            + (f"{_label(best['strategy'])} ({_f(best['speedup_vs_dense'], 'x')})" if best else "-")
            + f" | {_f(limit, 'x')} | {_f(d['share_of_limit'], 'pct')} | {_f(d['tokens_vs_dense'], 'x')} | "
            f"{_f(d['reader_ttft_speedup'], 'x')} ({_f(d.get('reader_from_start_speedup'), 'x')}) | "
            f"{_f(d['reader_kl_mean'], 'kl')} ({_f(rerotate, 'kl')}{floor_kl}) | "
            f"{_label(verdict.get('fastest'))} / {_label(verdict.get('closest'))} |")
    return "\n".join(out)


def side_by_side(summary: dict) -> str:
    """One row per workload: dense's whole-graph time and time per output token, then per other
    strategy its graph × dense, tokens × dense and time per output token."""
    phases = [info for info in summary["phases"].values() if info.get("graphs")]
    names = list(dict.fromkeys(r["strategy"] for info in phases for r in info["graphs"] if r["strategy"] != "dense"))
    out = ["| workload | requests | dense graph s (TPOT ms) | " + " | ".join(_label(n) for n in names) + " |",
           "|---" * (len(names) + 3) + "|",
           "| | | | " + " | ".join("graph × dense, tokens × dense, TPOT ms" for _ in names) + " |"]
    for phase, info in summary["phases"].items():
        rows = {r["strategy"]: r for r in info.get("graphs", [])}
        if "dense" not in rows:
            continue
        base = rows["dense"]
        out.append(f"| ({phase}) {info['title'].split(') ', 1)[-1]} | {base['requests']} | "
                   f"{_f(base['wall_median_s'], 's')} ({_f(base.get('tpot_ms'), 'ms')}) | " + " | ".join(
                       f"{_f(rows[n]['speedup_vs_dense'], 'x')}, {_f(rows[n]['tokens_vs_dense'], 'x')}, "
                       f"{_f(rows[n].get('tpot_ms'), 'ms')}" if n in rows else "-" for n in names) + " |")
    return "\n".join(out)


def summarize_by_format(records: list[dict]) -> dict[str, list[dict]]:
    """:func:`summarize_graphs` per prompt format measured, for workloads whose requests name
    one (``record["format"]``, as (j)'s do); empty for the others."""
    formats = sorted({r["format"] for r in records if r.get("format") and not r["warmup"]})
    return {name: summarize_graphs([r for r in records if r.get("format") == name]) for name in formats}


def format_table(by_format: dict[str, list[dict]]) -> str:
    """Markdown: one row per prompt format, per strategy but dense its graph × dense, readers'
    TTFT × dense and readers' KL."""
    names = [r["strategy"] for r in next(iter(by_format.values()), []) if r["strategy"] != "dense"]
    out = ["| format | requests | " + " | ".join(_label(n) for n in names) + " |", "|---" * (len(names) + 2) + "|"]
    for name, rows in by_format.items():
        row = {r["strategy"]: r for r in rows}
        out.append(f"| {name} | {row['dense']['requests']} | " + " | ".join(
            f"{_f(row[n]['speedup_vs_dense'], 'x')}, {_f(row[n]['reader_ttft_speedup'], 'x')}, "
            f"{_f(row[n]['reader_kl_mean'], 'kl')}" if n in row else "-" for n in names) + " |")
    return "\n".join(out)


def workload_tables(summary: dict) -> str:
    """Every workload's whole-graph rows, every strategy, and the decisions where the last agent decides."""
    out = []
    for phase, info in summary["phases"].items():
        if not info.get("graphs"):
            continue
        requests, everyone = info["requests"], info["graphs"][0]["requests"]
        subset = (f" (the graph rows: the {everyone} that every strategy ran)"
                  if everyone != requests["measured"] else "")
        out.append(f"#### ({phase}) {info['title'].split(') ', 1)[-1]}: {requests['measured']} measured requests "
                   f"after {requests['warmup']} warm-up{subset}\n")
        out.append("| " + " | ".join(h for h, _, _ in GRAPH_COLUMNS) + " |")
        out.append("|---" * len(GRAPH_COLUMNS) + "|")
        for r in info["graphs"]:
            out.append("| " + " | ".join(_label(r[k]) if kind is None else _f(r.get(k), kind) for _, k, kind in GRAPH_COLUMNS)
                       + " |")
        if info.get("first_request"):
            out.append("\nFirst request, nothing learned yet (readers' TTFT × dense, their prompt tokens from cache, "
                       "KL): " + "; ".join(
                f"{_label(name)} {_f(row['reader_ttft_speedup'], 'x')}, {_f(row['from_cache'], 'pct')}, "
                f"{_f(row.get('kl'), 'kl')}"
                for name, row in info["first_request"].items()) + ".")
        if info.get("noise_floor"):
            out.append("\n" + noise_floor_line(info["noise_floor"]))
        further = further_by_agent({"phases": {phase: info}}, strategy=DEFAULT, reference="rerotate").get(phase)
        if further is not None:
            out.append(f"\nPer agent index, the {_label(DEFAULT)}'s readers' mean KL against {_label('rerotate')}'s at the "
                       f"same index: at most {further:+.1e} (negative: closer at every index).")
        if info.get("by_format"):
            out.append("\nPer prompt format (graph × dense, readers' TTFT × dense, readers' KL):\n")
            out.append(format_table(info["by_format"]))
        if info.get("decisions"):
            out.append("\n| decider under | picks as under dense | decider's first-token KL | accuracy | requests |\n"
                       "|---|---|---|---|---|")
            for r in info["decisions"]:
                out.append(f"| {_label(r['strategy'])} | {_f(r['same_as_dense'], 'pct')} | "
                           f"{_f(r.get('decider_kl_mean'), 'kl')} | {_f(r['accuracy'], 'pct')} | {r['requests']} |")
        out.append("")
    return "\n".join(out)
