"""Text of the whole-graph summaries (:mod:`benchmarks.graph_report`): the console table a run
prints per workload, and the Markdown tables the docs quote (the front table, every strategy
side by side, each workload's rows, per prompt format), made from a run's summary JSON."""

from __future__ import annotations

from .graph_report import DEFAULT, fastest_and_closest, further_by_agent, is_ablation

__all__ = ["GRAPH_LEGEND", "LABELS", "format_graphs", "format_table", "front_table", "noise_floor_line",
           "phase_console", "side_by_side", "workload_tables"]


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
    """A plain-text table of :func:`.graph_report.summarize_graphs` rows (one phase)."""
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
