"""Keep a paper grid's small result files in the repository: ``benchmarks/results/papers/<paper>/<run>/``.

``python benchmarks/paper_results.py <paper> RUN_DIRS...`` copies, for every run that
``train compare --paper <paper>`` counts (:func:`train.paper_tables.collect`), its ``config.json``,
its final ``results.parquet`` and the rows of its ``items.parquet`` that the table's columns read
(no checkpoint), replacing what the folder held. The page is then printed from them:
``train compare --paper <paper> --markdown benchmarks/results/papers/<paper>/* > docs/papers/<paper>.md``
(``tests/test_paper_pages.py`` checks the committed page is that output).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def keep(paper: str, runs: list[Path], out: Path) -> list[Path]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.io.atomic import write_parquet_atomic
    from train.eval.items import ITEMS_FILE
    from train.paper_tables import collect, column_value, load_table
    from train.seeds_table import final_rows

    table = load_table(paper)
    got = collect(table, runs)
    counted = [Path(r) for rs in got.runs.values() for r in rs]
    if out.exists():
        shutil.rmtree(out)
    kept = []
    for run in counted:
        dest = out / run.name / "eval" / "final"
        dest.mkdir(parents=True)
        shutil.copy2(run / "config.json", out / run.name / "config.json")
        shutil.copy2(run / "eval" / "final" / "results.parquet", dest / "results.parquet")
        rows = final_rows(run)
        keys = {v["key"] for c in table.columns for v in [column_value(c, rows)] if v is not None}
        items = run / "eval" / "final" / ITEMS_FILE
        if items.is_file():
            t = pq.read_table(items)
            key = pc.binary_join_element_wise(pc.cast(t["benchmark"], "string"), pc.cast(t["subset"], "string"),
                                              pc.cast(t["metric"], "string"), "\x1f")
            mask = pc.is_in(key, value_set=__import__("pyarrow").array(["\x1f".join(k) for k in sorted(keys)]))
            write_parquet_atomic(t.filter(mask), dest / ITEMS_FILE, compression="zstd")
        kept.append(out / run.name)
    return kept


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paper")
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/papers/<paper>")
    a = ap.parse_args(argv)
    out = a.out or ROOT / "benchmarks" / "results" / "papers" / a.paper
    kept = keep(a.paper, a.runs, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{len(kept)} runs kept under {out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
