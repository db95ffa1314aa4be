"""benchmarks/testbed.py's expectations: read from a committed file, and the confirmation run's record of it.

The expected outcome of every checked row lives in ``benchmarks/expectations/<testbed>.yaml`` (``testbed.yaml``
for the scene-oracle testbed, ``pixels.yaml`` for the pixels testbed, ``pixels-gt.yaml`` for its ground-truth variant:
a manifest's own name first; the vocabulary is in testbed.yaml's header),
so that what a run is checked against is written, and committed, before the run. :func:`load` turns a file into
the table ``{job: [(benchmark, subset, metric, expect, min_n, why)]}`` that ``testbed.job_rows`` reads; a file
that is not of that form is one error line naming the file, the job and the entry.

A confirmation run (``benchmarks/testbed.py --confirm``) trains and scores on a fresh generator seed, the file's
``confirm_seed``, which no tuning has used, in its own output folder (``<output>-confirm-<seed>``), with the file's
``confirm_set`` overrides where it has them (the sizes the predictions were written for). It refuses to
start while the expectations file differs from its committed version (:func:`committed_blob`), and its table
records the file's git blob hash: ``git log --find-object=<hash>`` then shows the commit that wrote it, before
the run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "benchmarks" / "expectations"
EXPECTS = ("above base", "at base", "above chance", "chance", "prior", "measured")


class ExpectationsError(ValueError):
    """A malformed expectations file, or one not committed as it is (one line: the file and the problem)."""


def default_file(pixels: bool, manifest: str | Path | None = None) -> Path:
    """The expectations of ``manifest``: ``<its name>.yaml`` here when there is one (``manifests/pixels-gt.yaml`` ->
    ``pixels-gt.yaml``), else the pixels testbed's (a manifest whose models.* name encoder exports) or the oracle's."""
    if manifest is not None and (FOLDER / f"{Path(manifest).stem}.yaml").is_file():
        return FOLDER / f"{Path(manifest).stem}.yaml"
    return FOLDER / ("pixels.yaml" if pixels else "testbed.yaml")


def load(path: str | Path) -> tuple[dict[str, list[tuple]], dict]:
    """({job: [(benchmark, subset, metric, expect, min_n, why)]}, the file's other keys: min_n, confirm_seed,
    confirm_set: the manifest overrides a confirmation run adds, fixed with the predictions, e.g. a larger held-out split)."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ExpectationsError(f"{path}: cannot be read as YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), dict):
        raise ExpectationsError(f"{path}: expected a mapping with `rows: {{job: [entries]}}`")
    min_n = int(doc.get("min_n", 30))
    table: dict[str, list[tuple]] = {}
    for job, entries in doc["rows"].items():
        if not isinstance(entries, list):
            raise ExpectationsError(f"{path}: rows.{job}: expected a list of entries")
        for k, e in enumerate(entries):
            where = f"{path}: rows.{job}[{k}]"
            if not isinstance(e, dict) or not {"benchmark", "subset", "metric", "expect"} <= set(e):
                raise ExpectationsError(f"{where}: needs benchmark, subset, metric and expect (null: any)")
            unknown = set(e) - {"benchmark", "subset", "metric", "expect", "min_n", "why"}
            if unknown:
                raise ExpectationsError(f"{where}: unknown key(s) {sorted(unknown)}")
            if e["expect"] not in EXPECTS:
                raise ExpectationsError(f"{where}: expect {e['expect']!r} is not one of {', '.join(EXPECTS)}")
            table.setdefault(str(job), []).append((e["benchmark"], e["subset"], e["metric"], e["expect"],
                                                   int(e.get("min_n", min_n)), str(e.get("why") or "")))
    confirm_set = doc.get("confirm_set") or []
    if not isinstance(confirm_set, list) or not all(isinstance(x, str) and "=" in x for x in confirm_set):
        raise ExpectationsError(f"{path}: confirm_set: expected a list of manifest overrides `key=value`")
    return table, {"min_n": min_n, "confirm_seed": doc.get("confirm_seed"), "confirm_set": confirm_set}


def _git(*args: str) -> str:
    p = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise ExpectationsError(f"git {' '.join(args)}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}")
    return p.stdout.strip()


def committed_blob(path: str | Path) -> str:
    """The git blob hash of ``path`` as committed at HEAD; an error when the file on disk differs from it
    (uncommitted edits) or was never committed: a confirmation run checks committed expectations only."""
    path = Path(path).resolve()
    if not path.is_relative_to(REPO):
        raise ExpectationsError(f"{path}: outside the repository {REPO}; a confirmation run checks committed expectations")
    rel = path.relative_to(REPO)
    on_disk = _git("hash-object", str(rel))
    try:
        at_head = _git("rev-parse", f"HEAD:{rel.as_posix()}")
    except ExpectationsError:
        raise ExpectationsError(f"{rel}: not committed; commit the expectations before a confirmation run") from None
    if on_disk != at_head:
        raise ExpectationsError(f"{rel}: differs from its committed version (blob {at_head[:12]}); commit the "
                                "expectations before a confirmation run")
    return at_head


def confirm_sets(output: str, seed: int, extra: list[str] = ()) -> list[str]:
    """The overrides of a confirmation run: the expectations file's own (``extra``), then the fresh generator seed, in
    its own output folder."""
    return [*extra, f"dataset.synthetic.seed={int(seed)}", f"output={str(output).rstrip('/')}-confirm-{int(seed)}"]
