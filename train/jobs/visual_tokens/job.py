"""Implementation of the `visual-tokens` job (see train/jobs/visual_tokens/__init__.py)."""

from __future__ import annotations

import functools
import json
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from pipeline.io.artifacts import Artifact, ArtifactMissing
from pipeline.io.shards import ShardStream, copy_into, fits_in_memory, loader
from pipeline.loaders.visual_tokens import TRAIN_FIELDS, n_tokens
from pipeline.loaders.visual_tokens import collate as vt_collate
from pipeline.loaders.visual_tokens import read_shard as vt_read_shard
from train.data import ParquetJoin, ShardIndex, ShardJoin
from train.eval.interface import Row
from train.jobs.visual_tokens.losses import clip_loss, similarity_stats
from train.jobs.visual_tokens.model import VisualTokensModel
from train.job import Job

TEXT_FIELDS = ("text_tokens", "text_mask", "text_embed", "caption_ids")


def _local_output(manifest) -> Path:
    from pipeline.io.storage import local_path

    return local_path(manifest.output)


def _resolve(manifest, p: str) -> Path | str:
    """``p`` under the manifest's output unless absolute (an object-storage URL stays a str)."""
    from pipeline.io.storage import resolve_under

    return resolve_under(manifest.output, p)


def shuffle_ranks(ranks: np.ndarray, T: int, seed: int, sample_id: int) -> np.ndarray:
    """The shuffled-ranks control: the [T, T] rank block permuted over its non-image tokens
    (rows and columns together) by a permutation fixed per (seed, sample_id)."""
    perm = np.random.default_rng([int(seed), int(sample_id), 7]).permutation(T - 1) + 1
    idx = np.concatenate([[0], perm])
    out = ranks.copy()
    out[:T, :T] = ranks[np.ix_(idx, idx)]
    return out


def collate_batch(samples: list[dict], rng: random.Random | None, *, opts: dict, captions: str = "random") -> dict:
    """A training / evaluation batch from joined samples (module-level: DataLoader workers pickle
    it). ``captions``: ``random`` (one per image, drawn with ``rng``), ``first`` or ``all``
    (``caption_sample`` then maps each caption row to its image row)."""
    variant = opts["variant"]
    if variant == "vit":
        p0 = samples[0]["patch_tokens"]
        patches = np.empty((len(samples), *p0.shape), p0.dtype)
        for i, s in enumerate(samples):
            copy_into(patches[i], s["patch_tokens"])
        batch = {"patch_tokens": torch.from_numpy(patches),
                 "sample_id": torch.tensor([int(s["sample_id"]) for s in samples], dtype=torch.int64)}
    else:
        batch = vt_collate(samples, opts["context_length"], pad_to=opts["pad_to"], intangible=variant != "tangible-only")
        if variant == "shuffled-ranks":
            r = batch["ranks"].numpy().copy()
            for i, s in enumerate(samples):
                T = int((~batch["pad_mask"][i]).sum())
                r[i] = shuffle_ranks(r[i], T, opts["seed"], int(s["sample_id"]))
            batch["ranks"] = torch.from_numpy(r)
    if "caption_ids" in samples[0]:
        batch.update(collate_text(samples, rng, captions))
    return batch


def collate_text(samples: list[dict], rng: random.Random | None, captions: str) -> dict:
    picks = []  # (sample row, caption row, valid tokens)
    for i, s in enumerate(samples):
        c = int(s["caption_ids"].shape[0])
        lengths = np.asarray(s["text_mask"]).sum(axis=1)
        js = range(c) if captions == "all" else [0 if captions == "first" else (rng or random).randrange(c)]
        picks.extend((i, j, int(lengths[j])) for j in js)
    t0 = samples[0]["text_tokens"]
    m = max((n for _, _, n in picks), default=1)
    tokens = np.zeros((len(picks), m, t0.shape[-1]), t0.dtype)
    for r, (i, j, n) in enumerate(picks):
        if n:
            copy_into(tokens[r, :n], samples[i]["text_tokens"], j, n)
    lengths = torch.tensor([n for _, _, n in picks], dtype=torch.int64)
    out = {"text_tokens": torch.from_numpy(tokens), "text_mask": torch.arange(m)[None, :] < lengths[:, None],
           "text_embed": torch.from_numpy(np.stack([np.asarray(samples[i]["text_embed"][j]) for i, j, _ in picks])),
           "caption_id": torch.tensor([int(samples[i]["caption_ids"][j]) for i, j, _ in picks], dtype=torch.int64)}
    if captions == "all":
        out["caption_sample"] = torch.tensor([i for i, _, _ in picks], dtype=torch.int64)
    return out


