"""The `concept-ot` job's lifecycle (see train/jobs/concept_ot/__init__.py for the method).

The pieces, by role: :mod:`~train.jobs.concept_ot.batches` (the clip_tokens sample table and Alg. 2's
batches), :mod:`~train.jobs.concept_ot.losses` (Eq. 9-10 and the hard-negative mining),
:mod:`~train.jobs.concept_ot.model` (the concept space and the local scorers),
:mod:`~train.jobs.concept_ot.scoring` (the harness interface and the evaluation encodings),
:mod:`~train.jobs.concept_ot.grounding` (Sec. 2.6 box prediction and heatmaps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.errors import describe_exception
from pipeline.io.artifacts import ArtifactMissing
from pipeline.io.shards import fits_in_memory
from pipeline.loaders.clip_tokens import read_shard
from train.eval.in_job import generated_sugarcrepe_dirs, held_out_splits, score_folders
from train.eval.retrieval import retrieval_report
from train.job import Job, Splits, open_artifact, resolve_artifact
from train.jobs.concept_ot.batches import ConceptOTBatches
from train.jobs.concept_ot.grounding import grounding_rows, save_heatmaps
from train.jobs.concept_ot.index_negatives import IndexNeighbours, require_index
from train.jobs.concept_ot.losses import concept_ot_loss
from train.jobs.concept_ot.model import ConceptOTModel
from train.jobs.concept_ot.scoring import ConceptOTScoring


class ConceptOTJob(ConceptOTBatches, ConceptOTScoring, Job):
    NAME = "concept-ot"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.art = open_artifact(manifest, cfg.artifact, "clip_tokens", self.NAME)
        self.shards = [str(p) for p in self.art.files("shards")]
        dims = self.art.manifest.get("dims", {})
        first = next(read_shard(self.shards[0], fields=("patch_tokens", "text_tokens")), None) if self.shards else None
        if first is None:
            raise ValueError(f"{self.art.dir}: no samples in the clip_tokens artifact")
        self.d_v = int(dims.get("vision_dim") or first["patch_tokens"].shape[-1])
        self.d_t = int(dims.get("text_dim") or first["text_tokens"].shape[-1])
        self.n_patches = int(first["patch_tokens"].shape[0])
        try:
            self.samples = open_artifact(manifest, cfg.samples_artifact)
        except (ArtifactMissing, FileNotFoundError):
            self.samples = None
        self.splits = Splits(self.samples)
        self._bpe = None
        self._lazy = not fits_in_memory(self.shards)
        self._tab: dict | None = None  # sample_id -> shard, position, captions, split (see _table)
        self._text_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # text -> (tokens, embed), float16
        self._text_cache_bytes = 0
        self.crop_note = ""
        tab = self._table()
        if not tab["eval"].any():
            present = ", ".join(f"{k}={v}" for k, v in sorted(zip(*np.unique(tab["split"], return_counts=True))))
            raise ValueError(
                f"no eval images: 0 of {len(tab['ids'])} samples in {self.art.dir} are in eval_splits "
                f"{list(cfg.eval_splits)} (splits: {present or 'none'}): hold images out at ingest (own data: "
                f"dataset.splits: {{val: 0.05, test: 0.05}}, docs/manifests.md; COCO: the Karpathy split JSON, dataset.kind: "
                f"karpathy, see manifests/coco.yaml) and rerun ingest, or set train.concept_ot.eval_splits")
        self.index_dir = resolve_artifact(manifest, cfg.index_artifact)
        self._nb: IndexNeighbours | None | bool = False  # False: not loaded yet
        if cfg.hard_negatives == "index":
            require_index(self.index_dir, hint=", or set hard_negatives: batch")
            self.neighbours()  # errors (an index of another clip_tokens) surface before training

    def build_model(self) -> nn.Module:
        return ConceptOTModel(self.cfg, self.d_v, self.d_t, self.device)

    def loss(self, model: ConceptOTModel, batch: dict):
        return concept_ot_loss(self.cfg, model, batch, self.device)

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self, model: ConceptOTModel, out_dir: Path) -> dict:
        """App. G.4 retrieval on the eval splits (global and two-stage), phrase heatmaps, the
        SugarCrepe-format folders through the harness, Sec. 2.6 grounding."""
        cfg = self.cfg
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        samples = self._eval_samples()
        res: dict = {}
        if samples:
            E = self._encode_eval(model, samples)
            g = E["ie"] @ E["te"].t()
            local = None
            if cfg.variant != "global-only":
                def local(qi, ti):
                    return model.score_pairs(E["img"], E["txt"], qi.to(self.device), ti.to(self.device)).cpu()
            res.update(retrieval_report(g, local, cfg.lambda_local, E["cap_img"], top_k=cfg.rerank_top_k,
                                        chunk_pairs=cfg.eval_pairs_chunk))
            res["eval_images"] = len(samples)
            res["eval_captions"] = int(E["te"].shape[0])
            if cfg.heatmaps:
                try:
                    save_heatmaps(self, model, samples[: cfg.heatmaps], E, out_dir)
                except Exception as e:  # visualisation must never fail an evaluation
                    res["heatmap_error"] = f"{type(e).__name__}: {e}"[:200]
        try:
            res.update(self._sugarcrepe(model))
        except (OSError, ValueError, RuntimeError) as e:  # e.g. the CLIP text tower cannot be loaded
            res["sugarcrepe/error"] = describe_exception(e, 160)
        try:
            for row in self._grounding(model):
                res[f"grounding/{row.metric}"] = row.value
                res[f"chance/grounding_{row.metric}"] = row.chance
                res["grounding/phrases"] = float(row.n)
                res["grounding/skipped"] = float(row.skipped)
        except (OSError, ValueError, RuntimeError, KeyError) as e:  # NoScorableItems is a RuntimeError
            res["grounding/error"] = describe_exception(e, 160)
        return res

    def job_metrics(self, model: ConceptOTModel, out_dir: Path) -> list:
        return self._grounding(model)

    def _grounding(self, model: ConceptOTModel) -> list:
        return grounding_rows(self, model)

    def _sugarcrepe(self, model: ConceptOTModel) -> dict:
        """Pairwise accuracy on the SugarCrepe-format folders of ``sugarcrepe_dirs`` (default: the
        generated dataset's ``sugarcrepe/``), scored by the harness through :meth:`score_pairs`:
        ``sugarcrepe/<kind>`` with g + lambda_l * s_local, ``sugarcrepe_global/<kind>`` with g alone;
        ``overall`` = the harness's ``all`` (triple-weighted over the five main kinds when present);
        ``triples``: the items whose image is in the samples artifact (on the generated folder: and in
        ``eval_splits``, the held-out images), ``available``: items read."""
        if self.samples is None:
            return {}
        cfg = self.cfg
        dirs = generated_sugarcrepe_dirs(self.manifest, cfg.sugarcrepe_dirs)
        held = held_out_splits(cfg.sugarcrepe_dirs, cfg.eval_splits)
        full = score_folders(self, model, "sugarcrepe", dirs, self.samples.dir, cfg.sugarcrepe_max_per_kind,
                             cfg.eval_pairs_chunk, held)
        if full is None:
            return {}
        res = {"sugarcrepe/triples": float(full.matched), "sugarcrepe/available": float(full.available)}
        if not full.rows:
            return res
        glob = full if cfg.variant == "global-only" else score_folders(
            _GlobalScore(self), model, "sugarcrepe", dirs, self.samples.dir, cfg.sugarcrepe_max_per_kind,
            cfg.eval_pairs_chunk, held)
        for tag, got in (("sugarcrepe", full), ("sugarcrepe_global", glob)):
            for row in got.rows:
                if row.subset != "add":  # add_obj / add_att have their own rows
                    res[f"{tag}/{'overall' if row.subset == 'all' else row.subset}"] = row.value
        res["chance/sugarcrepe"] = res["chance/sugarcrepe_global"] = 50.0  # pairwise, ties wrong
        return res


class _GlobalScore:
    """The job's frozen global score g alone, as a scorer for the harness."""

    crop_note = ""

    def __init__(self, job: ConceptOTJob):
        self.job = job

    def scorable_sample_ids(self):
        return self.job.scorable_sample_ids()

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        return self.job.score_pairs(model, sample_ids, texts, boxes, local=False)
