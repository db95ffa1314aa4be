"""Implementation of the `concept-ot` job (see train/jobs/concept_ot/__init__.py for the description)."""

from __future__ import annotations

import functools
import math
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.io.artifacts import Artifact, ArtifactMissing
from pipeline.io.shards import ShardStream, fits_in_memory, loader
from pipeline.loaders.clip_tokens import collate as ct_collate
from pipeline.loaders.clip_tokens import read_sample, read_shard
from train.data import ParquetJoin
from train.eval.benchmarks.sugarcrepe import MAIN as MAIN_KINDS
from train.eval.benchmarks.sugarcrepe import kind_of
from train.eval.interface import NoScorableItems
from train.eval.retrieval import retrieval_report, two_stage_scores
from train.eval.sugarcrepe import pairwise_accuracy, read_sugarcrepe
from train.jobs.concept_ot.boxes import box_iou, box_patch_mask, heatmap_boxes, random_patch_boxes
from train.jobs.concept_ot.index_negatives import IndexNeighbours, IndexNeighbourStream, SampleTable, index_hits, require_index
from train.job import Job
from train.jobs.concept_ot.model import ConceptOTModel, _normalize
from train.jobs.concept_ot.ot import anchor_diversity



class _CaptionPass:
    """Stands in for the collate's rng in pass ``k`` of an epoch over caption pairs
    (``epoch_unit: captions``): the batch's i-th sample takes caption ``perm[k % c]`` of a
    permutation of its c captions seeded by (seed, epoch, sample_id), so with c == passes every
    (image, caption) pair is used exactly once per epoch. ``collate`` asks ``randrange(c)`` once
    per sample, in sample order."""

    def __init__(self, samples, seed: int, epoch: int, k: int):
        self._sids = iter([int(s["sample_id"]) for s in samples])
        self.seed, self.epoch, self.k = int(seed), int(epoch), int(k)

    def randrange(self, c: int) -> int:
        sid = next(self._sids)
        perm = list(range(c))
        random.Random((self.seed * 1_000_003 + self.epoch) * 1_000_033 + sid).shuffle(perm)
        return perm[self.k % c]


def _collate_random(samples, rng: random.Random, attach=None, caption_pass=None):
    """One random caption per image (a module-level function: DataLoader workers pickle it);
    ``caption_pass`` = (seed, epoch, k): the caption of pass k of an epoch over caption pairs."""
    if caption_pass is not None:
        rng = _CaptionPass(samples, *caption_pass)
    b = ct_collate(samples, "random", rng)
    return attach(b) if attach is not None else b


def mine_pairs(g: torch.Tensor, K: int, bad: torch.Tensor):
    """Hard negatives of Alg. 2 line 6 from global scores g [B, B] (g[i, j] = s_g(I_i, x_j)):
    N_X(i) = top-K_h_{j != i} g[i, j] (captions), N_I(i) = top-K_h_{j != i} g[j, i] (images);
    ``bad`` [B, B] marks excluded (i, j) (the diagonal, duplicate captions).
    Returns (img_idx, txt_idx) of the B (1 + 2K) pairs [positives; (i, N_X(i)); (N_I(i), i)],
    the negative indices [B, K] both ways and their global scores (-inf where excluded)."""
    B = g.shape[0]
    vx, neg_x = g.masked_fill(bad, float("-inf")).topk(K, dim=1)
    vi, neg_i = g.t().masked_fill(bad, float("-inf")).topk(K, dim=1)
    idx = torch.arange(B, device=g.device)
    ii = torch.cat([idx, idx.repeat_interleave(K), neg_i.reshape(-1)])
    tt = torch.cat([idx, neg_x.reshape(-1), idx.repeat_interleave(K)])
    return ii, tt, neg_x, neg_i, vx, vi


def _index_there(index_dir) -> bool:
    from train.jobs.concept_ot.index_negatives import IndexMissing, require_index

    try:
        require_index(index_dir)
        return True
    except IndexMissing:
        return False


def _local_output(manifest) -> Path:
    from pipeline.io.storage import local_path

    return local_path(manifest.output)


def _resolve(manifest, p: str) -> Path | str:
    """``p`` under the manifest's output unless absolute (an object-storage URL stays a str)."""
    from pipeline.io.storage import resolve_under

    return resolve_under(manifest.output, p)


