"""The `infoground` job's lifecycle (see train/jobs/infoground/__init__.py for the method): the
artifacts it reads and their checks, the training stream, the loss, and the evaluation.

Roles live beside it: :mod:`~train.jobs.infoground.model` (phi), :mod:`~train.jobs.infoground.losses`
(L_img, L_lang), :mod:`~train.jobs.infoground.batches` (caption items -> batches),
:mod:`~train.jobs.infoground.metrics` (grounding) and :mod:`~train.jobs.infoground.scoring` (the
harness interface).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from torch import nn

from pipeline.io.artifacts import Artifact
from pipeline.io.storage import resolve_under
from pipeline.io.wds import iter_shard
from pipeline.io.shards import ShardStream
from pipeline.loaders.regions import RegionsReader
from train.data import ParquetMultiJoin
from train.job import Job, Splits, open_artifact
from train.jobs.infoground.batches import Collate, FilterCaption, read_captions, regions_reader, shuffled_regions
from train.jobs.infoground.losses import infoground_loss
from train.jobs.infoground.metrics import EvalSet, ground, ground_frozen, grounding_rows, load_eval_set, noun_counts, split_figures
from train.jobs.infoground.model import InfoGroundModel
from train.jobs.infoground.scoring import TextWords, score_word_features


def _under(root: str, name: str) -> str:
    """``name`` under another run's output folder (absolute, so open_artifact keeps it)."""
    p = resolve_under(root, name)
    return p if isinstance(p, str) else str(p.absolute())


