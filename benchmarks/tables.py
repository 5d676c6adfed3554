"""``python -m benchmarks.tables SUMMARY.json [--front | --side-by-side] [--phases b,i] [--plot PNG]``: the Markdown tables the docs quote, made
from a committed run summary (``python -m benchmarks --summary``), so every figure in the README
and ``docs/benchmarks.md`` traces to a file. A test regenerates every block marked

    <!-- generated: python -m benchmarks.tables benchmarks/results/<name>.json [--front | --side-by-side] [--phases b,i] -->
    ...
    <!-- end generated -->

in those pages and fails when a block differs from its file; ``python -m benchmarks.tables
--rewrite README.md docs/benchmarks.md`` regenerates them in place after a new run. ``--plot``
draws the summary's whole-graph speed-ups as bars (``--strategies``: only these, in that order).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Optional

from .graph_tables import LABELS, front_table, side_by_side, workload_tables
from .provenance import device_text

__all__ = ["render", "generated_blocks", "rewrite", "plot", "main"]

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(?P<opening><!-- generated: python -m benchmarks\.tables (?P<path>\S+)(?: --(?P<table>front|side-by-side))?"
                    r"(?: --phases (?P<phases>\S+))? -->)\n(?P<body>(?:(?!<!-- generated:).)*?)\n?<!-- end generated -->",
                    re.S)  # a body never runs into the next block; an empty one is a block too


def render(summary: dict, *, table: Optional[str] = None, phases: Optional[list[str]] = None) -> str:
    """Every workload's table, or (``table``) the front table or every strategy side by side (one
    row per workload each), with the run's sample; only ``phases`` where given. A
    parallel-branches summary (:mod:`.parallel_branches`) is its one table; a held-out shapes
    summary (:mod:`.held_out_shapes`) its shapes' tables."""
    if summary.get("kind") == "parallel_branches":
        from .parallel_branches import described

        return described(summary)
    if summary.get("kind") == "held_out_shapes":
        from .held_out_shapes import described

        return described(summary)
    if phases:
        summary = {**summary, "phases": {p: v for p, v in summary["phases"].items() if p in phases}}
    versions = summary["versions"]
    head = (f"Run: commit `{versions['commit'][:12]}`, {summary['model']} model, {summary['dtype']}, "
            f"{device_text(versions)}, profile `{summary['profile']['name']}`, "
            f"{summary['split']} range"
            + (", every request on fresh engines (each a graph's first)" if summary.get("cold") else "")
            + (", `kvcomm-remembered` starting from the measurements earlier engines left (`--remembered`)"
               if summary.get("remembered") else "") + ".\n\n")
    return head + {"front": front_table, "side-by-side": side_by_side}.get(table, workload_tables)(summary)


def generated_blocks(text: str) -> list[tuple[str, Optional[str], Optional[list[str]], str]]:
    """``(summary path, table, phases, body)`` of every generated block of a page."""
    return [(m["path"], m["table"], m["phases"].split(",") if m["phases"] else None, m["body"])
            for m in _BLOCK.finditer(text)]


def rewrite(page: Path) -> int:
    """Regenerate every generated block of ``page`` in place from its summary file; returns how
    many blocks changed."""
    text = page.read_text()
    changed = 0

    def fresh(match: re.Match) -> str:
        nonlocal changed
        summary = json.loads((ROOT / match["path"]).read_text())
        body = render(summary, table=match["table"], phases=match["phases"].split(",") if match["phases"] else None)
        changed += body != match["body"]
        return f"{match['opening']}\n{body}\n<!-- end generated -->"

    page.write_text(_BLOCK.sub(fresh, text))
    return changed


def plot(summary: dict, path: Path, strategies: Optional[list[str]] = None) -> Path:
    """The summary's whole-graph speed-up over dense, a group of bars per workload
    (:func:`benchmarks.report.plot_graph_speedups`), only ``strategies`` where given."""
    from .report import plot_graph_speedups

    if summary.get("kind") or "phases" not in summary:
        raise ValueError("--plot draws a benchmark run's summary (python -m benchmarks --summary), "
                         f"not a {summary.get('kind', 'file without phases')}")
    rows = [r for phase in summary["phases"].values() for r in phase.get("graphs") or []
            if strategies is None or r["strategy"] in strategies or r["strategy"] == "dense"]
    if not any(r["strategy"] != "dense" for r in rows):
        raise ValueError(f"nothing to draw: no strategy {'of ' + ', '.join(strategies) + ' ' if strategies else ''}"
                         "beside dense in the summary's workloads")
    labels = {name: label.replace("*", "").replace("`", "") for name, label in LABELS.items()}
    return plot_graph_speedups(rows, path, order=strategies, labels=labels)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables", description=__doc__.split("\n")[0])
    parser.add_argument("summary", type=Path, nargs="?")
    parser.add_argument("--rewrite", nargs="+", type=Path, metavar="PAGE",
                        help="regenerate every generated block of these pages in place (no summary argument)")
    tables = parser.add_mutually_exclusive_group()
    tables.add_argument("--front", action="store_const", const="front", dest="table",
                        help="the front table only (one row per workload)")
    tables.add_argument("--side-by-side", action="store_const", const="side-by-side", dest="table",
                        help="every strategy's whole graph side by side (one row per workload)")
    parser.add_argument("--phases", default=None, help="comma-separated: only these workloads")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="also draw the whole-graph speed-ups to this image")
    parser.add_argument("--strategies", default=None, help="comma-separated: the plot's strategies, in order")
    args = parser.parse_args(argv)
    if args.strategies and args.plot is None:
        parser.error("--strategies chooses the plot's bars: give --plot too")
    if args.rewrite:
        for page in args.rewrite:
            print(f"{page}: {rewrite(page)} block(s) changed")
        return
    if args.summary is None:
        parser.error("give a summary file, or --rewrite PAGE...")
    summary = json.loads(args.summary.read_text())
    phases = args.phases.split(",") if args.phases else None
    print(render(summary, table=args.table, phases=phases))
    if args.plot is not None:
        if phases:
            summary = {**summary, "phases": {p: v for p, v in summary["phases"].items() if p in phases}}
        chosen = [name.strip() for name in args.strategies.split(",")] if args.strategies else None
        try:
            print(f"written {plot(summary, args.plot, chosen)}")
        except ValueError as error:
            parser.error(str(error))


if __name__ == "__main__":
    main()
