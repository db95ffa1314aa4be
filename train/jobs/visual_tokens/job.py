"""Implementation of the `visual-tokens` job (see train/jobs/visual_tokens/__init__.py)."""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pipeline.io.artifacts import ArtifactMissing
from pipeline.io.shards import ShardStream, fits_in_memory
from pipeline.loaders.visual_tokens import TRAIN_FIELDS, n_tokens
from pipeline.loaders.visual_tokens import read_shard as vt_read_shard
from train.data import ShardIndex, ShardJoin
from train.eval.in_job import generated_sugarcrepe_dirs, held_out_splits, score_folders
from train.eval.interface import Row
from train.eval.intervals import mean_interval
from train.job import Job, Splits, open_artifact
from train.jobs.visual_tokens.batches import TEXT_FIELDS, collate_batch
from train.jobs.visual_tokens.figures import similarity_figure
from train.jobs.visual_tokens.losses import clip_loss, similarity_stats
from train.jobs.visual_tokens.model import VisualTokensModel
from train.jobs.visual_tokens.scoring import VisualTokensScoring


class VisualTokensJob(VisualTokensScoring, Job):
    NAME = "visual-tokens"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.vt = open_artifact(manifest, cfg.artifact, "visual_tokens", self.NAME)
        self.ct = open_artifact(manifest, cfg.clip_artifact, "clip_tokens", self.NAME)
        self.vt_shards = [str(p) for p in self.vt.files("shards")]
        self.ct_shards = [str(p) for p in self.ct.files("shards")]
        if not self.vt_shards:
            raise ValueError(f"{self.vt.dir}: no shards in the visual_tokens artifact")
        if not self.ct_shards:
            raise ValueError(f"{self.ct.dir}: no shards in the clip_tokens artifact")
        self.lazy = not fits_in_memory(self.vt_shards + self.ct_shards)
        self.vit = cfg.variant == "vit"
        ct_fields = TEXT_FIELDS + (("patch_tokens",) if self.vit else ())
        self.join = ShardJoin(self.ct_shards, ct_fields, lazy=self.lazy, name=str(self.ct.dir))
        self.vt_index = ShardIndex(self.vt_shards, lazy=self.lazy, name=str(self.vt.dir))
        try:
            self.samples = open_artifact(manifest, cfg.samples_artifact)
        except (ArtifactMissing, FileNotFoundError):
            self.samples = None
        self.splits = Splits(self.samples)
        self._inventory()
        self.pairing = shuffled_pairing(sorted(self.train_ids), cfg.seed) if cfg.control == "shuffled" else {}
        self._bpe = None
        self._bs = None
        self._text_cache: dict[str, dict] = {}

    # ------------------------------------------------------------------------------------ data
    def split_of(self, sample_id: int) -> str:
        """The samples artifact's split; without one, the stable hash split (train.job.Splits)."""
        return self.splits(sample_id)

    def _inventory(self) -> None:
        """One pass over both artifacts' headers: which samples can be used, and why not (counted)."""
        cfg = self.cfg
        skipped: Counter = Counter()
        usable: list[int] = []  # image side usable (scorable)
        trainable: list[int] = []  # + captions
        first = None
        n = 0
        for p in self.vt_shards:
            for s in vt_read_shard(p, fields=TRAIN_FIELDS, lazy=True):
                n += 1
                sid = int(s["sample_id"])
                V, U, T = n_tokens(s, intangible=cfg.variant != "tangible-only")
                if first is None:
                    first = s
                if sid not in self.join.index:
                    skipped["not_in_clip_tokens"] += 1
                    continue
                if not self.vit:
                    if V < cfg.min_tangible:
                        skipped["too_few_tangible"] += 1
                        continue
                    if T > cfg.context_length:
                        skipped["over_context_length"] += 1
                        continue
                usable.append(sid)
                caps = self.join.index.read(sid, ("caption_ids",))["caption_ids"]
                if np.asarray(caps).shape[0] == 0:
                    skipped["no_captions"] += 1
                    continue
                trainable.append(sid)
        self.usable = set(usable)
        self.split = dict(zip(trainable, self.splits.of_many(trainable).tolist()))
        self.train_ids = {s for s, sp in self.split.items() if sp in cfg.train_splits}
        self.skipped = dict(skipped)
        self.n_samples = n
        if skipped:
            print(f"visual-tokens: {len(trainable)} of {self.n_samples} samples usable; skipped "
                  + ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())), file=sys.stderr)
        # dimensions
        c0 = self.join.index.read(self.join.index.ids[0], ct_dims_fields(self.vit))
        d_token = int(first["tangible"].shape[1]) if len(first["tangible"].shape) == 2 and first["tangible"].shape[1] else \
            int(self.vt.manifest.get("dims", {}).get("width") or 512)
        self.dims = {"d_token": d_token, "d_image": int(first["image_feature"].shape[0]),
                     "d_text": int(c0["text_tokens"].shape[-1]), "d_pooled": int(c0["text_embed"].shape[-1])}
        if self.vit:
            self.dims.update(d_patch=int(c0["patch_tokens"].shape[-1]), n_patches=int(c0["patch_tokens"].shape[0]))

    def _keep_train(self, s: dict) -> bool:
        return int(s["sample_id"]) in self.train_ids

    def _opts(self) -> dict:
        c = self.cfg
        return {"variant": c.variant, "context_length": c.context_length, "pad_to": c.pad_to, "seed": c.seed}

    def _read(self):
        fields = () if self.vit else TRAIN_FIELDS
        return functools.partial(vt_read_shard, fields=fields, lazy=self.lazy)

    def stream(self) -> ShardStream:
        cfg = self.cfg
        return ShardStream(self.vt_shards, self._read(), functools.partial(collate_batch, opts=self._opts()),
                           self.batch_size, shuffle=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
                           drop_last=True, keep=self._keep_train,
                           joins=[RepairedJoin(self.join, self.pairing) if self.pairing else self.join])

    @property
    def batch_size(self) -> int:
        """cfg.batch_size, or the whole training split when it is smaller (the demo): said on stderr."""
        if self._bs is None:
            self._bs = self.fit_batch(len(self.train_ids))  # train.job.Job.fit_batch: the short-split rule
        return self._bs

    def build_model(self):
        return VisualTokensModel(self.cfg, self.dims)

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = self.steps_per_epoch(len(self.train_ids) // self.batch_size)
        return self._bpe

    def batches(self, epoch: int, start: int):
        return self.stream_batches(self.stream(), epoch, start, self.batches_per_epoch())

    def _encode_text_batch(self, model, batch) -> torch.Tensor:
        if self.cfg.text == "pooled":
            return model.encode_text(None, None, batch["text_embed"], self.device)
        return model.encode_text(batch["text_tokens"], batch["text_mask"], None, self.device)

    def loss(self, model, batch):
        img = model.encode_image(batch, self.device)
        txt = self._encode_text_batch(model, batch)
        return clip_loss(img, txt, model.scale())

    # ------------------------------------------------------------------------------ evaluation
    def eval_ids(self) -> list[int]:
        ids = sorted(s for s, sp in self.split.items() if sp in self.cfg.eval_splits)
        return ids[: self.cfg.eval_max_images]

    def _retrieval(self, model) -> tuple[list[Row], dict]:
        from train.eval.harness import retrieval_rows

        ids = self.eval_ids()
        if len(ids) < 2:
            raise ValueError(f"visual-tokens: {len(ids)} eval images in splits {self.cfg.eval_splits} (need >= 2)")
        img, txt, cap_img, first, ftxt = [], [], [], [], []
        for a in range(0, len(ids), 128):
            b = collate_batch(self._load(ids[a:a + 128], captions=True), None, opts=self._opts(), captions="all")
            img.append(model.encode_image(b, self.device).cpu())
            ftxt.append(torch.nn.functional.normalize(b["text_embed"].float(), dim=-1))
            t = self._encode_text_batch(model, b).cpu()
            cs = b["caption_sample"]
            first_rows = torch.tensor([int((cs == i).nonzero()[0]) for i in range(len(b["sample_id"]))])
            first.append(t[first_rows])
            txt.append(t)
            cap_img.append(cs + a)
        I, Tt, F1 = torch.cat(img), torch.cat(txt), torch.cat(first)
        S = (I @ Tt.t()).double().numpy()
        cap = torch.cat(cap_img).numpy()
        note = f"{self.cfg.variant}; eval splits {','.join(self.cfg.eval_splits)}"
        # named apart from a manifest benchmark called `retrieval` (the harness's Karpathy/split rows)
        rows = retrieval_rows("eval-split-retrieval", "all", S, cap)
        for r in rows:
            r.note = note
        # the frozen CLIP it reads, on the same images and captions: the baseline of every row above
        S0 = (self.frozen_images(ids) @ torch.cat(ftxt).t()).double().numpy()
        for r in retrieval_rows("eval-split-retrieval", "frozen_clip", S0, cap):
            r.baseline_for, r.note = f"all/{r.metric}", self.frozen_note
            rows.append(r)
        st = similarity_stats(I, F1)
        n = len(ids)
        Sf = (I.float() @ F1.float().t()).numpy()
        diag = np.diagonal(Sf).astype(np.float64)
        off = (Sf.sum(1) - diag) / max(1, n - 1)  # each image's mean over its non-matching texts
        rows.append(Row("similarity", "all", "mean_cos_diag", st["sim_diag"], n, None, unit="", note="Fig. 4: matching pairs")
                    .with_ci(mean_interval(diag)))
        rows.append(Row("similarity", "all", "mean_cos_offdiag", st["sim_offdiag"], n * (n - 1), None, unit="",
                        note="Fig. 4: non-matching pairs; interval: bootstrap over images").with_ci(mean_interval(off)))
        return rows, st

    def job_metrics(self, model, out_dir: Path) -> list:
        """Retrieval on the eval splits (chance beside), Fig. 4's similarities, the rank weights.
        (The generated swap files are scored by the harness itself, through score_pairs.)"""
        rows, _ = self._retrieval(model)
        w = model.rank_weights()
        if w is not None:
            flat = w.mean(dim=(0, 1))
            for r in range(1, 8):
                rows.append(Row("rank_weights", "mean", f"w_{r}", float(flat[r]), int(w.shape[0] * w.shape[1]), None,
                                unit="", note="initial value: r").no_interval("a learned weight, not an estimate over items"))
        return rows

    def evaluate(self, model, out_dir: Path) -> dict:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = self.job_metrics(model, out_dir) + self._swap_rows(model)
        res: dict = {}
        for r in rows:
            bench = "retrieval" if r.benchmark == "eval-split-retrieval" else r.benchmark
            key = f"{bench}/{r.subset + '/' if r.subset not in ('all', 'mean') else ''}{r.metric}"
            res[key] = r.value
            if r.chance is not None and r.benchmark == "eval-split-retrieval":
                res[f"chance/{r.metric}"] = r.chance
        res["eval_images"] = len(self.eval_ids())
        for k, v in self.skipped.items():
            res[f"data/skipped_{k}"] = v
        w = model.rank_weights()
        if w is not None:
            (out_dir / "rank_weights.json").write_text(json.dumps(w.tolist()))
        try:
            similarity_figure(self, model, out_dir, res)
        except Exception as e:  # a figure must never fail an evaluation
            res["figure_error"] = f"{type(e).__name__}: {e}"[:200]
        return res

    # --- the generated dataset's swap files (SugarCrepe format) through score_pairs ----------------
    def _swap_rows(self, model) -> list[Row]:
        """Pairwise accuracy per kind on ``swap_dirs`` (default: the generated dataset's
        ``sugarcrepe/``), scored by the harness through :meth:`score_pairs` (ties count as wrong); a
        kind with no scorable item is NaN."""
        if self.samples is None:
            return []
        got = score_folders(self, model, "generated_swaps", generated_sugarcrepe_dirs(self.manifest, self.cfg.swap_dirs),
                            self.samples.dir, self.cfg.swap_max_per_kind,
                            image_splits=held_out_splits(self.cfg.swap_dirs, self.cfg.eval_splits), baselines=True)
        if got is None:
            return []
        by_kind = {(r.subset, r.metric): r for r in got.rows if r.subset not in ("all", "add")}
        rows = []
        for kind in got.kinds:
            r = by_kind.get((kind, "accuracy"))
            if r is None:
                rows.append(Row("generated_swaps", kind, "pairwise_acc", float("nan"), 0, 50.0, note="no scorable items"))
                continue
            rows.append(Row("generated_swaps", kind, "pairwise_acc", r.value, r.n, r.chance, r.skipped, r.skip_reasons,
                            note="ties count as wrong", est=r.est).with_ci((r.ci_low, r.ci_high)))
            for tag in ("frozen", "text-only"):  # the harness's baselines of this kind, on the same items
                b = by_kind.get((kind, f"accuracy[{tag}]"))
                if b is not None:
                    rows.append(Row("generated_swaps", kind, f"pairwise_acc[{tag}]", b.value, b.n, b.chance, b.skipped,
                                    b.skip_reasons, note=b.note, baseline_for=f"{kind}/pairwise_acc", est=b.est)
                                .with_ci((b.ci_low, b.ci_high)))
        return rows


def shuffled_pairing(train_ids: list[int], seed: int) -> dict[int, int]:
    """The control's pairing: image -> the training image whose captions it is trained with. A
    derangement (no image keeps its own captions): the ids in a seeded random order, each paired
    with the next one (the last with the first)."""
    if len(train_ids) < 2:
        return {}
    order = np.random.default_rng([int(seed), 2027]).permutation(np.asarray(train_ids, dtype=np.int64))
    return {int(a): int(b) for a, b in zip(order, np.roll(order, -1))}


class RepairedJoin:
    """A :class:`train.data.ShardJoin` that attaches the fields of ``pairing[sample_id]`` instead of
    the sample's own (the shuffled control; module-level: DataLoader workers pickle it)."""

    def __init__(self, join: ShardJoin, pairing: dict[int, int]):
        self.join, self.pairing = join, pairing

    def keep(self, sample: dict) -> bool:
        return self.join.keep(sample)

    def __call__(self, sample: dict) -> dict:
        sid = int(sample["sample_id"])
        src = self.pairing.get(sid, sid)
        if src == sid:
            return self.join(sample)
        other = self.join({"sample_id": src})
        sample.update({k: v for k, v in other.items() if k != "sample_id"})
        return sample


def ct_dims_fields(vit: bool) -> tuple[str, ...]:
    return ("text_tokens", "text_embed") + (("patch_tokens",) if vit else ())

