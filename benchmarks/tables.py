"""``python -m benchmarks.tables SUMMARY.json [--front]``: the Markdown tables the docs quote, made
from a committed run summary (``python -m benchmarks --summary``), so every figure in the README
and ``docs/benchmarks.md`` traces to a file. A test regenerates every block marked

    <!-- generated: python -m benchmarks.tables benchmarks/results/<name>.json [--front] -->
    ...
    <!-- end generated -->

in those pages and fails when a block differs from its file.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .graph_report import front_table, workload_tables

__all__ = ["render", "generated_blocks", "main"]

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"<!-- generated: python -m benchmarks\.tables (?P<path>\S+)(?P<front> --front)? -->\n"
                    r"(?P<body>.*?)\n<!-- end generated -->", re.S)


def render(summary: dict, *, front: bool) -> str:
    """The front table (one row per workload) or every workload's table, with the run's sample."""
    versions = summary["versions"]
    head = (f"Run: commit `{versions['commit'][:12]}`, {summary['model']} model, {summary['dtype']}, "
            f"{versions['device']} ({versions['threads']} threads), profile `{summary['profile']['name']}`, "
            f"{summary['split']} range.\n\n")
    return head + (front_table(summary) if front else workload_tables(summary))


def generated_blocks(text: str) -> list[tuple[str, bool, str]]:
    """``(summary path, front, body)`` of every generated block of a page."""
    return [(m["path"], bool(m["front"]), m["body"]) for m in _BLOCK.finditer(text)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tables", description=__doc__.split("\n")[0])
    parser.add_argument("summary", type=Path)
    parser.add_argument("--front", action="store_true", help="the front table only (one row per workload)")
    args = parser.parse_args(argv)
    print(render(json.loads(args.summary.read_text()), front=args.front))


if __name__ == "__main__":
    main()
