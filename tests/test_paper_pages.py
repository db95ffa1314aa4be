"""Every committed docs/papers/<paper>.md is the output of `train compare --paper <paper> --markdown` on the
committed runs (benchmarks/results/papers/<paper>/: each run's config.json, results.parquet and the
items.parquet rows the table reads), so no number or tally on a page is typed by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "papers"
PAPERS = sorted(p.name for p in RESULTS.iterdir() if p.is_dir()) if RESULTS.is_dir() else []


def test_the_committed_papers_have_runs():
    assert set(PAPERS) == {"infoground", "visual-tokens", "concept-ot", "c3", "text-groups"}


@pytest.mark.parametrize("paper", PAPERS)
def test_the_page_is_the_codes_output_on_the_committed_runs(paper, monkeypatch):
    from train.paper_pages import compare_paper

    monkeypatch.chdir(ROOT)
    runs = sorted(str(p.relative_to(ROOT)) for p in (RESULTS / paper).iterdir())
    page = compare_paper(paper, runs, markdown=True)
    committed = (ROOT / "docs" / "papers" / f"{paper}.md").read_text()
    assert page + "\n" == committed, (  # typer.echo ends the page with one newline
        f"docs/papers/{paper}.md is not the code's output: regenerate it with `train compare --paper {paper} "
        f"--markdown benchmarks/results/papers/{paper}/* > docs/papers/{paper}.md`")
    tally = page.split("**Tally: ", 1)[1].split(".**", 1)[0]
    assert tally.count("comparisons with the reference row") == 1