class ConceptOTJob(Job):
    NAME = "concept-ot"
    TEXT_CACHE_BYTES = 256 * 2**20  # encoded benchmark texts kept (oldest evicted first)

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.art = Artifact(_resolve(manifest, cfg.artifact))
        self.shards = [str(p) for p in self.art.files("shards")]
        dims = self.art.manifest.get("dims", {})
        first = next(read_shard(self.shards[0], fields=("patch_tokens", "text_tokens")), None) if self.shards else None
        if first is None:
            raise ValueError(f"{self.art.dir}: no samples in the clip_tokens artifact")
        self.d_v = int(dims.get("vision_dim") or first["patch_tokens"].shape[-1])
        self.d_t = int(dims.get("text_dim") or first["text_tokens"].shape[-1])
        self.n_patches = int(first["patch_tokens"].shape[0])
        try:
            self.samples = Artifact(_resolve(manifest, cfg.samples_artifact))
        except ArtifactMissing:
            self.samples = None
        self._split_join = None
        if self.samples is not None and "samples" in self.samples.tables():
            self._split_join = ParquetJoin(self.samples, "samples", ["split"])
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
                f"{list(cfg.eval_splits)} (splits: {present or 'none'}): ingest a split with held-out images (COCO: the "
                f"Karpathy split JSON, dataset.kind: karpathy, see manifests/coco.yaml) or set train.concept_ot.eval_splits")
        self.index_dir = _resolve(manifest, cfg.index_artifact)
        self._nb: IndexNeighbours | None | bool = False  # False: not loaded yet
        if cfg.hard_negatives == "index":
            require_index(self.index_dir, hint=", or set hard_negatives: batch")
            self.neighbours()  # errors (an index of another clip_tokens) surface before training

    def neighbours(self) -> IndexNeighbours | None:
        """The index neighbours (hard_negatives: index), or, in batch mode, when an index artifact
        is present and matches (only for the hn_index_hit metric); None otherwise."""
        if self._nb is False:
            table = SampleTable(self.shards, functools.partial(read_shard, fields=("caption_ids",), lazy=True),
                                self._keep_train) if _index_there(self.index_dir) else None
            if table is None:
                self._nb = None
            elif self.cfg.hard_negatives == "index":
                self._nb = IndexNeighbours(self.index_dir, table, self.cfg.index_top)
            else:
                try:
                    self._nb = IndexNeighbours(self.index_dir, table, self.cfg.index_top, log=lambda m: None)
                except (OSError, ValueError, KeyError):
                    self._nb = None  # batch mode: the metric is optional
        return self._nb

    # ---------------------------------------------------------------------------------- splits
    @staticmethod
    def _hash_split(sample_id: int) -> str:
        r = int(sample_id) % 20
        return "val" if r == 18 else "test" if r == 19 else "train"

    def split_of(self, sample_id: int) -> str:
        """The samples artifact's split; without one, a stable hash split (sample_id % 20:
        18 -> val, 19 -> test, as the generated dataset does)."""
        tab = self._tab
        if tab is not None:
            r = int(np.searchsorted(tab["ids"], int(sample_id)))
            if r < len(tab["ids"]) and tab["ids"][r] == int(sample_id):
                return str(tab["split"][r])
        if self._split_join is not None:
            row = self._split_join.lookup(int(sample_id))
            if row is not None and row.get("split"):
                return str(row["split"])
        return self._hash_split(sample_id)

    def _table(self) -> dict:
        """Every sample of the shards, sorted by id: ``ids``, ``shard`` (index into self.shards),
        ``pos`` (position in the shard), ``ncap`` (captions), ``split``, ``train`` (a training sample:
        captions, a train split and, with ``train_subset``, in the subset), ``eval`` (captions and an
        eval split). One pass over the shards' headers; the splits in one vectorised join."""
        if self._tab is not None:
            return self._tab
        ids, sh, pos, ncap = [], [], [], []
        for k, path in enumerate(self.shards):
            for p, s in enumerate(read_shard(path, fields=("caption_ids",), lazy=True)):
                ids.append(int(s["sample_id"]))
                sh.append(k)
                pos.append(p)
                ncap.append(int(s["caption_ids"].shape[0]))
        ids_a = np.asarray(ids, np.int64)
        order = np.argsort(ids_a, kind="stable")
        ids_a = ids_a[order]
        if ids_a.size > 1 and (np.diff(ids_a) == 0).any():
            raise ValueError(f"{self.art.dir}: sample_id {int(ids_a[1:][np.diff(ids_a) == 0][0])} occurs more than once")
        split = np.array([self._hash_split(i) for i in ids_a.tolist()], dtype=object)
        if self._split_join is not None:
            import polars as pl

            t = self.samples.scan("samples").select("sample_id", "split").filter(
                pl.col("sample_id").is_in(ids_a.tolist()) & pl.col("split").is_not_null()).collect()
            r = np.searchsorted(ids_a, t["sample_id"].to_numpy())
            split[r] = np.asarray(t["split"].to_list(), dtype=object)
        ncap_a = np.asarray(ncap, np.int64)[order]
        train = (ncap_a > 0) & np.isin(split, list(self.cfg.train_splits))
        n_train = int(train.sum())
        if self.cfg.train_subset is not None and self.cfg.train_subset < n_train:
            # a seeded draw from the sorted training ids: independent of shard order and of cfg.seed
            pick = np.random.default_rng(self.cfg.train_subset_seed).choice(n_train, self.cfg.train_subset, replace=False)
            sub = np.zeros(n_train, bool)
            sub[pick] = True
            train[np.flatnonzero(train)] = sub
        elif self.cfg.train_subset is not None:
            import sys

            print(f"concept-ot: train_subset {self.cfg.train_subset} >= the {n_train} training images: using all",
                  file=sys.stderr)
        self._tab = {"ids": ids_a, "shard": np.asarray(sh, np.int32)[order], "pos": np.asarray(pos, np.int64)[order],
                     "ncap": ncap_a, "split": split, "train": train,
                     "eval": (ncap_a > 0) & np.isin(split, list(self.cfg.eval_splits))}
        return self._tab

    def _rows(self, sample_ids) -> np.ndarray:
        """Table rows of ``sample_ids``, -1 where an id is not in the shards."""
        ids = self._table()["ids"]
        q = np.asarray(sample_ids, np.int64)
        if ids.size == 0:
            return np.full(q.shape, -1, np.int64)
        i = np.minimum(np.searchsorted(ids, q), ids.size - 1)
        return np.where(ids[i] == q, i, -1)

    def train_sample_ids(self) -> np.ndarray:
        """The training images (after ``train_subset``), sorted."""
        t = self._table()
        return t["ids"][t["train"]]

    def _keep_train(self, s: dict) -> bool:
        r = int(self._rows([s["sample_id"]])[0])
        return r >= 0 and bool(self._table()["train"][r])

    def _passes(self) -> int:
        """Image passes per epoch: 1 (epoch_unit: images), or round(mean captions per training image)
        (epoch_unit: captions)."""
        if self.cfg.epoch_unit == "images":
            return 1
        t = self._table()
        n = t["ncap"][t["train"]]
        return max(1, int(round(float(n.mean())))) if n.size else 1

    def _stream(self, caption_pass: tuple[int, int] | None = None) -> ShardStream:
        cfg = self.cfg

        nb = self.neighbours()
        read = functools.partial(read_shard, lazy=self._lazy)
        coll = _collate_random
        if caption_pass is not None:
            coll = functools.partial(_collate_random, caption_pass=(cfg.seed, *caption_pass))
        if cfg.hard_negatives == "index":
            return IndexNeighbourStream(self.shards, read, coll, self.batch_size, neighbours=nb,
                                        m=cfg.index_neighbours,
                                        read_sample=functools.partial(read_sample, lazy=self._lazy),
                                        shuffle=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
                                        keep=self._keep_train)
        collate = coll if nb is None else functools.partial(coll, attach=nb.attach)
        return ShardStream(self.shards, read, collate, self.batch_size,
                           shuffle=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed, drop_last=True,
                           keep=self._keep_train)

    # ------------------------------------------------------------------------------- interface
    def build_model(self) -> nn.Module:
        return ConceptOTModel(self.cfg, self.d_v, self.d_t, self.device)

    @property
    def batch_size(self) -> int:
        """cfg.batch_size, or the whole training split when it is smaller than one batch (the
        demo's 64 images): a warning says so."""
        if getattr(self, "_bs", None) is None:
            self._bs = self.cfg.batch_size
            n = int(self._table()["train"].sum())
            if 2 <= n < self.cfg.batch_size:
                import sys

                print(f"concept-ot: training split has {n} samples < batch_size {self.cfg.batch_size}; "
                      f"using batches of {n}", file=sys.stderr)
                self._bs = n
        return self._bs

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = self._stream().count_batches()
        return self._bpe * self._passes()

    def batches(self, epoch: int, start: int):
        R = self._passes()
        if R == 1:
            return loader(self._stream().set_position(epoch, start), self.cfg.num_workers)
        # an epoch over caption pairs: R image passes, pass k shuffled as stream epoch epoch * R + k
        n = self.batches_per_epoch() // R

        def passes():
            for k in range(start // n, R):
                st = self._stream((epoch, k)).set_position(epoch * R + k, start % n if k == start // n else 0)
                yield from loader(st, self.cfg.num_workers)

        return passes()

    def loss(self, model: ConceptOTModel, batch: dict):
        cfg = self.cfg
        dev = self.device
        ie = _normalize(batch["image_embed"].to(dev).float())
        te = _normalize(batch["text_embed"].to(dev).float())
        B = ie.shape[0]
        g = ie @ te.t()  # [B, B] global similarities (frozen)
        labels = torch.arange(B, device=dev)
        l_global = 0.5 * (F.cross_entropy(g / cfg.global_temperature, labels)
                          + F.cross_entropy(g.t() / cfg.global_temperature, labels))
        logs = {"loss_global": float(l_global)}
        if cfg.variant == "global-only":
            return l_global, logs
        bad = torch.eye(B, dtype=torch.bool, device=dev)
        if cfg.exclude_duplicate_captions:
            bad = bad | ((te @ te.t()) > 1 - 1e-6)
        ii, tt, neg_x, neg_i, vx, vi = mine_pairs(g, min(cfg.k_hard, B - 1), bad)
        K = neg_x.shape[1]
        img = model.image_features(batch["patch_tokens"].to(dev))
        txt = model.text_features(batch["text_tokens"].to(dev), batch["text_mask"].to(dev))
        s = model.score_pairs(img, txt, ii, tt)
        s_pos, s_x, s_i = s[:B], s[B:B + B * K].view(B, K), s[B + B * K:].view(B, K)
        s_x = s_x.masked_fill(~torch.isfinite(vx), float("-inf"))
        s_i = s_i.masked_fill(~torch.isfinite(vi), float("-inf"))
        zero = torch.zeros(B, dtype=torch.long, device=dev)
        l_i2x = F.cross_entropy(torch.cat([s_pos[:, None], s_x], 1) / cfg.tau_local, zero)
        l_x2i = F.cross_entropy(torch.cat([s_pos[:, None], s_i], 1) / cfg.tau_local, zero)
        loss = l_global + cfg.lambda_local * 0.5 * (l_i2x + l_x2i)
        negs = torch.cat([s_x, s_i], 1).detach()
        logs.update({"loss_i2x": float(l_i2x.detach()), "loss_x2i": float(l_x2i.detach()),
                     "s_pos": float(s_pos.detach().mean()), "s_neg": float(negs[torch.isfinite(negs)].mean())})
        if "index_neighbours" in batch:
            # share of the mined negatives (both directions) that are index neighbours of their anchor
            sid, nbs = batch["sample_id"], batch["index_neighbours"]
            hx, nx_ = index_hits(sid, neg_x, torch.isfinite(vx), nbs)
            hi, ni_ = index_hits(sid, neg_i, torch.isfinite(vi), nbs)
            hits, mined = (hx + hi).cpu(), (nx_ + ni_).cpu()
            logs["hn_index_hit"] = float(hits.sum()) / max(1, int(mined.sum()))
            if "seed_mask" in batch:  # the rows whose neighbours were brought into the batch
                sm = batch["seed_mask"]
                logs["hn_index_hit_seeds"] = float(hits[sm].sum()) / max(1, int(mined[sm].sum()))
                logs["seed_batch_share"] = float(sm.float().mean())
        if cfg.variant == "conceptot" and cfg.beta_div > 0:
            div = anchor_diversity(model.anchors)
            loss = loss + cfg.beta_div * div
            logs["anchor_div"] = float(div.detach())
        return loss, logs

    # ------------------------------------------------------------------------------ evaluation
    def _eval_samples(self) -> list[dict]:
        out = []
        for p in self.shards:
            for s in read_shard(p, fields=None):
                if s["caption_ids"].shape[0] == 0 or self.split_of(s["sample_id"]) not in self.cfg.eval_splits:
                    continue
                out.append(s)
                if len(out) >= self.cfg.eval_max_images:
                    return out
        return out

    def _encode_eval(self, model, samples: list[dict], chunk: int = 64) -> dict:
        dev = self.device
        ie, te, cap_img, cap_ids, imgs, txts = [], [], [], [], [], []
        for s in range(0, len(samples), chunk):
            b = ct_collate(samples[s:s + chunk], "all")
            ie.append(_normalize(b["image_embed"].float()))
            te.append(_normalize(b["text_embed"].float()))
            cap_img.append(b["caption_sample"] + s)
            cap_ids.append(b["caption_id"])
            imgs.append(model.image_features(b["patch_tokens"].to(dev)))
            txts.append(model.text_features(b["text_tokens"].to(dev), b["text_mask"].to(dev)))
        return {"ie": torch.cat(ie), "te": torch.cat(te), "cap_img": torch.cat(cap_img), "caption_id": torch.cat(cap_ids),
                "img": _cat_feats(imgs), "txt": _cat_feats(txts, pad_dim=1)}

    def evaluate(self, model: ConceptOTModel, out_dir: Path) -> dict:
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
                    self._heatmaps(model, samples[: cfg.heatmaps], E, out_dir)
                except Exception as e:  # visualisation must never fail an evaluation
                    res["heatmap_error"] = f"{type(e).__name__}: {e}"[:200]
        try:
            res.update(self._sugarcrepe(model))
        except (OSError, ValueError, RuntimeError) as e:  # e.g. the CLIP text tower cannot be loaded
            res["sugarcrepe/error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        try:
            for row in self._grounding(model):
                res[f"grounding/{row.metric}"] = row.value
                res[f"chance/grounding_{row.metric}"] = row.chance
                res["grounding/phrases"] = float(row.n)
                res["grounding/skipped"] = float(row.skipped)
        except (OSError, ValueError, RuntimeError, KeyError) as e:  # NoScorableItems is a RuntimeError
            res["grounding/error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return res

    # ------------------------------------------------- scoring interface (train/eval/interface.py)
    def scorable_sample_ids(self) -> np.ndarray:
        """Every sample id of the clip_tokens shards (any split: benchmarks choose their images)."""
        return self._table()["ids"].copy()

    def _read_images(self, sample_ids, fields=("patch_tokens", "image_embed")) -> dict[str, np.ndarray]:
        """Stacked arrays of ``sample_ids`` by random access into the shards (shard, position from
        the sample table)."""
        rows = self._rows(sample_ids)
        if (rows < 0).any():
            raise KeyError(f"sample_id {int(np.asarray(sample_ids)[rows < 0][0])} is not in {self.art.dir}")
        t = self._table()
        out: dict[str, list] = {f: [] for f in fields}
        for r in rows.tolist():
            s = read_sample(self.shards[int(t["shard"][r])], int(t["pos"][r]), fields=fields, lazy=self._lazy)
            for f in fields:
                out[f].append(np.asarray(s[f]))
        return {f: np.stack(v) if f in ("patch_tokens", "image_embed") else v for f, v in out.items()}

    def _texts(self, texts: list[str]) -> dict:
        """Frozen CLIP text encodings (tokens, mask, embed) of ``texts``, padded, from a per-text cache
        (:meth:`_encode_texts` for the texts not seen yet)."""
        cache = self._text_cache
        new = [t for t in dict.fromkeys(texts) if t not in cache]
        got = {t: cache[t] for t in dict.fromkeys(texts) if t in cache}
        if new:
            enc = self._encode_texts(new)
            for k, t in enumerate(new):
                m = enc["mask"][k].bool()
                # float16: the encodings are rounded to it already (as the artifact stores them)
                got[t] = cache[t] = (enc["tokens"][k][m].half(), enc["embed"][k].half())
                self._text_cache_bytes += got[t][0].numel() * 2 + got[t][1].numel() * 2
            while self._text_cache_bytes > self.TEXT_CACHE_BYTES and len(cache) > len(got):
                old = next(iter(cache))  # oldest first (insertion order)
                if old in got:
                    cache[old] = cache.pop(old)  # in use: move to the end
                    continue
                tk, em = cache.pop(old)
                self._text_cache_bytes -= tk.numel() * 2 + em.numel() * 2
        toks = [got[t][0].float() for t in texts]
        return {"tokens": torch.nn.utils.rnn.pad_sequence(toks, batch_first=True),
                "mask": torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in toks],
                                                        batch_first=True),
                "embed": torch.stack([got[t][1].float() for t in texts])}

    def _box_views(self, sids: np.ndarray, boxes) -> tuple[np.ndarray, list[np.ndarray | None]]:
        """(view of each pair [P], the patch indices of each view, None = all patches): the distinct
        (image, patch subset) combinations a chunk of pairs needs."""
        P = len(sids)
        keep: list = [None] * P
        if boxes is not None:
            b = np.asarray(boxes, np.float64).reshape(P, 4)
            has = np.isfinite(b).all(1)
            if has.any():
                side = int(round(math.sqrt(self.n_patches)))
                if side * side != self.n_patches:
                    raise ValueError(f"{self.art.dir}: {self.n_patches} patch tokens are not a square grid; cannot crop")
                wh = self._image_sizes(sids[has])
                masks = box_patch_mask(b[has], wh[:, 0], wh[:, 1], side)
                for p, m in zip(np.flatnonzero(has).tolist(), masks):
                    keep[p] = np.flatnonzero(m)
        key_of: dict = {}
        views: list = []
        view = np.empty(P, np.int64)
        for p in range(P):
            key = (int(sids[p]), None if keep[p] is None or len(keep[p]) == self.n_patches else keep[p].tobytes())
            if key not in key_of:
                key_of[key] = len(views)
                views.append((int(sids[p]), None if key[1] is None else keep[p]))
            view[p] = key_of[key]
        return view, views

    def _image_sizes(self, sids) -> np.ndarray:
        """[n, 2] (width, height) from the samples artifact."""
        import polars as pl

        if self.samples is None:
            raise ValueError(f"boxes need the samples artifact's image sizes ({self.cfg.samples_artifact} is missing)")
        u = np.unique(np.asarray(sids, np.int64))
        t = self.samples.scan("samples").select("sample_id", "width", "height").filter(
            pl.col("sample_id").is_in(u.tolist())).collect()
        wh = dict(zip(t["sample_id"].to_list(), zip(t["width"].to_list(), t["height"].to_list())))
        out = np.empty((len(sids), 2), np.float64)
        for k, s in enumerate(np.asarray(sids).tolist()):
            w, h = wh.get(int(s), (None, None))
            if not w or not h:
                raise ValueError(f"sample {s}: no width/height in {self.samples.dir}; cannot map its box to patches")
            out[k] = (w, h)
        return out

    @torch.no_grad()
    def score_pairs(self, model: ConceptOTModel, sample_ids, texts, boxes=None) -> np.ndarray:
        """s(I, x) = g + lambda_local * s_local (global-only: g), as the SugarCrepe evaluation and the
        G.4 rerank score. g: cosine of the frozen pooled CLIP embeddings; texts are encoded by the frozen
        CLIP text tower (``models.clip``, cached per text); image features are read by random access.
        ``boxes`` [P, 4] (NaN rows: no box): the local score uses only the patch tokens overlapping the
        box (masses renormalised over them); the global term stays the whole image's pooled embedding
        (the artifact holds no crop embedding), which ``crop_note`` records."""
        sids = np.asarray(sample_ids, np.int64).reshape(-1)
        texts = list(texts)
        P = len(sids)
        out = np.empty(P, np.float64)
        if P == 0:
            return out
        if len(texts) != P:
            raise ValueError(f"score_pairs: {P} sample ids but {len(texts)} texts")
        if boxes is not None and np.isfinite(np.asarray(boxes, np.float64)).all(1).any():
            self.crop_note = ("global-only: boxes ignored (pooled whole-image embedding)" if self.cfg.variant == "global-only"
                              else "local score over the patches overlapping the box; global term of the whole image")
        dev, lam = self.device, self.cfg.lambda_local
        chunk = self.cfg.eval_pairs_chunk
        for s in range(0, P, chunk):
            e = min(P, s + chunk)
            cs, ct = sids[s:e], texts[s:e]
            u_sid, inv_i = np.unique(cs, return_inverse=True)
            u_txt = list(dict.fromkeys(ct))
            t_of = {t: k for k, t in enumerate(u_txt)}
            inv_t = torch.tensor([t_of[t] for t in ct])
            arr = self._read_images(u_sid)
            tok = self._texts(u_txt)
            ie = _normalize(torch.from_numpy(arr["image_embed"]).float())
            te = _normalize(tok["embed"].float())
            g = (ie[torch.from_numpy(inv_i)] * te[inv_t]).sum(-1).double()
            if self.cfg.variant == "global-only":
                out[s:e] = g.numpy()
                continue
            txt = model.text_features(tok["tokens"].to(dev), tok["mask"].to(dev))
            view, views = self._box_views(cs, None if boxes is None else np.asarray(boxes)[s:e])
            loc = torch.empty(e - s, dtype=torch.float64)
            patches = torch.from_numpy(arr["patch_tokens"])
            row_of = {int(x): k for k, x in enumerate(u_sid.tolist())}
            by_size: dict[int, list[int]] = {}
            for v, (sid, keep) in enumerate(views):
                by_size.setdefault(self.n_patches if keep is None else len(keep), []).append(v)
            for n, vs in by_size.items():
                feats = torch.stack([patches[row_of[views[v][0]]] if views[v][1] is None
                                     else patches[row_of[views[v][0]]][torch.from_numpy(views[v][1])] for v in vs])
                img = model.image_features(feats.to(dev))
                local_of = {v: k for k, v in enumerate(vs)}
                ps = np.flatnonzero(np.isin(view, vs))
                ii = torch.tensor([local_of[int(view[p])] for p in ps], device=dev)
                loc[torch.from_numpy(ps)] = model.score_pairs(img, txt, ii, inv_t[ps].to(dev)).double().cpu()
            out[s:e] = (g + lam * loc).numpy()
        return out

    def _stored_texts(self, caption_ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{caption_id: (tokens [m, d], embed)} for the ids the clip_tokens artifact holds (its frozen
        encodings, as training saw them), read from their images' samples."""
        import polars as pl

        cids = np.unique(np.asarray(caption_ids, np.int64))
        cids = cids[cids >= 0]
        if not cids.size or "captions" not in self.art.tables():
            return {}
        own = self.art.scan("captions").select("caption_id", "sample_id").filter(
            pl.col("caption_id").is_in(cids.tolist())).collect()
        owners = np.unique(own["sample_id"].to_numpy())
        owners = owners[self._rows(owners) >= 0]
        out = {}
        if not owners.size:
            return out
        arr = self._read_images(owners, fields=("text_tokens", "text_mask", "text_embed", "caption_ids"))
        want = set(cids.tolist())
        for tk, mk, em, ci in zip(arr["text_tokens"], arr["text_mask"], arr["text_embed"], arr["caption_ids"]):
            for j, c in enumerate(np.asarray(ci).tolist()):
                if c in want:
                    m = np.asarray(mk[j], bool)
                    out[int(c)] = (torch.from_numpy(np.array(tk[j])[m]).float(), torch.from_numpy(np.array(em[j])).float())
        return out

    @torch.no_grad()
    def retrieval_scores(self, model: ConceptOTModel, sample_ids, caption_ids, texts) -> dict:
        """ConceptOT G.4: ``global`` = g [I, T]; the two-stage protocol (global top-``rerank_top_k``
        candidates per query, reranked by g + lambda_local * s_local, the rest below them in g order)
        ranks each direction over its own candidates, so it is returned per direction:
        ``rerank/i2t`` (read along rows) and ``rerank/t2i`` (read along columns), both [I, T].
        Captions the artifact holds use their stored (frozen) encodings; others are encoded."""
        sids = np.asarray(sample_ids, np.int64).reshape(-1)
        cids = np.asarray(caption_ids, np.int64).reshape(-1)
        texts = list(texts)
        stored = self._stored_texts(cids)
        miss = [t for c, t in zip(cids.tolist(), texts) if c not in stored]
        enc = self._texts(miss) if miss else None
        enc_of = {t: k for k, t in enumerate(miss)}
        toks, embs = [], []
        for c, t in zip(cids.tolist(), texts):
            if c in stored:
                toks.append(stored[c][0])
                embs.append(stored[c][1])
            else:
                k = enc_of[t]
                toks.append(enc["tokens"][k][enc["mask"][k]])
                embs.append(enc["embed"][k])
        arr = self._read_images(sids)
        ie = _normalize(torch.from_numpy(arr["image_embed"]).float())
        te = _normalize(torch.stack(embs).float())
        g = ie @ te.t()
        res = {"global": g.double().numpy()}
        if self.cfg.variant == "global-only":
            return res
        dev = self.device
        pt = torch.from_numpy(arr["patch_tokens"])  # image features in chunks: no float32 copy of all patches
        img = _cat_feats([model.image_features(pt[s:s + 64].to(dev)) for s in range(0, len(pt), 64)])
        tt = torch.nn.utils.rnn.pad_sequence(toks, batch_first=True)
        mm = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in toks], batch_first=True)
        txt = model.text_features(tt.to(dev), mm.to(dev))

        def local(qi, ti):
            return model.score_pairs(img, txt, qi.to(dev), ti.to(dev)).cpu()

        s_i2t, s_t2i = two_stage_scores(g, local, self.cfg.lambda_local, self.cfg.rerank_top_k, self.cfg.eval_pairs_chunk)
        res["rerank/i2t"] = s_i2t.numpy()
        res["rerank/t2i"] = s_t2i.t().contiguous().numpy()
        return res

    # ------------------------------------------------------ Sec. 2.6 box prediction (grounding)
    def job_metrics(self, model: ConceptOTModel, out_dir: Path) -> list:
        return self._grounding(model)

    @torch.no_grad()
    def _grounding(self, model: ConceptOTModel) -> list:
        """Sec. 2.6 weak grounding: for every phrase of the eval images that the samples artifact
        links to ground-truth boxes (``phrases`` + ``instances`` tables: the generated dataset,
        Flickr30k Entities), the phrase heatmap h_i(J) over the tokens of the phrase's character span
        is thresholded (``box_threshold`` x its max) and the patch envelope is the predicted box; the
        ground truth is the union box of the phrase's instances (Flickr30k Entities' merged-box
        convention). Rows: accuracy@IoU0.5 (%) and mean IoU (fraction), chance = the whole-image box
        (the note gives a uniformly random patch-aligned box too). [] when the dataset has no phrases
        or the variant has no heatmap (global-only)."""
        from train.eval.interface import Row

        if self.cfg.variant == "global-only" or self.samples is None:
            return []
        tables = self.samples.tables()
        if "phrases" not in tables or "instances" not in tables:
            return []
        import polars as pl

        t = self._table()
        ev = t["ids"][t["eval"]]
        ph = self.samples.scan("phrases").filter(pl.col("sample_id").is_in(ev.tolist())).sort(
            ["sample_id", "caption_id", "start"]).collect()
        if ph.height == 0:
            return []
        skipped: dict[str, int] = {}
        total = ph.height
        has_inst = ph["instance_ids"].list.len() > 0
        if int((~has_inst).sum()):
            skipped["no_box"] = int((~has_inst).sum())
        ph = ph.filter(has_inst)
        if ph.height > self.cfg.grounding_max_phrases:
            skipped["over_grounding_max_phrases"] = ph.height - self.cfg.grounding_max_phrases
            ph = ph.head(self.cfg.grounding_max_phrases)
        inst = self.samples.scan("instances").select("sample_id", "instance_id", "box").filter(
            pl.col("sample_id").is_in(ph["sample_id"].unique().to_list())).collect()
        box_of = {(int(a), int(b)): np.asarray(c, np.float64) for a, b, c in inst.iter_rows()}
        u_sid = np.unique(ph["sample_id"].to_numpy())
        arr = self._read_images(u_sid, fields=("patch_tokens", "text_tokens", "text_mask", "caption_ids", "token_offsets"))
        row_of = {int(s): k for k, s in enumerate(u_sid.tolist())}
        # per phrase: (image row, caption tokens, token weights, gt box)
        pi, toks, weights, gts, psid = [], [], [], [], []
        for sid, cid, st, en, insts in ph.select("sample_id", "caption_id", "start", "end", "instance_ids").iter_rows():
            r = row_of[int(sid)]
            cl = np.asarray(arr["caption_ids"][r]).tolist()
            if int(cid) not in cl:
                skipped["caption_not_in_clip_tokens"] = skipped.get("caption_not_in_clip_tokens", 0) + 1
                continue
            j = cl.index(int(cid))
            m = np.asarray(arr["text_mask"][r][j], bool)
            offs = np.asarray(arr["token_offsets"][r][j])[: int(m.sum())]
            w = _span_mask(offs, int(st), int(en))
            bx = [box_of.get((int(sid), int(i))) for i in insts]
            bx = [b for b in bx if b is not None and len(b) == 4]
            if not w.any():
                skipped["phrase_tokens_truncated"] = skipped.get("phrase_tokens_truncated", 0) + 1
                continue
            if not bx:
                skipped["no_box"] = skipped.get("no_box", 0) + 1
                continue
            b = np.stack(bx)
            pi.append(r)
            psid.append(int(sid))
            toks.append(torch.from_numpy(np.array(arr["text_tokens"][r][j][: int(m.sum())])).float())
            weights.append(torch.from_numpy(w.astype(np.float32)))
            gts.append([b[:, 0].min(), b[:, 1].min(), b[:, 2].max(), b[:, 3].max()])
        if not pi:
            raise NoScorableItems(f"grounding: 0 of {total} phrases of the eval images could be scored ({skipped})")
        side = int(round(math.sqrt(self.n_patches)))
        dev = self.device
        pt = torch.from_numpy(np.asarray(arr["patch_tokens"]))
        img = _cat_feats([model.image_features(pt[s:s + 64].to(dev)) for s in range(0, len(pt), 64)])
        heat = []
        ch = max(1, self.cfg.eval_pairs_chunk // 4)
        for s in range(0, len(pi), ch):
            tk = torch.nn.utils.rnn.pad_sequence(toks[s:s + ch], batch_first=True)
            mk = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x), dtype=torch.bool) for x in toks[s:s + ch]],
                                                 batch_first=True)
            W = torch.nn.utils.rnn.pad_sequence(weights[s:s + ch], batch_first=True)
            txt = model.text_features(tk.to(dev), mk.to(dev))
            n = len(toks[s:s + ch])
            heat.append(model.phrase_heatmaps(img, txt, torch.tensor(pi[s:s + ch], device=dev),
                                              torch.arange(n, device=dev), W.to(dev)).float().cpu().numpy())
        H = np.concatenate(heat)
        wh = self._image_sizes(np.asarray(psid))
        gt = np.asarray(gts, np.float64)
        pred = heatmap_boxes(H, wh[:, 0], wh[:, 1], side, self.cfg.box_threshold)
        iou = box_iou(pred, gt)
        whole = box_iou(np.stack([np.zeros(len(wh)), np.zeros(len(wh)), wh[:, 0], wh[:, 1]], 1), gt)
        rnd = box_iou(random_patch_boxes(len(wh), wh[:, 0], wh[:, 1], side, seed=0), gt)
        n, nsk = len(iou), sum(skipped.values())
        note = (f"chance: the whole-image box; a random patch-aligned box scores {100 * float((rnd >= 0.5).mean()):.1f}% "
                f"/ mean IoU {float(rnd.mean()):.3f}; threshold {self.cfg.box_threshold} x max, patch envelope")
        return [Row("grounding", "all", "acc@IoU0.5", 100 * float((iou >= 0.5).mean()), n, 100 * float((whole >= 0.5).mean()),
                    nsk, dict(skipped), "%", note),
                Row("grounding", "all", "mean_IoU", float(iou.mean()), n, float(whole.mean()), nsk, dict(skipped),
                    "fraction", note)]

    # SugarCrepe-format pairwise accuracy
    def _sugarcrepe_dirs(self) -> list[Path]:
        if self.cfg.sugarcrepe_dirs is not None:
            return [Path(d) for d in self.cfg.sugarcrepe_dirs]
        dirs = []
        ds = self.manifest.dataset
        if ds.kind == "synthetic":
            root = Path(ds.synthetic.root) if ds.synthetic.root else _local_output(self.manifest) / "source" / "synthetic"
            dirs.append(root / "sugarcrepe")
        dirs.append(Path(__file__).resolve().parents[4] / "shared" / "data" / "sugarcrepe")
        return dirs

    def _sugarcrepe(self, model: ConceptOTModel) -> dict:
        data = read_sugarcrepe(self._sugarcrepe_dirs())
        if not data or self.samples is None:
            return {}
        from train.eval.images import ImageMatcher

        # the harness's matching: source id, file name, stem, COCO id across naming schemes (a Karpathy
        # COCO_val2014_000000391895.jpg matches SugarCrepe's 000000391895.jpg)
        matcher = ImageMatcher(self.samples)
        wanted: dict[str, list[tuple[int, str, str]]] = {}
        for kind, rows in sorted(data.items()):
            rows = rows[: self.cfg.sugarcrepe_max_per_kind] if self.cfg.sugarcrepe_max_per_kind else rows
            sids = matcher.match_many([r["filename"] for r in rows])
            for r, sid in zip(rows, sids.tolist()):
                if sid >= 0:
                    wanted.setdefault(kind, []).append((sid, r["caption"], r["negative_caption"]))
        n_total = sum(len(v) for v in data.values())
        res: dict = {"sugarcrepe/triples": float(sum(len(v) for v in wanted.values())), "sugarcrepe/available": float(n_total)}
        if not wanted:
            return res
        sids = sorted({s for v in wanted.values() for s, _, _ in v})
        img_rows = self._load_images(sids)
        if not img_rows:
            return res
        texts = sorted({t for v in wanted.values() for _, a, b in v for t in (a, b)})
        tok = self._encode_texts(texts)
        row_of_sid = {s["sample_id"]: k for k, s in enumerate(img_rows)}
        dev = self.device
        patches = torch.from_numpy(np.stack([np.asarray(s["patch_tokens"]) for s in img_rows]))
        ie = _normalize(torch.from_numpy(np.stack([np.asarray(s["image_embed"]) for s in img_rows])).float())
        img = model.image_features(patches.to(dev))
        txt = model.text_features(tok["tokens"].to(dev), tok["mask"].to(dev))
        te = _normalize(tok["embed"].float())
        t_of = {t: k for k, t in enumerate(texts)}
        accs_g, accs = [], []
        for kind, triples in sorted(wanted.items()):
            triples = [t for t in triples if t[0] in row_of_sid]
            if not triples:
                continue
            ii = torch.tensor([row_of_sid[s] for s, _, _ in triples])
            tp = torch.tensor([t_of[a] for _, a, _ in triples])
            tn = torch.tensor([t_of[b] for _, _, b in triples])
            gp, gn = (ie[ii] * te[tp]).sum(-1), (ie[ii] * te[tn]).sum(-1)
            lam = self.cfg.lambda_local
            if self.cfg.variant != "global-only":
                sp = model.score_pairs(img, txt, ii.to(dev), tp.to(dev)).cpu()
                sn = model.score_pairs(img, txt, ii.to(dev), tn.to(dev)).cpu()
            else:
                sp = sn = torch.zeros(len(triples))
            a_g = pairwise_accuracy(gp, gn)
            a = pairwise_accuracy(gp + lam * sp, gn + lam * sn)
            res[f"sugarcrepe/{kind}"] = a
            res[f"sugarcrepe_global/{kind}"] = a_g
            main = kind_of(kind) in MAIN_KINDS
            accs.append((a, len(triples), main))
            accs_g.append((a_g, len(triples), main))
        if accs:
            # overall as the harness: triple-weighted over the five main kinds (ConceptOT Table 3), when present
            if any(m for _, _, m in accs):
                accs, accs_g = [x for x in accs if x[2]], [x for x in accs_g if x[2]]
            n = sum(k for _, k, _ in accs)
            res["sugarcrepe/overall"] = sum(a * k for a, k, _ in accs) / n
            res["sugarcrepe_global/overall"] = sum(a * k for a, k, _ in accs_g) / n
            res["chance/sugarcrepe"] = res["chance/sugarcrepe_global"] = 50.0  # pairwise, ties wrong
        return res

    def _load_images(self, sids: list[int]) -> list[dict]:
        want = set(sids)
        out = []
        tab = None
        if "images" in self.art.tables():
            import polars as pl

            tab = self.art.scan("images").select("sample_id", "shard").filter(pl.col("sample_id").is_in(sorted(want))).collect()
        shards = sorted(set(tab["shard"].to_list())) if tab is not None and tab.height else None
        paths = [str(self.art.dir / s) for s in shards] if shards else self.shards
        for p in paths:
            for s in read_shard(p, fields=("patch_tokens", "image_embed", "caption_ids")):
                if s["sample_id"] in want:
                    out.append({"sample_id": s["sample_id"], "patch_tokens": np.array(s["patch_tokens"]),
                                "image_embed": np.array(s["image_embed"])})
        return out

    def _encode_texts(self, texts: list[str]) -> dict:
        """Frozen CLIP text tower (models.clip) for texts that are not in the artifact (shared with
        the visual-tokens job: :func:`train.clip_text.encode_texts_like_artifact`)."""
        from train.clip_text import encode_texts_like_artifact

        return encode_texts_like_artifact(self.manifest.models.clip, self.art.manifest, list(texts))

    # phrase heatmaps (Sec. 2.6), one PNG per image: the first caption's words
    def _heatmaps(self, model: ConceptOTModel, samples: list[dict], E: dict, out_dir: Path) -> None:
        if self.cfg.variant == "global-only":
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        texts, images, spans = {}, {}, {}
        if self.samples is not None:
            import polars as pl

            cids = [int(s["caption_ids"][0]) for s in samples]
            if "captions" in self.samples.tables():
                for cid, text in self.samples.scan("captions").select("caption_id", "text").filter(
                        pl.col("caption_id").is_in(cids)).collect().iter_rows():
                    texts[int(cid)] = text
            sids = [int(s["sample_id"]) for s in samples]
            for sid, im in self.samples.scan("samples").select("sample_id", "image").filter(
                    pl.col("sample_id").is_in(sids)).collect().iter_rows():
                images[int(sid)] = im
            if "phrases" in self.samples.tables():  # the dataset's phrase spans, where it has them
                for cid, st, en in self.samples.scan("phrases").select("caption_id", "start", "end").filter(
                        pl.col("caption_id").is_in(cids)).sort(["caption_id", "start"]).collect().iter_rows():
                    spans.setdefault(int(cid), []).append((int(st), int(en)))
        side = int(round(math.sqrt(self.n_patches)))
        first_cap = {int(c): k for k, c in enumerate(E["caption_id"].tolist())}
        for k, s in enumerate(samples):
            cid = int(s["caption_ids"][0])
            t = first_cap[cid]
            text = texts.get(cid, "")
            offs = np.asarray(s["token_offsets"])[0] if "token_offsets" in s else None
            n_valid = int(E["txt"]["mask"][t].sum())
            groups = (_span_groups(text, offs, n_valid, spans[cid]) if cid in spans and offs is not None
                      else _word_groups(text, offs, n_valid))[:4]
            if not groups:
                continue
            fig, axes = plt.subplots(1, len(groups) + 1, figsize=(3 * (len(groups) + 1), 3.2))
            pil = None
            try:
                from pipeline.readers.images import open_image

                from pipeline.loaders.samples import image_resolver

                ref = image_resolver(self.samples.dir, self.manifest)(images.get(int(s["sample_id"])))
                pil = open_image(ref).convert("RGB") if ref else None
            except Exception:
                pil = None
            axes[0].set_title("image", fontsize=8)
            if pil is not None:
                axes[0].imshow(pil)
            axes[0].axis("off")
            for ax, (word, idx) in zip(axes[1:], groups):
                w = torch.zeros(E["txt"]["mask"].shape[1])
                w[idx] = 1
                h = model.phrase_heatmap(E["img"], E["txt"], k, t, w.to(self.device)).float().cpu()
                if h.numel() != side * side:
                    continue
                hm = h.view(side, side).numpy()
                if pil is not None:
                    ax.imshow(pil)
                    ax.imshow(hm, cmap="jet", alpha=0.5, extent=(0, pil.width, pil.height, 0))
                else:
                    ax.imshow(hm, cmap="jet")
                ax.set_title(f'"{word}"', fontsize=8)
                ax.axis("off")
            fig.suptitle(f"{self.cfg.variant}: {text[:80]}", fontsize=8)
            fig.tight_layout()
            fig.savefig(out_dir / f"heatmap_{int(s['sample_id'])}.png", dpi=80)
            plt.close(fig)


