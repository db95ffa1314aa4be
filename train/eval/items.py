"""Per-item estimates beside each run's results: ``<eval dir>/items.parquet``.

Whenever the harness writes ``results.parquet`` (:func:`train.eval.harness.run_harness`: ``train run``'s
final evaluation, ``train eval --checkpoint``), it writes ``items.parquet`` beside it: for every
results row that has a per-item estimate (:class:`train.eval.intervals.Estimate`, ``Row.est``), one
row per scored item, so that two runs evaluated on the same items can be differenced item by item
later (:func:`train.eval.intervals.paired_difference` on the two runs' estimates, as
``train compare --paper`` does, :mod:`train.paper_tables`). Columns:

==========================  ===================================================================
``benchmark, subset,        the results row the item belongs to (its key in results.parquet)
metric``
``item``                    the item's position in the row's estimate (int32; the same items of
                            the same benchmark come in the same order in every run)
``cluster``                 the item's image (the unit the bootstrap resamples), as a string
``cluster2``                the second image of a two-way clustered AUC item (its negative's), else null
``group``                   the macro group the item is averaged in ("0" for a plain mean)
``y``                       the outcome: 0/1 for a proportion, the value for a mean, the positive's
                            score for an AUC
``neg``                     an AUC item's negative score, else null
``w``                       the item's weight in the row's value (``value = sum(w * y)`` in the
                            estimate's unit, before the row's scale)
``binary``                  the row's estimate is a proportion (Wilson) rather than a mean
==========================  ===================================================================

Strings are dictionary-encoded and the file zstd-compressed: a testbed run's file is tens of KB.
A row without an estimate (a job metric with no per-item outcomes) has no items.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

ITEMS_FILE = "items.parquet"
ITEM_COLUMNS = ("benchmark", "subset", "metric", "item", "cluster", "cluster2", "group", "y", "neg", "w", "binary")


def _schema():
    import pyarrow as pa

    d = pa.dictionary(pa.int32(), pa.string())
    return pa.schema([("benchmark", d), ("subset", d), ("metric", d), ("item", pa.int32()), ("cluster", d),
                      ("cluster2", d), ("group", d), ("y", pa.float64()), ("neg", pa.float64()),
                      ("w", pa.float64()), ("binary", pa.bool_())])


def items_table(rows: Sequence):
    """The items of every row (a :class:`train.eval.interface.Row`) that carries an ``est``, as an Arrow table."""
    import pyarrow as pa

    cols: dict[str, list] = {c: [] for c in ITEM_COLUMNS}
    for r in rows:
        est = getattr(r, "est", None)
        if est is None or est.n == 0:
            continue
        n = est.n
        for c, v in (("benchmark", r.benchmark), ("subset", r.subset), ("metric", r.metric)):
            cols[c].append(np.full(n, str(v), dtype=object))
        cols["item"].append(np.arange(n, dtype=np.int32))
        cols["cluster"].append(np.asarray([str(c) for c in est.cluster], dtype=object))
        cols["cluster2"].append(np.full(n, None, dtype=object) if est.cluster2 is None
                                else np.asarray([str(c) for c in est.cluster2], dtype=object))
        cols["group"].append(np.asarray([str(g) for g in est.group], dtype=object))
        cols["y"].append(np.asarray(est.y, dtype=np.float64))
        cols["neg"].append(np.full(n, np.nan) if est.neg is None else np.asarray(est.neg, dtype=np.float64))
        cols["w"].append(np.asarray(est.w, dtype=np.float64))
        cols["binary"].append(np.full(n, bool(est.binary)))
    schema = _schema()
    if not cols["item"]:
        return schema.empty_table()
    arrays = []
    for f in schema:
        v = np.concatenate(cols[f.name])
        if f.name == "neg":
            arrays.append(pa.array(v, type=pa.float64(), mask=np.isnan(v)))
        elif pa.types.is_dictionary(f.type):
            arrays.append(pa.array(v.tolist(), type=pa.string()).dictionary_encode())
        else:
            arrays.append(pa.array(v, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_items(rows: Sequence, out_dir: Path) -> Path:
    """``out_dir/items.parquet`` of ``rows`` (zstd; a schema-only file when no row has items)."""
    from pipeline.io.atomic import write_parquet_atomic

    path = Path(out_dir) / ITEMS_FILE
    write_parquet_atomic(items_table(rows), path, compression="zstd")
    return path


def read_items(path: Path) -> dict[tuple[str, str, str], object]:
    """{(benchmark, subset, metric): its :class:`~train.eval.intervals.Estimate`} of an items.parquet
    (raises :class:`pipeline.io.run_files.CorruptRunFile`, one line naming the file, when it cannot be read)."""
    import pyarrow.parquet as pq

    from pipeline.io.run_files import CorruptRunFile
    from train.eval.intervals import Estimate

    try:
        t = pq.read_table(path)
        missing = [c for c in ITEM_COLUMNS if c not in t.column_names]
        if missing:
            raise ValueError(f"no column(s) {', '.join(missing)}")
        d = {c: t.column(c).to_pylist() if c in ("benchmark", "subset", "metric", "cluster", "cluster2", "group")
             else t.column(c).to_numpy(zero_copy_only=False) for c in ITEM_COLUMNS}
    except (OSError, ValueError) as e:
        raise CorruptRunFile(f"{path}: cannot be read as per-item estimates ({type(e).__name__}: {e}); "
                             "re-evaluate the run with `train eval <job> --manifest M --checkpoint RUN_DIR --out RUN_DIR/eval/final`") from None
    keys = list(zip(d["benchmark"], d["subset"], d["metric"]))
    out: dict[tuple[str, str, str], object] = {}
    start = 0
    for end in range(1, len(keys) + 1):
        if end < len(keys) and keys[end] == keys[start]:
            continue
        sl = slice(start, end)
        order = np.argsort(d["item"][sl], kind="stable")
        pick = lambda c: [d[c][sl][k] for k in order] if isinstance(d[c], list) else np.asarray(d[c][sl])[order]  # noqa: E731
        neg = np.asarray(pick("neg"), dtype=np.float64)
        c2 = pick("cluster2")
        out[keys[start]] = Estimate(np.asarray(pick("y"), np.float64), np.asarray(pick("w"), np.float64),
                                    np.asarray(pick("group"), dtype=object), np.asarray(pick("cluster"), dtype=object),
                                    bool(d["binary"][start]), None if np.isnan(neg).all() else neg,
                                    None if all(c is None for c in c2) else np.asarray(c2, dtype=object))
        start = end
    return out
