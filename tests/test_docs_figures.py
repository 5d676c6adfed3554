"""Every figure table in the README and docs/benchmarks.md is generated from a committed run
summary (benchmarks/results/): regenerated here, it must be what the page says."""

import json

import pytest

from benchmarks.tables import ROOT, generated_blocks, render

PAGES = ["README.md", "docs/benchmarks.md"]


@pytest.mark.parametrize("page", PAGES)
def test_generated_tables_match_their_summary_files(page):
    blocks = generated_blocks((ROOT / page).read_text())
    assert blocks, f"{page} quotes no generated table"
    for path, table, phases, body in blocks:
        summary = json.loads((ROOT / path).read_text())
        # the report range; held-out shapes draw from it too, and quote the split no rule was probed on
        held_out = summary.get("kind") == "held_out_shapes"
        assert summary["split"] == ("unseen" if held_out else "report"), f"{path}: figures must come from held-out data"
        assert body == render(summary, table=table, phases=phases), f"{page}: the table from {path} is stale"


def test_a_changed_figure_is_caught():
    text = (ROOT / "docs/benchmarks.md").read_text()
    path, table, phases, body = generated_blocks(text)[0]
    summary = json.loads((ROOT / path).read_text())
    summary["phases"][next(iter(summary["phases"]))]["graphs"][0]["wall_median_s"] += 1.0
    assert render(summary, table=table, phases=phases) != body


def test_rewrite_regenerates_a_stale_block_in_place(tmp_path):
    from benchmarks.tables import rewrite

    text = (ROOT / "docs/benchmarks.md").read_text()
    path, table, phases, body = generated_blocks(text)[0]
    page = tmp_path / "page.md"
    page.write_text(text.replace(body, "a stale table", 1))
    assert rewrite(page) == 1 and page.read_text() == text
    assert rewrite(page) == 0


def _first_block() -> tuple[str, str, str]:
    """docs/benchmarks.md's text, its first generated block's opening marker, and that block's body."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    path, table, phases, body = generated_blocks(text)[0]
    marker = f"<!-- generated: python -m benchmarks.tables {path}{' --' + table if table else ''}" \
             f"{' --phases ' + ','.join(phases) if phases else ''} -->"
    return text, marker, body


def test_a_block_written_empty_never_takes_the_next_block_with_it(tmp_path):
    from benchmarks.tables import rewrite

    text, marker, body = _first_block()
    page = tmp_path / "page.md"
    page.write_text(f"Intro.\n\n{marker}\n<!-- end generated -->\n\nProse between.\n\n{text}")
    rewrite(page)
    assert "Prose between." in page.read_text() and page.read_text().endswith(text)
    assert page.read_text().startswith(f"Intro.\n\n{marker}\n{body}\n<!-- end generated -->\n")  # filled


def test_a_placeholder_body_is_replaced_and_the_markers_kept(tmp_path):
    """A block's body may be text its markers contain ("-"): only the body is replaced."""
    from benchmarks.tables import rewrite

    text, marker, body = _first_block()
    page = tmp_path / "page.md"
    page.write_text(f"{marker}\n-\n<!-- end generated -->\n")
    rewrite(page)
    assert page.read_text() == f"{marker}\n{body}\n<!-- end generated -->\n"
