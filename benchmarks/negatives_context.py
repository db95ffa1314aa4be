"""Are a run's stored negatives context-preserving? (InfoGround Sec. 2.4; issue 36, the pixels testbed's MLM)

    .venv/bin/python benchmarks/negatives_context.py runs/testbed runs/pixels-gt

InfoGround's negatives replace a noun by words a masked LM finds plausible in its place: a context-preserving
negative of "a red circle" names another shape, not a colour or a position. On the generated dataset the word
classes are known (pipeline/synthetic/scene.py), so for every stored negative list of a shape noun this prints
the share of the 25 candidates that are shape words, the share of the MLM's probability ``p`` over those
candidates that falls on shape words, and the share of shape words among the 5 candidates with the highest ``p``.
A masked LM that learnt the captions puts more of its probability on shapes than the candidates' own share; a
random one (``tiny-random``) does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def shape_mass(negatives: Path) -> dict:
    """Over the stored negatives of shape nouns in ``negatives`` (an artifact folder): the mean share of shape words
    among the candidates (``share``), of the MLM's p over them (``mass``) and among the top 5 by p (``top5``)."""
    import pyarrow.parquet as pq

    from pipeline.synthetic.scene import PLURALS, SHAPES

    shapes = set(SHAPES) | set(PLURALS.values())
    files = sorted(Path(negatives).glob("negatives/*.parquet"))
    if not files:
        raise SystemExit(f"{negatives}: no negatives/*.parquet (run `pipeline run negative-captions` first)")
    rows = pq.read_table(files, columns=["noun", "candidates", "p"]).to_pylist()
    share, mass, top5 = [], [], []
    for r in rows:
        if r["noun"] not in shapes or not r["candidates"]:
            continue
        is_s = np.array([w in shapes for w in r["candidates"]])
        p = np.asarray(r["p"], float)
        share.append(is_s.mean())
        mass.append(p[is_s].sum() / max(p.sum(), 1e-12))
        top5.append(is_s[np.argsort(-p, kind="stable")[:5]].mean())
    if not share:
        raise SystemExit(f"{negatives}: no negatives of shape nouns (not the generated dataset?)")
    return {"nouns": len(share), "share": float(np.mean(share)), "mass": float(np.mean(mass)), "top5": float(np.mean(top5))}


def main(argv=None) -> None:
    outputs = (argv if argv is not None else sys.argv[1:]) or ["runs/testbed", "runs/pixels-gt"]
    print("| run (models.mlm) | shape nouns | shape share of the 25 candidates | of the MLM's p over them | of the top 5 by p |")
    print("|---|---:|---:|---:|---:|")
    import json

    for out in outputs:
        neg = Path(out) / "negatives"
        r = shape_mass(neg)
        spec = json.loads((neg / "_manifest.json").read_text())["models"].get("mlm", {}).get("spec", "?")
        print(f"| {out} ({spec}) | {r['nouns']:,} | {r['share']:.3f} | {r['mass']:.3f} | {r['top5']:.3f} |")


if __name__ == "__main__":
    main()