def _span_mask(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """bool [M]: the (non-special) tokens whose character span [a, b) overlaps [start, end)."""
    o = np.asarray(offsets)
    return (o[:, 1] > o[:, 0]) & (o[:, 0] < end) & (o[:, 1] > start)


def _span_groups(text: str, offsets, n_valid: int, spans) -> list[tuple[str, list[int]]]:
    """Token indices of each phrase span (start, end) of the caption: the tokens whose character
    spans overlap it (Sec. 2.6 phrases, as the dataset marks them)."""
    o = np.asarray(offsets)[:n_valid]
    out = []
    for a, b in spans:
        idx = np.flatnonzero(_span_mask(o, a, b)).tolist()
        if idx:
            out.append((text[a:b], idx))
    return out


def _word_groups(text: str, offsets, n_valid: int) -> list[tuple[str, list[int]]]:
    """Token indices of each whitespace word of the caption (from the tokens' character spans);
    without offsets, every non-special token is its own group."""
    if offsets is None or not text:
        return [(f"tok{j}", [j]) for j in range(1, max(1, n_valid - 1))]
    words: dict[tuple[int, int], list[int]] = {}
    spans = []
    pos = 0
    for w in text.split():
        st = text.index(w, pos)
        spans.append((st, st + len(w)))
        pos = st + len(w)
    for j in range(min(n_valid, len(offsets))):
        a, b = int(offsets[j][0]), int(offsets[j][1])
        if a == b:
            continue
        for sp in spans:
            if sp[0] <= a < sp[1]:
                words.setdefault(sp, []).append(j)
                break
    stop = {"a", "an", "the", "of", "and", "is", "are", "with", "to", "in", "on", "at", "its", "there"}
    out = [(text[a:b].strip(".,"), idx) for (a, b), idx in sorted(words.items())]
    return [x for x in out if x[0].lower() not in stop]


def _cat_feats(parts: list[dict], pad_dim: int | None = None) -> dict:
    if not parts or not parts[0]:
        return {}
    out = {}
    for k in parts[0]:
        ts = [p[k] for p in parts]
        if pad_dim is not None and ts[0].dim() > 1:
            L = max(t.shape[pad_dim] for t in ts)
            padded = []
            for t in ts:
                shape = list(t.shape)
                shape[pad_dim] = L
                z = torch.zeros(shape, dtype=t.dtype, device=t.device)
                z.narrow(pad_dim, 0, t.shape[pad_dim]).copy_(t)
                padded.append(z)
            ts = padded
        out[k] = torch.cat(ts)
    return out