class VisualTokensJob(Job):
    NAME = "visual-tokens"
    crop_note = "whole-image token set: the visual-token encoder has no box crop (boxes ignored)"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.vt = Artifact(_resolve(manifest, cfg.artifact))
        self.ct = Artifact(_resolve(manifest, cfg.clip_artifact))
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
            self.samples = Artifact(_resolve(manifest, cfg.samples_artifact))
        except ArtifactMissing:
            self.samples = None
        self._split_join = None
        if self.samples is not None and "samples" in self.samples.tables():
            self._split_join = ParquetJoin(self.samples, "samples", ["split"])
        self._inventory()
        self._bpe = None
        self._bs = None
        self._text_cache: dict[str, dict] = {}

    # ------------------------------------------------------------------------------------ data
    def split_of(self, sample_id: int) -> str:
        """The samples artifact's split; without one, sample_id % 20: 18 -> val, 19 -> test."""
        if self._split_join is not None:
            row = self._split_join.lookup(int(sample_id))
            if row is not None and row.get("split"):
                return str(row["split"])
        r = int(sample_id) % 20
        return "val" if r == 18 else "test" if r == 19 else "train"

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
        self.split = {sid: self.split_of(sid) for sid in trainable}
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
                           drop_last=True, keep=self._keep_train, joins=[self.join])

    @property
    def batch_size(self) -> int:
        """cfg.batch_size, or the whole training split when it is smaller (the demo): said on stderr."""
        if self._bs is None:
            n = len(self.train_ids)
            self._bs = self.cfg.batch_size
            if 2 <= n < self._bs:
                print(f"visual-tokens: training split has {n} samples < batch_size {self._bs}; using batches of {n}",
                      file=sys.stderr)
                self._bs = n
        return self._bs

    def build_model(self):
        return VisualTokensModel(self.cfg, self.dims)

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = len(self.train_ids) // self.batch_size
        return self._bpe

    def batches(self, epoch: int, start: int):
        return loader(self.stream().set_position(epoch, start), self.cfg.num_workers)

    def _encode_text_batch(self, model, batch) -> torch.Tensor:
        if self.cfg.text == "pooled":
            return model.encode_text(None, None, batch["text_embed"], self.device)
        return model.encode_text(batch["text_tokens"], batch["text_mask"], None, self.device)

    def loss(self, model, batch):
        img = model.encode_image(batch, self.device)
        txt = self._encode_text_batch(model, batch)
        return clip_loss(img, txt, model.scale())

    # ------------------------------------------------------------------------------ evaluation
    def _load(self, sids, captions: bool) -> list[dict]:
        """Samples by id (random access through the shard indexes), as the stream yields them."""
        out = []
        for sid in sids:
            s = {"sample_id": int(sid)}
            if not self.vit:
                s.update({k: v for k, v in self.vt_index.read(int(sid), TRAIN_FIELDS).items() if k != "__key__"})
            ct_f = (TEXT_FIELDS if captions else ()) + (("patch_tokens",) if self.vit else ())
            if ct_f:
                s.update({k: v for k, v in self.join.index.read(int(sid), ct_f).items() if k not in ("__key__", "sample_id")})
            out.append(s)
        return out

    def encode_images(self, model, sids, chunk: int = 128) -> torch.Tensor:
        outs = []
        for a in range(0, len(sids), chunk):
            b = collate_batch(self._load(sids[a:a + chunk], captions=False), None, opts=self._opts())
            outs.append(model.encode_image(b, self.device).cpu())
        return torch.cat(outs) if outs else torch.zeros(0, self.cfg.embed_dim)

    def eval_ids(self) -> list[int]:
        ids = sorted(s for s, sp in self.split.items() if sp in self.cfg.eval_splits)
        return ids[: self.cfg.eval_max_images]

    def _retrieval(self, model) -> tuple[list[Row], dict]:
        from train.eval.harness import retrieval_rows

        ids = self.eval_ids()
        if len(ids) < 2:
            raise ValueError(f"visual-tokens: {len(ids)} eval images in splits {self.cfg.eval_splits} (need >= 2)")
        img, txt, cap_img, first = [], [], [], []
        for a in range(0, len(ids), 128):
            b = collate_batch(self._load(ids[a:a + 128], captions=True), None, opts=self._opts(), captions="all")
            img.append(model.encode_image(b, self.device).cpu())
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
        st = similarity_stats(I, F1)
        n = len(ids)
        rows.append(Row("similarity", "all", "mean_cos_diag", st["sim_diag"], n, None, unit="", note="Fig. 4: matching pairs"))
        rows.append(Row("similarity", "all", "mean_cos_offdiag", st["sim_offdiag"], n * (n - 1), None, unit="",
                        note="Fig. 4: non-matching pairs"))
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
                                unit="", note="initial value: r"))
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
            self._figures(model, out_dir, res)
        except Exception as e:  # a figure must never fail an evaluation
            res["figure_error"] = f"{type(e).__name__}: {e}"[:200]
        return res

    # --- the generated dataset's swap files (SugarCrepe format) through score_pairs ----------------
    def _swap_dirs(self) -> list[Path]:
        if self.cfg.swap_dirs is not None:
            return [Path(d) for d in self.cfg.swap_dirs]
        ds = self.manifest.dataset
        if ds.kind == "synthetic":
            root = Path(ds.synthetic.root) if ds.synthetic.root else _local_output(self.manifest) / "source" / "synthetic"
            return [root / "sugarcrepe"]
        return []

    def _swap_rows(self, model) -> list[Row]:
        from train.eval.sugarcrepe import pairwise_accuracy, read_sugarcrepe

        data = read_sugarcrepe(self._swap_dirs())
        if not data or self.samples is None:
            return []
        from train.eval.images import ImageMatcher

        matcher = ImageMatcher(self.samples)
        rows = []
        for kind, items in sorted(data.items()):
            items = items[: self.cfg.swap_max_per_kind] if self.cfg.swap_max_per_kind else items
            sids = matcher.match_many([r["filename"] for r in items])
            ok = [(int(s), r) for s, r in zip(sids, items) if s >= 0 and int(s) in self.usable]
            reasons = {}
            if len(items) - len(ok):
                reasons = {"no_image": int((sids < 0).sum()), "not_scorable": len(items) - len(ok) - int((sids < 0).sum())}
                reasons = {k: v for k, v in reasons.items() if v}
            if not ok:
                rows.append(Row("generated_swaps", kind, "pairwise_acc", float("nan"), 0, 50.0, len(items), reasons,
                                note="no scorable items"))
                continue
            s = np.array([sid for sid, _ in ok], np.int64)
            sp = self.score_pairs(model, s, [r["caption"] for _, r in ok])
            sn = self.score_pairs(model, s, [r["negative_caption"] for _, r in ok])
            rows.append(Row("generated_swaps", kind, "pairwise_acc", pairwise_accuracy(sp, sn), len(ok), 50.0,
                            len(items) - len(ok), reasons, note="ties count half"))
        return rows

    # --- the harness's scoring interface ------------------------------------------------------------
    def scorable_sample_ids(self):
        return np.array(sorted(self.usable), dtype=np.int64)

    def _text_embeddings(self, model, texts: list[str]) -> torch.Tensor:
        """Texts through the frozen CLIP text tower (as the artifact stores captions), then the head."""
        from train.clip_text import encode_texts_like_artifact

        new = sorted({t for t in texts if t not in self._text_cache})
        if new:
            enc = encode_texts_like_artifact(self.manifest.models.clip, self.ct.manifest, new)
            for i, t in enumerate(new):
                n = int(enc["mask"][i].sum())
                self._text_cache[t] = {"tokens": enc["tokens"][i, :n], "embed": enc["embed"][i]}
        items = [self._text_cache[t] for t in texts]
        M = max(int(x["tokens"].shape[0]) for x in items)
        toks = torch.zeros(len(items), M, items[0]["tokens"].shape[-1])
        mask = torch.zeros(len(items), M, dtype=torch.bool)
        for i, x in enumerate(items):
            toks[i, : x["tokens"].shape[0]] = x["tokens"]
            mask[i, : x["tokens"].shape[0]] = True
        emb = torch.stack([x["embed"] for x in items])
        if self.cfg.text == "pooled":
            return model.encode_text(None, None, emb, self.device).cpu()
        return model.encode_text(toks, mask, None, self.device).cpu()

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        sids = np.asarray(sample_ids, dtype=np.int64)
        if len(sids) != len(texts):
            raise ValueError(f"score_pairs: {len(sids)} sample ids but {len(texts)} texts")
        bad = [int(s) for s in np.unique(sids) if int(s) not in self.usable]
        if bad:
            raise KeyError(f"sample {bad[0]} is not scorable by visual-tokens (not in both artifacts, or skipped)")
        uniq, inv = np.unique(sids, return_inverse=True)
        img = self.encode_images(model, [int(s) for s in uniq])
        tu, tinv = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
        txt = self._text_embeddings(model, [str(t) for t in tu])
        return (img[inv] * txt[tinv]).sum(-1).double().numpy()

    def retrieval_scores(self, model, sample_ids, caption_ids, texts) -> dict:
        img = self.encode_images(model, [int(s) for s in sample_ids])
        txt = self._text_embeddings(model, list(texts))
        return {"score": (img @ txt.t()).double().numpy()}

    # --- figures ------------------------------------------------------------------------------------
    def _figures(self, model, out_dir: Path, res: dict) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = []
        mp = self.run_dir / "metrics.jsonl"
        if mp.exists():
            rows = [json.loads(x) for x in mp.read_text().splitlines() if x.strip()]
        ev = [r for r in rows if r.get("kind") == "eval" and "similarity/mean_cos_diag" in r]
        # this evaluation is logged after it returns: its step is the last train line's
        now = max([r.get("step", 0) for r in rows if r.get("kind") == "train"], default=0)
        pts = [(r["step"], r["similarity/mean_cos_diag"], r["similarity/mean_cos_offdiag"]) for r in ev if r["step"] < now]
        pts.append((now, res.get("similarity/mean_cos_diag", float("nan")), res.get("similarity/mean_cos_offdiag", float("nan"))))
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        s, d, o = zip(*pts)
        ax[0].plot(s, d, marker="o", label="diagonal (matching pairs)")
        ax[0].plot(s, o, marker="o", label="off-diagonal (other pairs)")
        ax[0].set_xlabel("training step (evaluations; set eval_every for a curve)")
        ax[0].set_ylabel("mean cosine similarity (eval)")
        ax[0].set_title(f"{self.cfg.variant}: image-text similarity (Fig. 4)", fontsize=9)
        ax[0].legend(fontsize=7)
        w = model.rank_weights()
        if w is not None:
            Lw, Hw, _ = w.shape
            for li in range(Lw):
                for hi in range(Hw):
                    ax[1].plot(range(8), w[li, hi].cpu().numpy(), marker=".", alpha=0.7 if Lw * Hw > 1 else 1,
                               label=f"layer {li} head {hi}" if Lw * Hw > 1 else "learned w")
            ax[1].plot(range(8), range(8), "k--", lw=0.8, label="init w_r = r")
            ax[1].set_xlabel("rank r (7 node-node, 6 node-edge, 5 edge-node, 4..1 kNN)")
            ax[1].set_ylabel("w_r (added to attention logits)")
            if Lw * Hw <= 8:
                ax[1].legend(fontsize=6)
        else:
            ax[1].text(0.5, 0.5, f"no rank weights ({self.cfg.variant})", ha="center")
        ax[1].set_title("learned rank weights w", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / "similarity_and_rank_weights.png", dpi=90)
        plt.close(fig)


def ct_dims_fields(vit: bool) -> tuple[str, ...]:
    return ("text_tokens", "text_embed") + (("patch_tokens",) if vit else ())
