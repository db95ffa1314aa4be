"""C3's training triplets and their batches (Song et al. 2024, Sec. 3.2-3.3, Eq. 5-6).

A training row is (I_i, C, partners): an anchor image whose captions contain the mined concept C
and the other training images that contain it (the concepts table's K1 partners, restricted to
the training split and to images with clip_tokens). A batch draws one partner I_j per row
(positive (I_i, I_j, C)) and the MCP negatives: type 1 (I_i, I'_j, C), I'_j a training image
without C; type 2 (I_i, I_j, C'), C' a concept neither image contains (hard: one of C's FAISS
nearest concepts, else occurrence-weighted random). The batch holds each distinct image and
concept once, the fusion pairs the objectives need, and the MCC in-batch false negatives.

Everything a batch holds is a pure function of (seed, epoch, batch index): the epoch's order is a
permutation of the training rows drawn from ``np.random.default_rng([seed, epoch])``, and each
batch draws its partners and negatives from ``default_rng([seed, epoch, batch, 1])``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from train.jobs.c3.data import log

TYPE_POS, TYPE1, TYPE2 = 0, 1, 2


def _csr(keys: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    off = np.zeros(n + 1, np.int64)
    np.add.at(off, keys + 1, 1)
    return np.cumsum(off), values[order]


class TripletBatches:
    """The training rows, the hard-negative table and the batches of the C3 job.

    ``store``: the clip_tokens :class:`~train.jobs.c3.data.ImageStore`; ``ct``: the concept
    encodings (:class:`pipeline.loaders.concept_tokens.ConceptTokens`); ``member``: full concept
    membership of the store's samples; ``is_train`` [store rows]: training-split images.
    ``control: shuffled`` reads every training image's features from another training image
    (``feat_row``), the chance control."""

    fit = None  # the job's Job.fit_batch (C3Job sets it)
    _fit_bs = None

    def __init__(self, cfg, store, ct, member, concepts, is_train: np.ndarray):
        self.cfg, self.store, self.ct, self.member, self.is_train = cfg, store, ct, member, is_train
        self.train_img_rows = np.nonzero(is_train)[0]
        self.skips: dict[str, int] = {}
        self._train_rows(concepts)
        self._hard_negatives(concepts)
        self.feat_row = np.arange(len(store.sids))
        if cfg.control == "shuffled":
            rng = np.random.default_rng([cfg.seed, 777])
            tr = self.train_img_rows
            self.feat_row[tr] = tr[rng.permutation(len(tr))]

    def _train_rows(self, concepts) -> None:
        """(anchor, concept, partners) rows of the training split: partners restricted to training
        images that have clip_tokens; rows without one, without an encoding, or whose anchor has no
        clip_tokens are skipped and counted."""
        try:
            t = concepts.read("concepts", columns=["sample_id", "concept_id", "partners"])
        except KeyError:
            raise ValueError(f"{concepts.dir}: no concepts table") from None
        if t.num_rows == 0:
            raise ValueError(f"{concepts.dir}: the concept database is empty (no concept shared by two samples)")
        sid = t["sample_id"].to_numpy()
        cid = t["concept_id"].to_numpy()
        plist = t["partners"].combine_chunks()
        p_off = np.asarray(plist.offsets).astype(np.int64)
        p_val = np.asarray(plist.values).astype(np.int64)
        a_row = self.store.index(sid)
        keep = a_row >= 0
        self.skips["anchor_without_clip_tokens"] = int((~keep).sum())
        in_train = np.zeros(len(sid), bool)
        in_train[keep] = self.is_train[a_row[keep]]
        self.skips["anchor_not_in_train_split"] = int((keep & ~in_train).sum())
        keep &= in_train
        crow = self.ct.rows(cid)
        enc = crow >= 0
        self.skips["concept_not_encoded"] = int((keep & ~enc).sum())
        keep &= enc
        # partners: training split, with clip_tokens
        prow = self.store.index(p_val)
        p_ok = prow >= 0
        p_ok[p_ok] = self.is_train[prow[p_ok]]
        owner = np.repeat(np.arange(len(sid)), np.diff(p_off))
        n_ok = np.bincount(owner[p_ok], minlength=len(sid))
        self.skips["no_partner_in_train_split"] = int((keep & (n_ok == 0)).sum())
        keep &= n_ok > 0
        rows = np.nonzero(keep)[0]
        if len(rows) == 0:
            raise ValueError(f"{concepts.dir}: no training triplet: every concept row was skipped ({self.skips})")
        sel = p_ok & keep[owner]
        remap = np.full(len(sid), -1, np.int64)
        remap[rows] = np.arange(len(rows))
        self.p_off, self.p_rows = _csr(remap[owner[sel]], prow[sel], len(rows))
        self.r_anchor = a_row[rows]
        self.r_cid = cid[rows]
        # the anchor images and their rows (epoch_unit: images draws one row per anchor and epoch)
        self.anchors, inv = np.unique(self.r_anchor, return_inverse=True)
        self.a_off, self.a_rows = _csr(inv, np.arange(len(rows)), len(self.anchors))
        log(f"{len(rows)} training concept rows ({len(np.unique(self.r_cid))} concepts, {len(self.anchors)} anchor "
            f"images; an epoch is {self.units()} {self.cfg.epoch_unit}); skipped: "
            + ", ".join(f"{k}={v}" for k, v in self.skips.items()))

    def _hard_negatives(self, concepts) -> None:
        self.hn_keys = None
        if "hard_negatives" not in concepts.tables():
            if self.cfg.type2_source == "hard":
                log("no hard_negatives table: type-2 negatives are drawn at random")
            return
        t = concepts.read("hard_negatives", columns=["concept_id", "negatives"])
        if t.num_rows == 0:
            return
        lst = t["negatives"].combine_chunks()
        off = np.asarray(lst.offsets).astype(np.int64)
        vals = np.asarray(lst.values).astype(np.int64)
        keys = t["concept_id"].to_numpy()
        order = np.argsort(keys)
        self.hn_keys = keys[order]
        starts, ends = off[:-1][order], off[1:][order]
        self.hn_start, self.hn_end, self.hn_vals = starts, ends, vals

    def hard_of(self, cids: np.ndarray, width: int = 10) -> np.ndarray:
        """[len(cids), width] hard-negative concept ids (nearest first), -1 padded."""
        out = np.full((len(cids), width), -1, np.int64)
        if self.hn_keys is None:
            return out
        at = np.searchsorted(self.hn_keys, cids)
        atc = np.minimum(at, len(self.hn_keys) - 1)
        ok = self.hn_keys[atc] == cids
        for k in np.nonzero(ok)[0]:
            v = self.hn_vals[self.hn_start[atc[k]]:self.hn_end[atc[k]]][:width]
            out[k, : len(v)] = v
        return out

    # ---------------------------------------------------------------------------------- batches
    def units(self) -> int:
        """Triplets in an epoch: the anchor images (``epoch_unit: images``, the paper's pass over the
        dataset) or the concept rows (``concept_rows``)."""
        return len(self.anchors) if self.cfg.epoch_unit == "images" else len(self.r_cid)

    @property
    def batch_size(self) -> int:
        if self.fit is not None:  # the job's train.job.Job.fit_batch: the short-split rule, one process or N workers
            if self._fit_bs is None:
                self._fit_bs = self.fit(self.units(), "triplets")
            return self._fit_bs
        return min(self.cfg.batch_size, self.units())

    def batches_per_epoch(self) -> int:
        """Batches in an epoch (all ranks together: train.job.rank_batches splits them)."""
        return self.units() // self.batch_size

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """The epoch's training rows in order. concept_rows: a permutation of all rows; images: a
        permutation of the anchor images, each with one of its rows drawn uniformly (both pure
        functions of (seed, epoch))."""
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(self.units())
        if self.cfg.epoch_unit != "images":
            return order
        n = np.diff(self.a_off)
        pick = (np.random.default_rng([self.cfg.seed, epoch, 2]).random(len(n)) * n).astype(np.int64)
        return self.a_rows[self.a_off[:-1] + pick][order]

    def batches(self, epoch: int, indices: Iterable[int]):
        """The epoch's batches ``indices`` (pure function of (seed, epoch, index))."""
        order = self.epoch_rows(epoch)
        B = self.batch_size
        for b in indices:
            yield self.make_batch(order[b * B:(b + 1) * B], np.random.default_rng([self.cfg.seed, epoch, b, 1]))

    def draw_non_member(self, cids: np.ndarray, pool: np.ndarray, rng, avoid: np.ndarray | None = None) -> np.ndarray:
        """For each concept, a store row from ``pool`` whose sample does not contain it (-1: none in
        neg_tries draws)."""
        T = self.cfg.neg_tries
        cand = pool[rng.integers(0, len(pool), size=(len(cids), T))]
        bad = self.member.contains(cids[:, None], self.store.sids[cand])
        if avoid is not None:
            bad |= cand == avoid[:, None]
        first = np.argmax(~bad, axis=1)
        ok = ~bad[np.arange(len(cids)), first]
        return np.where(ok, cand[np.arange(len(cids)), first], -1)

    def draw_concept(self, cids: np.ndarray, rows_i: np.ndarray, rows_j: np.ndarray, rng, source: str,
                      pool: np.ndarray) -> np.ndarray:
        """C' per row: encoded, != C, contained by neither image; hard first when asked, random
        (occurrence-weighted from ``pool``) otherwise or as fallback. -1 when none was found."""
        out = np.full(len(cids), -1, np.int64)
        si, sj = self.store.sids[rows_i], self.store.sids[rows_j]
        if source == "hard" and self.hn_keys is not None:
            hard = self.hard_of(cids)
            ok = (hard >= 0) & (self.ct.rows(np.maximum(hard, 0)) >= 0) & (hard != cids[:, None])
            ok &= ~self.member.contains(hard, si[:, None]) & ~self.member.contains(hard, sj[:, None])
            score = np.where(ok, rng.random(hard.shape), -1.0)
            k = np.argmax(score, axis=1)
            has = ok[np.arange(len(cids)), k]
            out[has] = hard[np.arange(len(cids)), k][has]
        need = out < 0
        if need.any():
            T = self.cfg.neg_tries
            cand = pool[rng.integers(0, len(pool), size=(int(need.sum()), T))]
            bad = (cand == cids[need, None]) | self.member.contains(cand, si[need, None]) | self.member.contains(cand, sj[need, None])
            first = np.argmax(~bad, axis=1)
            ok = ~bad[np.arange(len(cand)), first]
            out[np.nonzero(need)[0][ok]] = cand[np.arange(len(cand)), first][ok]
        return out

    def make_batch(self, rows: np.ndarray, rng) -> dict:
        """Triplets of training rows ``rows`` with their partners and negatives (see the module docs)."""
        cfg = self.cfg
        B = len(rows)
        ai = self.r_anchor[rows]
        c = self.r_cid[rows]
        n_p = self.p_off[rows + 1] - self.p_off[rows]
        aj = self.p_rows[self.p_off[rows] + (rng.random(B) * n_p).astype(np.int64)]
        use_mcp = cfg.objectives in ("mcp", "both")
        t1 = t2 = None
        if use_mcp and cfg.negatives in ("both", "type1"):
            t1 = self.draw_non_member(c, self.train_img_rows, rng, avoid=ai)
        if use_mcp and cfg.negatives in ("both", "type2"):
            t2 = self.draw_concept(c, ai, aj, rng, cfg.type2_source, self.r_cid)
        return self.assemble(ai, aj, c, t1, t2, rng, train=True)

    def assemble(self, ai, aj, c, t1, t2, rng=None, train: bool = False, itm: bool | None = None) -> dict:
        """Unique images and texts of the triplets, the fusion pairs and the MCP/MCC/ITM items."""
        cfg = self.cfg
        B = len(ai)
        itm = cfg.itm if itm is None else itm
        imgs = [ai, aj] + ([t1[t1 >= 0]] if t1 is not None else [])
        con = [c] + ([t2[t2 >= 0]] if t2 is not None else [])
        u_img, u_con = np.unique(np.concatenate(imgs)), np.unique(np.concatenate(con))
        ii = lambda r: np.searchsorted(u_img, r)  # noqa: E731
        cc = lambda x: np.searchsorted(u_con, x)  # noqa: E731
        pair_keys: list[np.ndarray] = []
        n_con = len(u_con)

        def pair(img_idx, con_idx):
            k = img_idx.astype(np.int64) * (n_con + B + 1) + con_idx
            pair_keys.append(k)
            return k

        mcp_a, mcp_b, mcp_y, mcp_t = [], [], [], []
        trip = cfg.formulation == "triplet"
        use_mcp = cfg.objectives in ("mcp", "both")
        if use_mcp:
            pic = pair(ii(ai), cc(c))
            pjc = pair(ii(aj), cc(c))
            mcp_a.append(pic), mcp_b.append(pjc if trip else None), mcp_y.append(np.ones(B)), mcp_t.append(np.full(B, TYPE_POS))
            if t1 is not None:
                v = t1 >= 0
                pn = pair(ii(t1[v]), cc(c[v]))
                mcp_a.append(pic[v] if trip else pn), mcp_b.append(pn if trip else None)
                mcp_y.append(np.zeros(int(v.sum()))), mcp_t.append(np.full(int(v.sum()), TYPE1))
            if t2 is not None:
                v = t2 >= 0
                pa = pair(ii(ai[v]), cc(t2[v]))
                pb = pair(ii(aj[v]), cc(t2[v]))
                mcp_a.append(pa), mcp_b.append(pb if trip else None)
                mcp_y.append(np.zeros(int(v.sum()))), mcp_t.append(np.full(int(v.sum()), TYPE2))
        # ITM on cached captions: (I_i, T_i) vs (I_other, T_i)
        if itm and rng is not None:
            caps = []
            other = self.train_img_rows[rng.integers(0, len(self.train_img_rows), B)]
            other = np.where(other == ai, self.train_img_rows[(np.searchsorted(self.train_img_rows, ai) + 1) % len(self.train_img_rows)], other)
            for b in range(B):
                n = max(1, int(self.store.n_captions[ai[b]]))
                caps.append(self.store.caption(int(ai[b]), int(rng.integers(0, n))))
            return self._assemble_with_captions(ai, aj, c, t1, t2, caps, other)
        keys = np.unique(np.concatenate(pair_keys)) if pair_keys else np.zeros(0, np.int64)
        stride = n_con + B + 1
        out = self.features(u_img, u_con)
        out.update({"pair_img": torch.from_numpy(keys // stride), "pair_txt": torch.from_numpy(keys % stride)})
        if use_mcp:
            a = np.searchsorted(keys, np.concatenate(mcp_a))
            out["mcp_a"] = torch.from_numpy(a)
            if trip:
                out["mcp_b"] = torch.from_numpy(np.searchsorted(keys, np.concatenate(mcp_b)))
            out["mcp_y"] = torch.from_numpy(np.concatenate(mcp_y).astype(np.float32))
            out["mcp_type"] = torch.from_numpy(np.concatenate(mcp_t))
        if cfg.objectives in ("mcc", "both") and train:
            out["mcc_i"], out["mcc_j"], out["mcc_c"] = (torch.from_numpy(ii(ai)), torch.from_numpy(ii(aj)),
                                                        torch.from_numpy(cc(c)))
            si, sj = self.store.sids[ai], self.store.sids[aj]
            fn = self.member.contains(c[None, :], si[:, None]) & self.member.contains(c[None, :], sj[None, :])
            np.fill_diagonal(fn, False)
            out["mcc_fn"] = torch.from_numpy(fn)
        return out

    def _assemble_with_captions(self, ai, aj, c, t1, t2, caps, other) -> dict:
        """assemble() plus ITM items: captions are appended to the text set after the concepts."""
        base = self.assemble(ai, aj, c, t1, t2, None, train=True, itm=False)
        B = len(ai)
        # rebuild the image set with the ITM negatives appended at the end
        u_img_old = base.pop("_u_img")
        extra = np.setdiff1d(other, u_img_old)
        u_img = np.concatenate([u_img_old, extra])
        pos_of = {int(r): k for k, r in enumerate(u_img)}
        if len(extra):
            p, e = self.store.get(self.feat_row[extra])
            base["patches"] = torch.cat([base["patches"], torch.from_numpy(p)])
            base["embed"] = torch.cat([base["embed"], torch.from_numpy(e)])
        n_con = base["txt_pooled"].shape[0]
        cap_pooled = torch.from_numpy(np.stack([x["pooled"] for x in caps]))
        base["txt_pooled"] = torch.cat([base["txt_pooled"], cap_pooled])
        if "txt_tokens" in base:
            M = max(base["txt_tokens"].shape[1], max(len(x["tokens"]) for x in caps))
            d = base["txt_tokens"].shape[2]
            tok = torch.zeros(n_con + B, M, d, dtype=base["txt_tokens"].dtype)
            mask = torch.zeros(n_con + B, M, dtype=torch.bool)
            tok[:n_con, : base["txt_tokens"].shape[1]] = base["txt_tokens"]
            mask[:n_con, : base["txt_mask"].shape[1]] = base["txt_mask"]
            for b, x in enumerate(caps):
                m = min(M, len(x["tokens"]))
                tok[n_con + b, :m] = torch.from_numpy(x["tokens"][:m].astype(np.float16))
                mask[n_con + b, :m] = True
            base["txt_tokens"], base["txt_mask"] = tok, mask
        P0 = base["pair_img"].shape[0]
        pi = torch.tensor([pos_of[int(r)] for r in ai] + [pos_of[int(r)] for r in other])
        pt = torch.arange(n_con, n_con + B).repeat(2)
        base["pair_img"] = torch.cat([base["pair_img"], pi])
        base["pair_txt"] = torch.cat([base["pair_txt"], pt])
        base["itm_pair"] = torch.arange(P0, P0 + 2 * B)
        base["itm_y"] = torch.cat([torch.ones(B), torch.zeros(B)])
        return base

    def features(self, u_img: np.ndarray, u_con: np.ndarray) -> dict:
        patches, embed = self.store.get(self.feat_row[u_img])
        g = self.ct.gather(self.ct.rows(u_con))
        out = {"_u_img": u_img, "img_rows": torch.from_numpy(u_img), "patches": torch.from_numpy(patches),
               "embed": torch.from_numpy(embed), "con_id": torch.from_numpy(u_con),
               "txt_pooled": torch.from_numpy(g["pooled"])}
        if "tokens" in g:
            out["txt_tokens"], out["txt_mask"] = torch.from_numpy(g["tokens"]), torch.from_numpy(g["mask"])
        return out
