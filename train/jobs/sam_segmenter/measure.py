"""Held-out mask and box recall of the trained segmenter (train/jobs/sam_segmenter/masks_eval.py's metrics).

* :func:`measure_corpus` (the job's evaluation): the corpus's held-out images through the exported folder
  loaded by :class:`pipeline.models.sam.SamModel` and its unchanged ``generate`` (the options of the
  manifest's ``stages.extract_visual_tokens``: :func:`pipeline.stages.extract_visual_tokens.amg_options`);
* :func:`measure_stage_outputs` (``python -m train.jobs.sam_segmenter.measure --manifest M``): what the real
  stages wrote for the testbed's held-out images: the ``visual_tokens`` artifact's masks (``segmenter: sam``)
  and, when present, the ``regions`` artifact's boxes (``backend: sam``), against the samples' instances.

Both beside the connected-components baseline (``tau`` fitted on training images of the same samples artifact).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from train.jobs.sam_segmenter.masks_eval import (best_iou, box_ious, components, fit_tau, mask_ious, masks_to_boxes,
                                                 summarize)

TAU_FIT_IMAGES = 200


def _tau(images, gts, min_area: int) -> float:
    return fit_tau(images, gts, min_area)


def measure_corpus(job, folder: str) -> dict:
    """Mask recall, mean best IoU and box recall on ``job.eval_idx`` through the AMG of the SAM folder."""
    from pipeline.models.sam import SamModel
    from pipeline.stages.extract_visual_tokens import amg_options

    cfg = job.cfg
    amg = amg_options(job.manifest.stages.extract_visual_tokens)
    sm = SamModel(folder, device=str(job.device))
    fit = job.train_idx[:TAU_FIT_IMAGES]
    tau = _tau([job.image(i) for i in fit], [job.gt_masks(i) for i in fit], cfg.baseline_min_area)
    m_sam, m_cc, b_sam, b_cc, ids, found = [], [], [], [], [], 0
    for s in range(0, len(job.eval_idx), 8):
        chunk = [int(i) for i in job.eval_idx[s : s + 8]]
        enc = sm.encode([job.image(i) for i in chunk])
        for b, i in enumerate(chunk):
            g = sm.generate(enc.embeddings[b : b + 1], enc.input_sizes[b], enc.original_sizes[b], **amg)
            found += len(g["masks"])
            gt = job.gt_masks(i)
            if not len(gt):
                continue
            pm, cc = g["masks"].numpy(), components(job.image(i), tau, cfg.baseline_min_area)
            gb = masks_to_boxes(gt)
            m_sam.append(best_iou(mask_ious(pm, gt)))
            m_cc.append(best_iou(mask_ious(cc, gt)))
            b_sam.append(best_iou(box_ious(masks_to_boxes(pm), gb)))
            b_cc.append(best_iou(box_ious(masks_to_boxes(cc), gb)))
            ids.append(int(job.corpus.sample_ids[i]))
    out = {"eval_images": len(job.eval_idx), "amg": amg, "masks_per_image": found / max(len(job.eval_idx), 1),
           "baseline_tau": tau}
    out.update(summarize(m_sam, ids, "mask", m_cc))
    out.update(summarize(m_cc, ids, "baseline_mask"))
    out.update(summarize(b_sam, ids, "box", b_cc))
    out.update(summarize(b_cc, ids, "baseline_box"))
    return out


def measure_stage_outputs(manifest, splits=("val", "test"), min_area: int = 16) -> dict:
    """The stages' masks (``visual_tokens``) and boxes (``regions``, if written) on the held-out samples."""
    from pipeline.io.artifacts import Artifact
    from pipeline.loaders.regions import RegionsReader
    from pipeline.loaders.visual_tokens import iter_samples, shard_paths
    from pipeline.masks import rle_decode
    from pipeline.readers.images import open_image
    from train.encoders import load_corpus
    from train.job import resolve_artifact
    from train.jobs.sam_segmenter.masks import decode_masks

    corpus = load_corpus(manifest, "samples", "sam-segmenter measure")
    row = {int(s): i for i, s in enumerate(corpus.sample_ids.tolist())}

    def image(i):
        return np.asarray(open_image(corpus.images[i]).convert("RGB"))

    def gt(i, hw):
        return decode_masks(corpus.masks.get(int(corpus.sample_ids[i]), []), hw, f"sample {int(corpus.sample_ids[i])}")

    fit = [i for i in np.nonzero(corpus.splits == "train")[0] if int(corpus.sample_ids[i]) in corpus.masks][:TAU_FIT_IMAGES]
    fit_ims = [image(i) for i in fit]
    tau = _tau(fit_ims, [gt(i, im.shape[:2]) for i, im in zip(fit, fit_ims)], min_area)
    held = set(corpus.sample_ids[np.isin(corpus.splits, list(splits))].tolist())
    vt = Artifact(resolve_artifact(manifest, "visual_tokens"))
    out = {"segmenter": vt.manifest.get("parameters", {}).get("segmenter"), "baseline_tau": tau}
    m_sam, m_cc, b_cc, ids, boxes_cc = [], [], [], [], {}
    for p in shard_paths(vt):
        for s in iter_samples(p):
            sid = int(s["meta.json"]["sample_id"])
            if sid not in held or sid not in corpus.masks:
                continue
            i = row[sid]
            im = image(i)
            g = gt(i, im.shape[:2])
            if not len(g):
                continue
            pm = np.stack([rle_decode(r) for r in s["masks.json"]]) if s["masks.json"] else np.zeros((0, *im.shape[:2]), bool)
            cc = components(im, tau, min_area)
            m_sam.append(best_iou(mask_ious(pm, g)))
            m_cc.append(best_iou(mask_ious(cc, g)))
            boxes_cc[sid] = (masks_to_boxes(g), masks_to_boxes(cc))
            ids.append(sid)
    out.update(summarize(m_sam, ids, "mask", m_cc))
    out.update(summarize(m_cc, ids, "baseline_mask"))
    try:
        regions = RegionsReader(resolve_artifact(manifest, "regions"))
    except Exception:  # noqa: BLE001 - no regions artifact: masks only
        return out
    out["regions_backend"] = regions.backend
    b_sam, b_ids = [], []
    for sid in ids:
        r = regions.get(sid, ("boxes.npy",))
        gb, ccb = boxes_cc[sid]
        b_sam.append(best_iou(box_ious(r["boxes"] if r is not None else np.zeros((0, 4)), gb)))
        b_cc.append(best_iou(box_ious(ccb, gb)))
        b_ids.append(sid)
    out.update(summarize(b_sam, b_ids, "box", b_cc))
    out.update(summarize(b_cc, b_ids, "baseline_box"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.jobs.sam_segmenter.measure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--manifest", "-m", required=True)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--corpus", metavar="SAM_FOLDER", default=None,
                    help="measure SAM_FOLDER on the corpus's held-out images (the job's final evaluation) instead of "
                         "the stages' outputs on the testbed")
    a = ap.parse_args(argv)
    import torch

    from pipeline.config import ManifestError, load_manifest

    torch.set_num_threads(1)  # kind to a shared CPU, and reproducible
    try:
        m = load_manifest(a.manifest, a.sets)
        if a.corpus:
            import tempfile

            from train.registry import registry  # the job as `train run` makes it (job.py imports this module)

            job = registry()["sam-segmenter"].make_job(m.train.sam_segmenter, m, Path(tempfile.mkdtemp()), torch.device("cpu"))
            res = measure_corpus(job, a.corpus)
        else:
            res = measure_stage_outputs(m)
    except (ManifestError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
