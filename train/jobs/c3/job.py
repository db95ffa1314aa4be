"""The `c3` job's lifecycle (see train/jobs/c3/__init__.py for the method): the artifacts it
reads and their checks, the splits, and the wiring of its parts.

By role: :mod:`~train.jobs.c3.model` (adapters, co-attention fusion, phi heads),
:mod:`~train.jobs.c3.batches` (training triplets and negatives), :mod:`~train.jobs.c3.losses`
(MCP, MCC, ITM), :mod:`~train.jobs.c3.metrics` (held-out evaluation),
:mod:`~train.jobs.c3.scoring` (the harness interface), :mod:`~train.jobs.c3.data` (image features).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.loaders.concept_tokens import ConceptTokens, open_artifact as open_concept_tokens
from train.job import Job, Splits, open_artifact, resolve_artifact
from train.jobs.c3.batches import TripletBatches
from train.jobs.c3.data import ImageStore, log
from train.jobs.c3.losses import c3_loss
from train.jobs.c3.metrics import HeldOut
from train.jobs.c3.model import C3Model
from train.jobs.c3.scoring import CROP_NOTE, TextScorer


class C3Job(Job):
    NAME = "c3"  # train.jobs.c3.NAME (not imported: the package imports this module)

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.art = open_artifact(manifest, cfg.artifact, "clip_tokens", self.NAME)
        shards = [str(p) for p in self.art.files("shards")]
        if not shards:
            raise ValueError(f"{self.art.dir}: no shards in the clip_tokens artifact")
        self.store = ImageStore(shards, cfg.image_cache, zeroed=cfg.control == "images_zeroed")
        if self.store.zeroed:
            log("control images_zeroed: every image feature is zero (training, evaluation, scoring): the concept prior")
        self.concepts = open_artifact(manifest, cfg.concepts_artifact, "concepts", self.NAME)
        self.ct = ConceptTokens(open_concept_tokens(resolve_artifact(manifest, cfg.concept_tokens_artifact)))
        self._check_provenance()
        self.d_t = 0 if self.ct.pooled_only else self.ct.d_t
        if self.ct.P != self.store.P:
            raise ValueError(f"concept_tokens pooled width {self.ct.P} != clip_tokens image_embed width {self.store.P}: "
                             "encoded with another CLIP")
        self._splits()
        self.member = self.ct.membership(self.store.sids)
        self.data = TripletBatches(cfg, self.store, self.ct, self.member, self.concepts, self.is_train)
        self.data.fit = self.fit_batch
        self.skips = self.data.skips
        self.store.preload(np.concatenate([self.store.sids[self.data.train_img_rows], self.store.sids[self.is_eval]]))
        self.heldout = HeldOut(cfg, self.data, self.is_eval, self.samples, self.concepts, device)
        self.scorer = TextScorer(cfg, self.store, self.ct, manifest, device)

    def _check_provenance(self) -> None:
        a = (self.art.manifest.get("models", {}).get("clip") or {}).get("weights_sha256")
        b = (self.ct.clip_record or {}).get("weights_sha256")
        if a and b and a != b:
            raise ValueError(f"{self.ct.art.dir}: concept encodings come from CLIP weights {b[:12]} but clip_tokens from "
                             f"{a[:12]}: rerun `pipeline run encode-concepts` with the same models.clip")
        want = self.ct.art.manifest.get("input_fingerprints", {}).get("concepts")
        if want and want != self.concepts.fingerprint:
            raise ValueError(f"{self.ct.art.dir} was encoded from another concepts artifact than {self.concepts.dir}: "
                             "rerun `pipeline run encode-concepts`")

    def _splits(self) -> None:
        """is_train / is_eval per store row (:class:`train.job.Splits`); ``samples`` None when the
        samples artifact or its table is missing (the hash split then, and no binding negatives)."""
        try:
            samples = open_artifact(self.manifest, self.cfg.samples_artifact)
        except FileNotFoundError:
            samples = None
        self.samples = samples if samples is not None and "samples" in samples.tables() else None
        split = Splits(self.samples).of_many(self.store.sids)
        self.is_train = np.isin(split, self.cfg.train_splits)
        self.is_eval = np.isin(split, self.cfg.eval_splits)
        if self.is_train.sum() < 2:
            raise ValueError(f"{self.art.dir}: fewer than 2 training-split images ({self.cfg.train_splits}) in clip_tokens")

    # ------------------------------------------------------------------------------- lifecycle
    def build_model(self):
        return C3Model(self.cfg, self.store.d_v, self.d_t, self.store.P, self.store.N)

    def batches_per_epoch(self) -> int:
        return self.steps_per_epoch(self.data.batches_per_epoch())

    def batches(self, epoch: int, start: int):
        return self.data.batches(epoch, self.rank_batches(self.data.batches_per_epoch(), start))

    def loss(self, model: C3Model, batch: dict):
        return c3_loss(model, batch, self.cfg, self.device)

    def job_metrics(self, model, out_dir: Path) -> list:
        """The held-out rows, computed once per state of the weights: the final evaluation
        (metrics.jsonl) and the harness (results.parquet) both ask for them of the same final model.
        The key is the parameters' in-place version counters (an optimizer step or a
        ``load_state_dict`` bumps them), so a changed model is always scored again."""
        key = (id(model), tuple(p._version for p in model.parameters()))
        if getattr(self, "_rows_for", None) != key:
            model.eval()
            self._rows, self._rows_for = self.heldout.rows(model), key
        return self._rows

    def evaluate(self, model, out_dir: Path) -> dict:
        try:
            rows = self.job_metrics(model, out_dir)
        except ValueError as e:  # no held-out triplet: say so (metrics.jsonl), never a silent blank
            log(f"evaluation: {e}")
            return {"eval_error": str(e), **{f"data/skipped_{k}": v for k, v in self.skips.items()}}
        res = {f"{r.benchmark}/{r.subset}/{r.metric}": r.value for r in rows if r.n}
        res.update({f"chance/{r.benchmark}/{r.subset}/{r.metric}": r.chance for r in rows if r.n and r.chance is not None})
        res.update({f"data/skipped_{k}": v for k, v in self.skips.items()})
        res["data/train_rows"] = len(self.data.r_cid)
        return res

    # ------------------------------------------------------------------ harness scoring interface
    def scorable_sample_ids(self):
        return set(self.store.sids.tolist())

    def score_pairs(self, model, sample_ids, texts, boxes=None, encoded: dict | None = None):
        """See :meth:`train.jobs.c3.scoring.TextScorer.score_pairs`."""
        if boxes is not None:
            self.crop_note = CROP_NOTE
        return self.scorer.score_pairs(model, sample_ids, texts, encoded)