class InfoGroundJob(Job):
    NAME = "infoground"  # train.jobs.infoground.NAME (not imported: the package imports this module)

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.neg_art = open_artifact(manifest, cfg.negatives_artifact, "negatives", self.NAME)
        self.reg_art = open_artifact(manifest, cfg.regions_artifact, "regions", self.NAME)
        self.samples = open_artifact(manifest, cfg.samples_artifact, "samples", self.NAME)
        self.regions = regions_reader(str(self.reg_art.dir))
        try:
            self.neg_shards = [str(p) for p in self.neg_art.files("shards")]
        except KeyError:
            raise ValueError(f"infoground: {self.neg_art.dir} has no feature shards (no caption had a noun or "
                             "adjective, or the stage did not finish)") from None
        self.d_r = int(self.regions.feature_dim)
        self.d_w = self._word_dim(self.neg_art)
        self.skips: Counter = Counter()
        self.splits = Splits(self.samples)
        self._check_ids()
        self._bpe = None
        self._bs = None
        self._eval_sets: dict = {}
        self._prior = None
        self._text = None
        if cfg.negatives == "contextual" and int(self.neg_art.manifest.get("negative_feature_k") or 0) == 0:
            raise ValueError(f"infoground: {self.neg_art.dir} has no in-context negative features "
                             "(negative_features: none); rerun negative-captions or set negatives: random|none")

    # ------------------------------------------------------------------ artifacts and checks
    @staticmethod
    def _word_dim(art: Artifact) -> int:
        d = art.manifest.get("feature_dim")
        if d:
            return int(d)
        for shard in art.files("shards"):
            for rec in iter_shard(shard, ("words.npy",)):
                if "words.npy" in rec:
                    return int(rec["words.npy"].shape[1])
        raise ValueError(f"infoground: {art.dir}: no word features in the negatives artifact")

    def _check_ids(self) -> None:
        """Negatives samples must (mostly) have regions: else the regions artifact is another dataset's."""
        neg_ids = np.unique(self.neg_art.read("words", ["sample_id"]).column("sample_id").to_numpy())
        if len(neg_ids) == 0:
            raise ValueError(f"infoground: {self.neg_art.dir}: the negatives artifact has no words (no caption had a "
                             "noun or adjective)")
        reg_ids = self.regions.sample_ids()
        have = np.isin(neg_ids, reg_ids)
        if have.mean() < 0.5:
            raise ValueError(f"infoground: only {int(have.sum())} of the {len(neg_ids)} samples of {self.neg_art.dir} "
                             f"have regions in {self.reg_art.dir}: the two artifacts come from different datasets "
                             f"(or runs); point regions_artifact/negatives_artifact at one run's output")
        self.train_ids = set(neg_ids[self.splits.mask(neg_ids, self.cfg.train_splits)].tolist())
        self.skips["no_regions_entry"] = int((~have).sum())
        zero = [s for s in neg_ids[have] if self.regions.n_regions(int(s)) == 0]
        self.skips["zero_regions"] = len(zero)
        if self.skips["no_regions_entry"] or self.skips["zero_regions"]:
            print(f"infoground: skipping {self.skips['no_regions_entry']} samples without a regions entry and "
                  f"{self.skips['zero_regions']} with 0 regions", file=sys.stderr)

    def _keep_train(self, s: dict) -> bool:
        sid = int(s["sample_id"])
        return sid in self.train_ids and (self.regions.n_regions(sid) or 0) > 0

    # ---------------------------------------------------------------------------- training
    def _stream(self) -> ShardStream:
        cfg = self.cfg
        joins = []
        if cfg.negatives == "random":
            joins.append(ParquetMultiJoin(self.neg_art, "words", ["word_index", "is_noun", "text", "caption_id"],
                                          prefix="w_", cache_files=4))
        region_of = None
        if cfg.control == "shuffled":  # the chance control: images' regions permuted against their captions
            region_of = shuffled_regions([s for s in self.train_ids if (self.regions.n_regions(s) or 0) > 0], cfg.seed)
        collate = Collate(str(self.reg_art.dir), cfg.negatives, cfg.n_negatives, cfg.max_words_per_caption, cfg.max_regions,
                          region_of)
        if joins:
            collate = FilterCaption(collate)
        return ShardStream(self.neg_shards, read_captions, collate, self.batch_size, shuffle=True,
                           shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed, drop_last=True, keep=self._keep_train,
                           joins=joins)

    @property
    def batch_size(self) -> int:
        if self._bs is None:
            self._bs = self.cfg.batch_size
            n = sum(1 for sh in self.neg_shards for s in read_captions(sh) if self._keep_train(s))
            if n == 0:
                raise ValueError(f"infoground: no training captions: no sample of splits {self.cfg.train_splits} in "
                                 f"{self.neg_art.dir} has word features and regions")
            self._bs = self.fit_batch(n, "captions")  # train.job.Job.fit_batch: the short-split rule
        return self._bs

    def build_model(self) -> nn.Module:
        return InfoGroundModel(self.d_r, self.d_w, self.cfg.d, self.cfg.hidden_layers)

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = self.steps_per_epoch(self._stream().count_batches())
            if self.cfg.eval_every is None and self.cfg.eval_per_epoch and self._bpe > 0:
                self.cfg.eval_every = self._bpe  # evaluate (and select best.pt) once per epoch
        return self._bpe

    def batches(self, epoch: int, start: int):
        return self.stream_batches(self._stream(), epoch, start, self.batches_per_epoch())

    def loss(self, model, batch: dict):
        dev = self.device
        b = {k: v.to(dev) for k, v in batch.items()}
        loss, logs = infoground_loss(model, b, use_lang=self.cfg.negatives != "none")
        logs["captions"] = int(b["words"].shape[0])
        logs["images"] = int(b["sample_ids"].shape[0])
        return loss, logs

    # -------------------------------------------------------------------------- evaluation
    def _eval_root(self):
        return self.cfg.eval_output or self.manifest.output

    def _eval_arts(self):
        cfg = self.cfg
        if not cfg.eval_output:
            return self.neg_art, self.reg_art, self.samples, self.regions
        root = cfg.eval_output
        neg, reg, smp = (open_artifact(self.manifest, _under(root, a), a, self.NAME) for a in ("negatives", "regions", "samples"))
        rr = RegionsReader(reg)
        if rr.feature_dim != self.d_r or self._word_dim(neg) != self.d_w:
            raise ValueError(f"infoground: eval_output {root}: region/word widths {rr.feature_dim}/{self._word_dim(neg)} "
                             f"differ from the training artifacts' {self.d_r}/{self.d_w} (another detector or word encoder)")
        return neg, reg, smp, rr

    @property
    def noun_prior(self) -> Counter:
        """The word-frequency prior of the noun-vs-negatives baseline: noun counts of the training captions."""
        if self._prior is None:
            t = self.neg_art.read("words", ["sample_id", "text", "is_noun"]).to_pydict()
            train = [int(s) in self.train_ids for s in t["sample_id"]]
            self._prior = noun_counts(t["text"], [n and k for n, k in zip(t["is_noun"], train)])
        return self._prior

    def eval_set(self, splits: list[str]) -> EvalSet:
        """The grounding set of ``splits`` (cached per splits)."""
        key = tuple(splits)
        if key not in self._eval_sets:
            neg, _, smp, rr = self._eval_arts()
            sp = self.splits if not self.cfg.eval_output else Splits(smp)
            sids = sp.ids[sp.mask(sp.ids, splits)].tolist()
            if self.cfg.eval_max_images:
                sids = sids[: self.cfg.eval_max_images]
            self._eval_sets[key] = load_eval_set(sids, neg, smp, rr, self.manifest, self.noun_prior)
        return self._eval_sets[key]

    def ground(self, model, es: EvalSet, heat_dir: Path | None = None) -> dict:
        """Grounding figures (percent) and their exact chance over the phrases of ``es``."""
        return ground(model, es, self.device, self.cfg, heat_dir)

    def evaluate(self, model, out_dir: Path) -> dict:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        res: dict = {}
        report = {}
        for name, splits in (("val", self.cfg.val_splits), ("test", self.cfg.test_splits)):
            es = self.eval_set(splits)
            g = self.ground(model, es, out_dir if name == "test" else None)
            report[name] = {"splits": splits, **{k: v for k, v in g.items() if k != "items"}}
            if g["phrases"] == 0:
                print(f"infoground: no scorable phrase in splits {splits} (skipped: {g['skip_reasons']})", file=sys.stderr)
            res.update(split_figures(name, g))
        (out_dir / "grounding.json").write_text(json.dumps(report, indent=1))
        return res

    # ------------------------------------------------------------------ the harness interface
    def scorable_sample_ids(self):
        ids = self.regions.sample_ids()
        return np.asarray([s for s in ids if (self.regions.n_regions(int(s)) or 0) > 0], dtype=np.int64)

    @property
    def text_words(self) -> TextWords:
        if self._text is None:
            self._text = TextWords(self.manifest, self.neg_art.manifest.get("parameters", {}) or {})
        return self._text

    def score_word_features(self, model, sample_ids, word_feats: list[np.ndarray], boxes=None) -> np.ndarray:
        """See :func:`train.jobs.infoground.scoring.score_word_features`."""
        return score_word_features(model, self.regions, sample_ids, word_feats, boxes, self.device)

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        return self.score_word_features(model, sample_ids, self.text_words.encode(list(texts)), boxes)

    def job_metrics(self, model, out_dir: Path) -> list:
        from train.eval.interface import NoScorableItems

        es = self.eval_set(self.cfg.test_splits)
        g = self.ground(model, es, Path(out_dir))
        bench = f"grounding:{Path(self._eval_root()).name}"
        if g["phrases"] == 0:
            raise NoScorableItems(f"{bench}: no scorable phrase in splits {self.cfg.test_splits} "
                                  f"(skipped by reason: {g['skip_reasons']})")
        return grounding_rows(g, bench, "+".join(self.cfg.test_splits), self.frozen_grounding(es))

    def frozen_grounding(self, es: EvalSet) -> dict | str:
        """The frozen CLIP's zero-shot grounding of ``es`` (:func:`ground_frozen`) where the eval regions'
        features are that CLIP's projected patch grid (``models.detector: clip-pool:<CLIP>``, its weights
        hash checked against the regions artifact's record); else why not (a string): a detector's or
        the scene oracle's region features are not in a text encoder's space."""
        from pipeline.models import clip as clip_adapter
        from pipeline.models.clip_grid import clip_spec_of, is_clip_pool

        _, reg, _, _ = self._eval_arts()
        rec = (reg.manifest.get("models") or {}).get("detector") or {}
        spec = rec.get("spec")
        if not is_clip_pool(spec):
            return f"the regions' features come from {spec!r}, not from a CLIP's joint space (clip-pool:<CLIP>)"
        try:
            model, _, tok, got = clip_adapter.load_clip(clip_spec_of(spec))
        except (OSError, ValueError) as e:
            return f"the regions' CLIP {spec!r} could not be loaded ({str(e).splitlines()[0][:120]})"
        want = (rec.get("clip") or {}).get("weights_sha256")
        if want and got.get("weights_sha256") != want:
            return f"{spec!r} now holds other weights than those that pooled the regions"

        def embed(texts: list[str]) -> np.ndarray:
            import torch

            with torch.no_grad():
                return np.concatenate([clip_adapter.encode_texts(model, tok, texts[a:a + 256])["text_embed"].float().numpy()
                                       for a in range(0, len(texts), 256)])
        return ground_frozen(es, embed, self.cfg)
