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
from pipeline.loaders.clip_tokens import collate as ct_collate
from pipeline.loaders.clip_tokens import fits_in_memory, read_sample, read_shard
from train.data import ParquetJoin, ShardStream, loader
from train.eval.retrieval import retrieval_report
from train.eval.sugarcrepe import pairwise_accuracy, read_sugarcrepe
from train.jobs.concept_ot.index_negatives import IndexNeighbours, IndexNeighbourStream, SampleTable, index_hits, require_index
from train.loop import Job
from train.jobs.concept_ot.model import ConceptOTModel, _normalize
from train.jobs.concept_ot.ot import anchor_diversity



def _collate_random(samples, rng: random.Random, attach=None):
    """One random caption per image (a module-level function: DataLoader workers pickle it)."""
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


def _resolve(manifest, p: str) -> Path:
    q = Path(p)
    return q if q.is_absolute() else Path(manifest.output) / q


class ConceptOTJob(Job):
    NAME = "concept-ot"

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
                                self._keep_train) if (self.index_dir / "_manifest.json").is_file() else None
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
    def split_of(self, sample_id: int) -> str:
        """The samples artifact's split; without one, a stable hash split (sample_id % 20:
        18 -> val, 19 -> test, as the generated dataset does)."""
        if self._split_join is not None:
            row = self._split_join.lookup(int(sample_id))
            if row is not None and row.get("split"):
                return str(row["split"])
        r = int(sample_id) % 20
        return "val" if r == 18 else "test" if r == 19 else "train"

    def _keep_train(self, s: dict) -> bool:
        return s["caption_ids"].shape[0] > 0 and self.split_of(s["sample_id"]) in self.cfg.train_splits

    def _stream(self) -> ShardStream:
        cfg = self.cfg

        nb = self.neighbours()
        read = functools.partial(read_shard, lazy=self._lazy)
        if cfg.hard_negatives == "index":
            return IndexNeighbourStream(self.shards, read, _collate_random, self.batch_size, neighbours=nb,
                                        m=cfg.index_neighbours,
                                        read_sample=functools.partial(read_sample, lazy=self._lazy),
                                        shuffle=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
                                        keep=self._keep_train)
        collate = _collate_random if nb is None else functools.partial(_collate_random, attach=nb.attach)
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
            n = sum(1 for p in self.shards for s in read_shard(p, fields=("caption_ids",)) if self._keep_train(s))
            if 2 <= n < self.cfg.batch_size:
                import sys

                print(f"concept-ot: training split has {n} samples < batch_size {self.cfg.batch_size}; "
                      f"using batches of {n}", file=sys.stderr)
                self._bs = n
        return self._bs

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = self._stream().count_batches()
        return self._bpe

    def batches(self, epoch: int, start: int):
        return loader(self._stream().set_position(epoch, start), self.cfg.num_workers)

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
        return res

    # SugarCrepe-format pairwise accuracy
    def _sugarcrepe_dirs(self) -> list[Path]:
        if self.cfg.sugarcrepe_dirs is not None:
            return [Path(d) for d in self.cfg.sugarcrepe_dirs]
        dirs = []
        ds = self.manifest.dataset
        if ds.kind == "synthetic":
            root = Path(ds.synthetic.root) if ds.synthetic.root else Path(self.manifest.output) / "source" / "synthetic"
            dirs.append(root / "sugarcrepe")
        dirs.append(Path(__file__).resolve().parents[4] / "shared" / "data" / "sugarcrepe")
        return dirs

    def _sugarcrepe(self, model: ConceptOTModel) -> dict:
        data = read_sugarcrepe(self._sugarcrepe_dirs())
        if not data or self.samples is None:
            return {}
        tab = self.samples.scan("samples").select("sample_id", "source_id", "image").collect()
        by_name: dict[str, int] = {}
        for sid, src, im in tab.iter_rows():
            for key in (str(src), Path(str(im)).name if im is not None else None):
                if key:
                    by_name.setdefault(key, int(sid))
                    by_name.setdefault(Path(key).stem, int(sid))
        wanted: dict[str, list[tuple[int, str, str]]] = {}
        for kind, rows in sorted(data.items()):
            rows = rows[: self.cfg.sugarcrepe_max_per_kind] if self.cfg.sugarcrepe_max_per_kind else rows
            for r in rows:
                sid = by_name.get(r["filename"], by_name.get(Path(r["filename"]).stem))
                if sid is not None:
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
            accs.append((a, len(triples)))
            accs_g.append((a_g, len(triples)))
        if accs:
            n = sum(k for _, k in accs)
            res["sugarcrepe/overall"] = sum(a * k for a, k in accs) / n
            res["sugarcrepe_global/overall"] = sum(a * k for a, k in accs_g) / n
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
        """Frozen CLIP text tower (models.clip) for texts that are not in the artifact."""
        from pipeline.models.clip import encode_texts, load_clip

        model, _, tokenizer, _ = load_clip(self.manifest.models.clip)
        max_tokens = int(self.art.manifest.get("parameters", {}).get("max_text_tokens", 48))
        project = bool(self.art.manifest.get("parameters", {}).get("project_tokens", False))
        toks, masks, embs = [], [], []
        with torch.no_grad():
            for s in range(0, len(texts), 128):
                o = encode_texts(model, tokenizer, texts[s:s + 128], max_tokens, project)
                toks.append(o["text_tokens"].half().float())  # as stored in the artifact (fp16)
                masks.append(o["text_mask"].bool())
                embs.append(o["text_embed"].half().float())
        M = max(t.shape[1] for t in toks)
        toks = [F.pad(t, (0, 0, 0, M - t.shape[1])) for t in toks]
        masks = [F.pad(m, (0, M - m.shape[1])) for m in masks]
        return {"tokens": torch.cat(toks), "mask": torch.cat(masks), "embed": torch.cat(embs)}

    # phrase heatmaps (Sec. 2.6), one PNG per image: the first caption's words
    def _heatmaps(self, model: ConceptOTModel, samples: list[dict], E: dict, out_dir: Path) -> None:
        if self.cfg.variant == "global-only":
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        texts, images = {}, {}
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
        side = int(round(math.sqrt(self.n_patches)))
        first_cap = {int(c): k for k, c in enumerate(E["caption_id"].tolist())}
        for k, s in enumerate(samples):
            cid = int(s["caption_ids"][0])
            t = first_cap[cid]
            text = texts.get(cid, "")
            offs = np.asarray(s["token_offsets"])[0] if "token_offsets" in s else None
            n_valid = int(E["txt"]["mask"][t].sum())
            groups = _word_groups(text, offs, n_valid)[:4]
            if not groups:
                continue
            fig, axes = plt.subplots(1, len(groups) + 1, figsize=(3 * (len(groups) + 1), 3.2))
            pil = None
            try:
                from pipeline.readers.images import open_image

                pil = open_image(images[int(s["sample_id"])]).convert("RGB") if int(s["sample_id"]) in images else None
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
