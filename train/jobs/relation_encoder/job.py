"""The `relation-encoder` job (train/jobs/relation_encoder/__init__.py): relation-head's job on the corpus's predicted
instances, labelled by the corpus's scene graphs through the mask matching, exported as an encoder folder."""

from __future__ import annotations

import json
from pathlib import Path

from train.jobs.relation_head.job import RelationHeadJob, export_checkpoint

PROVENANCE = "trained here on the corpus"


def export_is_current(dest: Path, digest: str, embedding: dict) -> bool:
    """The export folder already holds these weights (``digest``, :func:`pipeline.models.provenance.state_dict_hash`)
    trained on tokens of these settings (the artifact's ``embedding`` record, which the stage checks), and its
    checkpoint file."""
    from pipeline.models.relations import RELATION_FILE

    try:
        stored = json.loads((Path(dest) / "training.json").read_text())
        return stored.get("weights_state_sha256") == digest and stored.get("embedding") == embedding \
            and (Path(dest) / RELATION_FILE).is_file()
    except (OSError, ValueError, AttributeError):
        return False


class RelationEncoderJob(RelationHeadJob):
    NAME = "relation-encoder"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        from train.encoders import export_dir

        # the folder models.relation_head points at; its relation_head.pt is the file the stage loads
        self.export_path = export_dir(manifest, cfg.EXPORT, cfg.control, cfg.export_dir)

    def export(self, model, metrics: dict) -> None:
        """``<export folder>/relation_head.pt`` and ``training.json``; an identical model trained on tokens of the same
        settings leaves the folder untouched (a rewrite would change the fingerprint of every artifact extracted with
        it). The settings count: the stage checks them against its own, so equal weights trained on tokens recorded
        under another SAM path (a renamed output folder) must be written again."""
        from pipeline.models.provenance import state_dict_hash
        from pipeline.models.relations import RELATION_FILE
        from train.job import resolve_artifact

        digest = state_dict_hash(model)
        dest = Path(self.export_path)
        embedding = self.art_man.get("embedding", {})
        if export_is_current(dest, digest, embedding):
            return
        from pipeline.io.artifacts import Artifact

        samples = resolve_artifact(self.manifest, self.cfg.samples_artifact)
        prov = {
            "trained": PROVENANCE,
            "job": self.NAME,
            "samples_artifact": str(samples),
            "samples_fingerprint": Artifact(samples).manifest.get("fingerprint"),
            "labels": (f"the samples' scene graphs on the predicted instances: masks matched one to one at IoU >= "
                       f"{self.cfg.match_iou}"),
            "label_stats": self.label_stats,
            "train_images": len(self.train_graphs),
            "held_out_images": len(self.eval_items),
        }
        dest.mkdir(parents=True, exist_ok=True)
        export_checkpoint(dest / RELATION_FILE, model, self.head_cfg, self.vocab, self.art_man, self.art_dir, self.cfg,
                          metrics, provenance=prov)
        from pipeline.io.atomic import write_json_atomic

        write_json_atomic(dest / "training.json", {**prov, "config": self.cfg.model_dump(mode="json"), "metrics": metrics,
                                                   "weights_state_sha256": digest, "embedding": embedding})

    def evaluate(self, model, out_dir):
        res = super().evaluate(model, out_dir)
        (Path(out_dir) / "relation_labels.json").write_text(json.dumps(self.label_stats, indent=1))
        return res
