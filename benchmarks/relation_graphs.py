"""The predicted scene graphs of a visual_tokens artifact against the dataset's ground truth (issue 46, item 3).

    .venv/bin/python benchmarks/relation_graphs.py --manifest manifests/pixels.yaml [--set key=value ...]
                                                  [--artifact visual_tokens] [--samples samples] [--iou 0.5] [--json]

Reads ``<output>/<artifact>`` (extracted with any ``relations:``; the pixels.yaml manifest's: ``learned``, the
relation encoder trained on the corpus) and ``<output>/<samples>`` (the ground-truth instances and relations),
matches each image's predicted masks to the ground-truth instances (one to one, IoU >= ``--iou``, the relation
encoder's own matching) and prints, for the artifact's graphs and for the stage's ``geometric`` predictor on the
same instances, precision (correct predicted triplets / predicted triplets) and recall (recovered ground-truth
triples / all ground-truth triples), each with its 95% interval clustered by image, and the recall's paired
difference (train/jobs/relation_encoder/graphs.py). The numbers in docs/jobs/relation-encoder.md and BENCHMARKS.md
come from this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _ci(x: list) -> str:
    return f"[{x[0]:.1f}, {x[1]:.1f}]"


def table(res: dict, artifact_label: str) -> str:
    st = res["stats"]
    lines = [f"{st['images']} images, {st['gt_triples']} ground-truth triples ({st['unmapped']} relations outside the "
             f"vocabulary), {st['matched_instances']} of {st['gt_instances']} ground-truth instances matched by "
             f"{st['pred_instances']} predicted",
             "| predictor | predicted triplets | precision % | 95% interval | recall % | 95% interval |",
             "|---|---:|---:|---|---:|---|"]
    for name, label in (("artifact", artifact_label), ("geometric", "geometric (same instances)")):
        r = res[name]
        lines.append(f"| {label} | {r['predicted']} | {r['precision']:.1f} | {_ci(r['precision_ci'])} | "
                     f"{r['recall']:.1f} | {_ci(r['recall_ci'])} |")
    d = res["recall_diff"]
    lines.append(f"recall {artifact_label} - geometric: {d['diff']:+.1f} {_ci(d['ci'])} (paired, images resampled together)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", "-m", required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--artifact", default="visual_tokens", help="the visual_tokens artifact under the output")
    ap.add_argument("--samples", default="samples", help="the samples artifact with the ground truth")
    ap.add_argument("--iou", type=float, default=0.5, help="mask IoU at which a predicted instance is a ground-truth one")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    from pipeline.config import ManifestError, load_manifest
    from train.job import open_artifact, resolve_artifact
    from train.jobs.relation_encoder.graphs import graph_scores, summary

    try:
        m = load_manifest(args.manifest, args.sets)
        open_artifact(m, args.artifact, "visual_tokens", "relation_graphs")
        open_artifact(m, args.samples, "samples", "relation_graphs")
    except (ManifestError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = summary(graph_scores(resolve_artifact(m, args.artifact), resolve_artifact(m, args.samples), args.iou))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    label = f"relations: {res['stats']['relations_on_predicted']}"
    print(json.dumps(res) if args.json else table(res, label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
