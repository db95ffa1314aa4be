"""The sizing table of docs/scaling.md, every figure from `pipeline plan --json` (nothing typed by hand).

    .venv/bin/python benchmarks/sizing_table.py            # prints the Markdown table (~1 minute)

Each dataset is ``manifests/coco.yaml`` (the published checkpoints: CLIP ViT-B/16, GroupViT
gcc-yfcc, BERT-base as masked LM and word encoder, SAM ViT-H, Faster R-CNN R50-FPN v2; GPU stages
``num_gpus: 1``) at the dataset's published size, with ``--captions-sample`` captions standing for
its text: the 1,000 COCO val2017 captions of manifests/sizing/coco-val2017-captions.txt (SugarCrepe's
positives); CC12M's longer alt-texts (20.2 tokens on average, Changpinyo et al. 2021, Table 1) are
those captions run together and cut into 20-word captions. Node: 8 GPUs, 96 CPUs (an 8 x A100 node such as AWS
p4d.24xlarge); GPU seconds come from the A100 anchor in pipeline/sizing/plan.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = "manifests/sizing/coco-val2017-captions.txt"
# name, images, captions per image, words per caption (None: the sample's own), source of the counts
DATASETS = [
    ("COCO train2017", 118_287, 591_753 / 118_287, None, "captions_train2017.json: 118,287 images, 591,753 captions"),
    ("CC3M", 3_318_333, 1.0, None, "Sharma et al. 2018: 3,318,333 training pairs; 10.3 tokens/caption"),
    ("CC12M", 12_423_374, 1.0, 20, "Changpinyo et al. 2021: 12,423,374 pairs; 20.2 tokens/caption"),
]
NODE = ["--cpus", "96", "--gpus", "8"]


def plan(images: int, cpi: float, words: float | None, *sets: str) -> dict:
    cmd = [sys.executable, "-m", "pipeline.cli", "plan", "-m", "manifests/coco.yaml", "--set", "output=runs/sizing",
           *[x for s in sets for x in ("--set", s)],
           "--images", str(images), "--captions-per-image", str(cpi), "--captions-sample", CAPTIONS, *NODE, "--json", "--calibrate"]
    if words:
        cmd += ["--words-per-caption", str(words)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout)


def main() -> None:
    from pipeline.sizing.plan import fmt_bytes, fmt_seconds

    plans = [(name, src, plan(n, cpi, w)) for name, n, cpi, w, src in DATASETS]
    stages = [s["stage"] for s in plans[0][2]["stages"]]
    print("| stage (artifact) | GFLOP / image (COCO) | " + " | ".join(f"{name}: bytes, wall" for name, _, _ in plans) + " |")
    print("|---|---|" + "---|" * len(plans))
    for i, stage in enumerate(stages):
        s0 = plans[0][2]["stages"][i]
        fl = f"{s0['flops_per_image'] / 1e9:,.1f}" if s0["flops_per_image"] else "-"
        cells = []
        for _, _, p in plans:
            s = p["stages"][i]
            where = f" ({s['device']} x{s['workers']})" if s["wall_seconds"] is not None else ""
            cells.append(f"{fmt_bytes(s['total_bytes'])}, {fmt_seconds(s['wall_seconds'])}{where}")
        print(f"| {stage} ({s0['artifact']}) | {fl} | " + " | ".join(cells) + " |")
    totals = [f"**{fmt_bytes(p['total_bytes'])}**, {fmt_seconds(sum(s['wall_seconds'] or 0 for s in p['stages']))}"
              for _, _, p in plans]
    print("| total (timed stages) | | " + " | ".join(totals) + " |")
    # the compact options (pipeline plan with --set): int8 tokens; negative features for one sampled noun per caption
    for label, sets, stage in (("clip_tokens, `token_precision: int8`", ["stages.extract_clip_tokens.token_precision=int8"],
                                "extract-clip-tokens"),
                               ("negatives, `negative_features: sampled`", ["stages.negative_captions.negative_features=sampled"],
                                "negative-captions")):
        cells = []
        for name, n, cpi, w, _ in DATASETS:
            s = next(x for x in plan(n, cpi, w, *sets)["stages"] if x["stage"] == stage)
            cells.append(f"{fmt_bytes(s['total_bytes'])}, {fmt_seconds(s['wall_seconds'])}")
        print(f"| {label} | | " + " | ".join(cells) + " |")
    print()
    for name, src, p in plans:
        print(f"- {name}: {p['dataset']['images']:,} images, {p['dataset']['captions']:,} captions ({src}); {p['dataset']['note']}")
    cal = plans[0][2]["calibration"]
    print(f"- CPU calibration: {cal['model']}, {cal['flops'] / 1e9:.1f} GFLOP in {cal['seconds']:.2f} s on one thread "
          f"of this machine = {cal['flops_per_s'] / 1e9:.1f} GFLOP/s ({cal['measured_at']})")
    print(f"- GPU anchor: {plans[0][2]['gpu_anchor']['source']}")


if __name__ == "__main__":
    main()
