"""Text description of an artifact for `pipeline inspect`.

A stage module may define ``inspect_view(artifact, n) -> str`` to add a human-readable view
(concept texts instead of ids, say); it is printed after the generic part.
"""

from __future__ import annotations

import json

import numpy as np

from pipeline.cli_help import clip
from pipeline.io.artifacts import Artifact
from pipeline.io.wds import iter_shard
from pipeline.stage import registry


def _describe_value(v) -> str:
    if isinstance(v, np.ndarray):
        return f"array{list(v.shape)} {v.dtype}"
    if isinstance(v, (dict, list)):
        return f"json {clip(json.dumps(v, default=str), 80)}"
    if isinstance(v, str):
        return f"text {clip(repr(v), 62)}"
    return f"{type(v).__name__} ({len(v)} bytes)" if isinstance(v, bytes) else repr(v)


def describe(art: Artifact, rows: int, fmt) -> str:
    m = art.manifest
    out = [
        f"artifact   {m['artifact']}  (stage {m['stage']}, schema v{m['schema_version']}, code {m['code_version']})",
        f"created    {m['created']}   fingerprint {m['fingerprint']}",
        f"folder     {art.location}" + (f"  (cached in {art.local})" if art.remote is not None else ""),
    ]
    if m.get("random_weights"):
        out.append(f"WARNING    computed with RANDOM WEIGHTS for: {', '.join(m['random_weights'])}")
    for role, rec in (m.get("models") or {}).items():
        flag = " (random weights)" if rec.get("random_weights") else ""
        out.append(f"model      {role}: {rec.get('spec')}{flag} sha256={str(rec.get('weights_sha256'))[:16]}")
    params = {k: v for k, v in (m.get("parameters") or {}).items() if k != "dataset"}
    # cut with an ellipsis (`pipeline inspect --json` prints them whole)
    out.append(f"parameters {clip(json.dumps(params, default=str), 400)}")
    from pipeline.counts import counted_table, fmt_count

    table = counted_table(m.get("stage", ""), m.get("tables") or {})[0]
    out.append(f"count      {fmt_count(m)} (table {table}: the count `pipeline status` and the report show)")
    out.append(f"errors     {m['errors']['rows']} rows in {m['errors']['path']}")
    for table, info in m["tables"].items():
        out.append("")
        out.append(f"table {table}: {info['rows']} rows in {info['files']} shard(s)")
        # files fetched one at a time (a remote artifact: only the ones shown are downloaded)
        files = [e["path"] for e in art.shard_entries(table)]
        if not files:
            continue
        if files[0].endswith(".parquet"):
            first = art.read_file(files[0])
            for f in first.schema:
                out.append(f"  {f.name}: {f.type}")
            shown = 0
            for k, rel in enumerate(files):
                t = first if k == 0 else art.read_file(rel)
                for row in t.slice(0, rows - shown).to_pylist():
                    out.append("  | " + "  ".join(f"{k}={fmt(v, 48)}" for k, v in row.items()))
                    shown += 1
                if shown >= rows:
                    break
        else:
            for k, sample in enumerate(iter_shard(art.local_file(files[0]))):
                if k == 0:
                    for name, v in sample.items():
                        if name != "__key__":
                            out.append(f"  {name}: {_describe_value(v)}")
                if k >= rows:
                    break
            out.append(f"  (first shard {files[0].rsplit('/', 1)[-1]}; keys are sample_id zero-padded to 12 digits)")
    errors = art.errors()
    if errors.num_rows:
        out.append("")
        out.append("first errors:")
        for row in errors.slice(0, rows).to_pylist():
            ids = ", ".join(f"{k}={row[k]}" for k in ("sample_id", "caption_id", "source_id") if row[k] is not None)
            out.append(f"  [{row['reason']}] {ids}: {clip(row['detail'], 120)}")
    try:
        spec = registry().get(m["stage"])
        view = getattr(spec.module, "inspect_view", None) if spec else None
        if view is not None:
            out.append("")
            out.append(view(art, rows))
    except Exception as e:  # a broken view must not hide the generic description
        out.append(f"(readable view failed: {type(e).__name__}: {e})")
    return "\n".join(out)
