"""One row count per artifact, and what one row is: the number `pipeline status`, the end of
`pipeline run all`, a stage's progress lines and the run report all print for an artifact.

An artifact holds several tables (``samples`` has images, captions, instances, phrases and
relations); summing them, or picking a different one in each place, made the same artifact show
1,393 rows in one place and 63 in another. Each stage's artifact is counted by one table instead,
named here with the unit it counts (``400 images``, ``10,274 concept rows``).
"""

from __future__ import annotations

# stage -> (the table counted, what one of its rows is)
COUNTED: dict[str, tuple[str, str]] = {
    "ingest": ("samples", "images"),
    "extract-clip-tokens": ("images", "images"),
    "extract-image-groups": ("images", "images"),
    "extract-regions": ("shards", "images"),
    "extract-visual-tokens": ("shards", "images"),
    "build-index": ("image_negatives", "images"),
    "mine-concepts": ("concepts", "concept rows"),
    "encode-concepts": ("index", "concepts"),
    "negative-captions": ("negatives", "nouns"),
}


# (stage, table) -> what one row of a table other than the counted one is, for a unit of another phase
# of the stage (build-index: a unit searches either the images or the captions)
OTHER_UNITS: dict[tuple[str, str], str] = {
    ("build-index", "caption_negatives"): "captions",
}


def counted_table(stage: str, tables: dict) -> tuple[str | None, str]:
    """(table, unit) of a stage's artifact whose manifest lists ``tables``: the table of
    :data:`COUNTED`, else (a stage not listed) the first table, counted as ``rows``."""
    table, unit = COUNTED.get(stage, (None, "rows"))
    if table in tables:
        return table, unit
    return (next(iter(tables), None), "rows")


def artifact_count(manifest: dict) -> tuple[int, str]:
    """(rows, unit) of a finished artifact from its ``_manifest.json``: ``(400, "images")``."""
    tables = manifest.get("tables") or {}
    table, unit = counted_table(manifest.get("stage", ""), tables)
    return (int(tables[table]["rows"]) if table is not None else 0), unit


def unit_rows(stage: str, result: dict) -> tuple[int, str]:
    """(rows, unit) that one finished unit of ``stage`` wrote, for its progress line: the rows of
    the counted table (``stats.table_rows``, which every unit's commit records; else the result's
    ``files``): ``(150, "images")``; a unit of another phase of the stage, which writes other
    tables (encode-concepts' membership), counts its first table by what its rows are
    (:data:`OTHER_UNITS`: build-index's ``(2994, "captions")``), else by name (``(10274, "membership
    rows")``); a result with neither, its ``stats.rows``."""
    table, unit = COUNTED.get(stage, (None, "rows"))
    if result.get("failed"):
        return 0, unit
    stats = result.get("stats") or {}
    by_table = stats.get("table_rows")
    if not isinstance(by_table, dict):
        by_table = {}
        for f in result.get("files") or []:
            if isinstance(f, dict) and "table" in f:
                by_table[f["table"]] = by_table.get(f["table"], 0) + int(f.get("rows", 0))
    if table is None or not by_table:
        return int(stats.get("rows", 0)), "rows"
    if table not in by_table:
        table = next(iter(by_table))
        unit = OTHER_UNITS.get((stage, table), f"{table} rows")
    return int(by_table[table]), unit


def fmt_count(manifest: dict) -> str:
    """``"400 images"``: the count with its unit, thousands separated."""
    n, unit = artifact_count(manifest)
    return f"{n:,} {unit}"
