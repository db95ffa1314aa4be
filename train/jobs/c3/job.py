"""Implementation of the `c3` job (see train/jobs/c3/__init__.py for the description)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F

from pipeline.io.artifacts import Artifact, ArtifactMissing
from pipeline.loaders.concept_tokens import ConceptTokens, open_artifact
from train.eval.interface import Row
from train.jobs.c3.data import ImageStore, log, resolve
from train.jobs.c3.model import C3Model, conditioned_sim, mcc_logits
from train.job import Job

TYPE_POS, TYPE1, TYPE2 = 0, 1, 2
EVAL_TYPES = ("type1", "type2_random", "type2_hard", "type2_binding")
RARE_BASE = 0.1  # c3_retrieval/rare: concepts contained by at most this share of the held-out images


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counting one half (Mann-Whitney U / n_pos n_neg)."""
    pos, neg = np.asarray(pos, np.float64), np.sort(np.asarray(neg, np.float64))
    lo, hi = np.searchsorted(neg, pos, "left"), np.searchsorted(neg, pos, "right")
    return float((lo + 0.5 * (hi - lo)).sum() / (len(pos) * len(neg)))


def _csr(keys: np.ndarray, values: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    off = np.zeros(n + 1, np.int64)
    np.add.at(off, keys + 1, 1)
    return np.cumsum(off), values[order]


class C3Job(Job):
    NAME = "c3"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.skips: dict[str, int] = {}
        try:
            self.art = Artifact(resolve(manifest, cfg.artifact))
        except ArtifactMissing as e:
            raise FileNotFoundError(f"{e}; c3 reads clip_tokens (`pipeline run extract-clip-tokens`)") from None
        self.shards = [str(p) for p in self.art.files("shards")]
        if not self.shards:
            raise ValueError(f"{self.art.dir}: no shards in the clip_tokens artifact")
        self.store = ImageStore(self.shards, cfg.image_cache)
        try:
            self.concepts = Artifact(resolve(manifest, cfg.concepts_artifact))
        except ArtifactMissing as e:
            raise FileNotFoundError(f"{e}; c3 reads the concept database (`pipeline run mine-concepts`)") from None
        self.ct = ConceptTokens(open_artifact(resolve(manifest, cfg.concept_tokens_artifact)))
        self._check_provenance()
        self.d_t = 0 if self.ct.pooled_only else self.ct.d_t
        if self.ct.P != self.store.P:
            raise ValueError(f"concept_tokens pooled width {self.ct.P} != clip_tokens image_embed width {self.store.P}: "
                             "encoded with another CLIP")
        self._splits()
        self.member = self.ct.membership(self.store.sids)
        self._train_rows()
        self._hard_negatives()
        if cfg.control == "shuffled":
            rng = np.random.default_rng([cfg.seed, 777])
            self.feat_row = np.arange(len(self.store.sids))
            tr = self.train_img_rows
            self.feat_row[tr] = tr[rng.permutation(len(tr))]
        else:
            self.feat_row = np.arange(len(self.store.sids))
        self.store.preload(np.concatenate([self.store.sids[self.train_img_rows], self.eval_sids]))
        self._eval_cache = None
        self._clip = None

    # ---------------------------------------------------------------------------------- inputs
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
        cfg = self.cfg
        split = None
        try:
            samples = Artifact(resolve(self.manifest, cfg.samples_artifact))
            t = samples.scan("samples").select("sample_id", "split").collect()
            split = dict(zip(t["sample_id"].to_list(), t["split"].to_list()))
        except (ArtifactMissing, KeyError):
            samples = None
        self.samples = samples
        sids = self.store.sids

        def split_of(s: int) -> str:
            if split is not None and split.get(s):
                return str(split[s])
            r = s % 20
            return "val" if r == 18 else "test" if r == 19 else "train"

        sp = np.array([split_of(int(s)) for s in sids], dtype=object)
        self.is_train = np.isin(sp, cfg.train_splits) & (self.store.n_captions >= 0)
        self.is_eval = np.isin(sp, cfg.eval_splits)
        self.train_img_rows = np.nonzero(self.is_train)[0]
        self.eval_sids = sids[self.is_eval]
        if len(self.train_img_rows) < 2:
            raise ValueError(f"{self.art.dir}: fewer than 2 training-split images ({cfg.train_splits}) in clip_tokens")

    def _train_rows(self) -> None:
        """(anchor, concept, partners) rows of the training split: partners restricted to training
        images that have clip_tokens; rows without one, without an encoding, or whose anchor has no
        clip_tokens are skipped and counted."""
        try:
            t = self.concepts.read("concepts", columns=["sample_id", "concept_id", "partners"])
        except KeyError:
            raise ValueError(f"{self.concepts.dir}: no concepts table") from None
        if t.num_rows == 0:
            raise ValueError(f"{self.concepts.dir}: the concept database is empty (no concept shared by two samples)")
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
            raise ValueError(f"{self.concepts.dir}: no training triplet: every concept row was skipped ({self.skips})")
        sel = p_ok & keep[owner]
        remap = np.full(len(sid), -1, np.int64)
        remap[rows] = np.arange(len(rows))
        self.p_off, self.p_rows = _csr(remap[owner[sel]], prow[sel], len(rows))
        self.r_anchor = a_row[rows]
        self.r_cid = cid[rows]
        log(f"{len(rows)} training concept rows ({len(np.unique(self.r_cid))} concepts); skipped: "
            + ", ".join(f"{k}={v}" for k, v in self.skips.items()))

    def _hard_negatives(self) -> None:
        self.hn_keys = None
        if "hard_negatives" not in self.concepts.tables():
            if self.cfg.type2_source == "hard":
                log("no hard_negatives table: type-2 negatives are drawn at random")
            return
        t = self.concepts.read("hard_negatives", columns=["concept_id", "negatives"])
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
    @property
    def batch_size(self) -> int:
        return min(self.cfg.batch_size, len(self.r_cid))

    def batches_per_epoch(self) -> int:
        return len(self.r_cid) // self.batch_size

    def batches(self, epoch: int, start: int):
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.r_cid))
        B = self.batch_size
        for b in range(start, self.batches_per_epoch()):
            yield self.make_batch(order[b * B:(b + 1) * B], np.random.default_rng([self.cfg.seed, epoch, b, 1]))

    def _draw_non_member(self, cids: np.ndarray, pool: np.ndarray, rng, avoid: np.ndarray | None = None) -> np.ndarray:
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

    def _draw_concept(self, cids: np.ndarray, rows_i: np.ndarray, rows_j: np.ndarray, rng, source: str,
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
            t1 = self._draw_non_member(c, self.train_img_rows, rng, avoid=ai)
        if use_mcp and cfg.negatives in ("both", "type2"):
            t2 = self._draw_concept(c, ai, aj, rng, cfg.type2_source, self.r_cid)
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
        out = self._features(u_img, u_con)
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

    def _features(self, u_img: np.ndarray, u_con: np.ndarray) -> dict:
        patches, embed = self.store.get(self.feat_row[u_img])
        g = self.ct.gather(self.ct.rows(u_con))
        out = {"_u_img": u_img, "img_rows": torch.from_numpy(u_img), "patches": torch.from_numpy(patches),
               "embed": torch.from_numpy(embed), "con_id": torch.from_numpy(u_con),
               "txt_pooled": torch.from_numpy(g["pooled"])}
        if "tokens" in g:
            out["txt_tokens"], out["txt_mask"] = torch.from_numpy(g["tokens"]), torch.from_numpy(g["mask"])
        return out

    # ------------------------------------------------------------------------------- interface
    def build_model(self):
        return C3Model(self.cfg, self.store.d_v, self.d_t, self.store.P, self.store.N)

    def _encode(self, model: C3Model, batch: dict):
        dev = self.device
        patches = batch["patches"].to(dev)
        hI = model.image_cls(batch["embed"].to(dev), patches)
        tok = batch.get("txt_tokens")
        mask = batch.get("txt_mask")
        tok = tok.to(dev) if tok is not None else None
        mask = mask.to(dev) if mask is not None else None
        hT = model.concept_cls(batch["txt_pooled"].to(dev), tok, mask)
        return patches, hI, tok, mask, hT

    def _fuse_pairs(self, model, patches, hI, tok, mask, hT, pi, pt, chunk: int | None = None):
        pi, pt = pi.to(self.device), pt.to(self.device)
        if chunk is None or len(pi) <= chunk:
            return model.fuse(hI[pi], patches[pi], hT[pt], None if tok is None else tok[pt],
                              None if mask is None else mask[pt])
        return torch.cat([self._fuse_pairs(model, patches, hI, tok, mask, hT, pi[s:s + chunk], pt[s:s + chunk])
                          for s in range(0, len(pi), chunk)])

    def loss(self, model: C3Model, batch: dict):
        cfg = self.cfg
        dev = self.device
        patches, hI, tok, mask, hT = self._encode(model, batch)
        loss = torch.zeros((), device=dev)
        logs: dict[str, float] = {}
        z = None
        if len(batch["pair_img"]):
            z = self._fuse_pairs(model, patches, hI, tok, mask, hT, batch["pair_img"], batch["pair_txt"])
        if "mcp_a" in batch:
            za = z[batch["mcp_a"].to(dev)]
            zb = z[batch["mcp_b"].to(dev)] if "mcp_b" in batch else None
            logit = model.mcp_logit(za, zb).float()
            y = batch["mcp_y"].to(dev)
            l_mcp = F.binary_cross_entropy_with_logits(logit, y)
            loss = loss + cfg.w_mcp * l_mcp
            with torch.no_grad():
                t = batch["mcp_type"].to(dev)
                logs["loss_mcp"] = float(l_mcp)
                logs["mcp_acc"] = 100.0 * float(((logit > 0).float() == y).float().mean())
                logs["mcp_pos_rows"] = float((t == TYPE_POS).sum())
                logs["mcp_type1_rows"] = float((t == TYPE1).sum())
                logs["mcp_type2_rows"] = float((t == TYPE2).sum())
        if "mcc_i" in batch:
            psi = model.psi(hT[batch["mcc_c"].to(dev)])
            lg = mcc_logits(psi.float(), hI[batch["mcc_i"].to(dev)].float(), hI[batch["mcc_j"].to(dev)].float())
            lg = lg.masked_fill(batch["mcc_fn"].to(dev), float("-inf")) / cfg.mcc_temperature
            l_mcc = F.cross_entropy(lg, torch.arange(lg.shape[0], device=dev))
            loss = loss + cfg.w_mcc * l_mcc
            logs["loss_mcc"] = float(l_mcc.detach())
            logs["mcc_false_neg_masked"] = float(batch["mcc_fn"].sum())
        if "itm_pair" in batch:
            li = model.phi_itm(z[batch["itm_pair"].to(dev)]).squeeze(-1).float()
            l_itm = F.binary_cross_entropy_with_logits(li, batch["itm_y"].to(dev))
            loss = loss + cfg.w_itm * l_itm
            logs["loss_itm"] = float(l_itm.detach())
        return loss, logs

    # ------------------------------------------------------------------------------ evaluation
    def _eval_set(self) -> dict:
        """Held-out triplets (eval split only) with one negative of each type per positive."""
        if self._eval_cache is not None:
            return self._eval_cache
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 4242])
        ev_rows = np.nonzero(self.is_eval)[0]
        ev_sids = self.store.sids[ev_rows]
        m = self.member
        # concepts with >= 2 held-out members (encoded ones only: membership covers encoded concepts)
        mem_c = (m.keys >> 32)
        mem_s = m.sids[(m.keys & 0xFFFFFFFF).astype(np.int64)]
        in_ev = np.isin(mem_s, ev_sids)
        mc, ms = mem_c[in_ev], mem_s[in_ev]
        ucon, cnt = np.unique(mc, return_counts=True)
        good = set(ucon[cnt >= 2].tolist())
        res = {"n_eval_images": len(ev_rows), "skips": {}}
        if not good or len(ev_rows) < 3:
            self._eval_cache = res
            return res
        by_sample: dict[int, list[int]] = {}
        for cc, ss in zip(mc.tolist(), ms.tolist()):
            if cc in good:
                by_sample.setdefault(ss, []).append(cc)
        members = {c: m.members_of(c) for c in good}
        members = {c: v[np.isin(v, ev_sids)] for c, v in members.items()}
        sids = sorted(by_sample)
        rng.shuffle(sids)
        per = max(1, -(-cfg.eval_max_triplets // max(1, len(sids))))
        A, J, C = [], [], []
        for s in sids:
            cs = by_sample[s]
            for c in rng.permutation(cs)[:per]:
                others = members[int(c)][members[int(c)] != s]
                A.append(s), J.append(int(others[rng.integers(len(others))])), C.append(int(c))
                if len(A) >= cfg.eval_max_triplets:
                    break
            if len(A) >= cfg.eval_max_triplets:
                break
        ai, aj, c = self.store.index(np.array(A)), self.store.index(np.array(J)), np.array(C, np.int64)
        negs = {"type1": self._draw_non_member(c, ev_rows, rng, avoid=ai),
                "type2_random": self._donors(ai, aj, c, rng, "random"),
                "type2_hard": self._donors(ai, aj, c, rng, "hard") if self.hn_keys is not None else None,
                "type2_binding": self._donors(ai, aj, c, rng, "binding")}
        res.update({"ai": ai, "aj": aj, "c": c, "negs": negs, "members": members, "ev_rows": ev_rows})
        self._eval_cache = res
        return res

    def _donors(self, ai, aj, c, rng, kind: str) -> np.ndarray | None:
        """Concept-matched type-2 negatives of the held-out set: for each positive (I_i, I_j, C), the
        index d of another held-out positive whose two images (I_k, I_l) both lack C; the negative
        is (I_k, I_l, C), i.e. the type-2 negative (I_k, I_l, C' = C) of positive d. Every negative
        thus carries a positive's concept and a positive's image pair, so the concepts of the
        negatives are distributed as those of the positives they are compared with (a model that
        scores the concept alone is at AUC 0.5 exactly) and the image pairs nearly so. ``kind``:
        random (any such d); hard (C is one of the FAISS nearest concepts of d's concept in
        ``hard_negatives``); binding (C has >= 2 words, all of them words of I_k's captions: the
        attribute-binding swap, e.g. C = "blue circle" for I_k = "a red circle and a blue
        square"). -1 where no d qualifies (counted as skipped)."""
        n = len(c)
        si, sj = self.store.sids[ai], self.store.sids[aj]
        hard = need = lack = None
        if kind == "hard":
            hard = self.hard_of(c)  # hard[d]: the nearest concepts of d's concept
        elif kind == "binding":
            cap_words = self._caption_words(si)
            if cap_words is None:
                return None
            text = pq_text(self.ct)
            cw = [text.get(int(x), "").split() for x in c]
            vocab = {w: k for k, w in enumerate(sorted({w for ws in cw for w in ws}))}
            need = np.zeros((n, len(vocab)), np.float32)
            for t, ws in enumerate(cw):
                if len(ws) >= 2:
                    need[t, [vocab[w] for w in ws]] = 1
            lack = np.ones((n, len(vocab)), np.float32)  # lack[d, w]: word w is in none of I_k's captions
            for d, sid in enumerate(si.tolist()):
                lack[d, [vocab[w] for w in cap_words.get(int(sid), ()) if w in vocab]] = 0
        out = np.full(n, -1, np.int64)
        step = max(1, 4_000_000 // max(1, n * (hard.shape[1] if hard is not None else 1)))  # bounded memory
        for s in range(0, n, step):
            e = min(n, s + step)
            rows = np.arange(s, e)
            ok = ~self.member.contains(c[s:e, None], si[None, :]) & ~self.member.contains(c[s:e, None], sj[None, :])
            ok[rows - s, rows] = False
            if hard is not None:
                ok &= (hard[None, :, :] == c[s:e, None, None]).any(-1)
            elif need is not None:
                ok &= (need[s:e].sum(1) > 0)[:, None] & (need[s:e] @ lack.T == 0)
            score = np.where(ok, rng.random((e - s, n)), -1.0)
            d = np.argmax(score, axis=1)
            out[s:e] = np.where(ok[rows - s, d], d, -1)
        return out

    def _caption_words(self, sids) -> dict[int, set] | None:
        """Normalised words (the miner's normalisation) of the captions of ``sids``; None when the
        samples artifact has no captions."""
        if self.samples is None or "captions" not in self.samples.tables():
            return None
        from pipeline.concepts.normalize import Normalizer

        mp = self.concepts.manifest.get("parameters", {})
        norm = Normalizer(lowercase=mp.get("lowercase", True), unicode_form=mp.get("unicode_form", "NFKC"),
                          token_pattern=mp.get("token_pattern", Normalizer.token_pattern))
        want = np.unique(sids).tolist()
        caps = self.samples.scan("captions").select("sample_id", "text").filter(pl.col("sample_id").is_in(want)).collect()
        words: dict[int, set] = {}
        for s, toks in zip(caps["sample_id"].to_list(), norm.token_lists(caps["text"]).to_list()):
            words.setdefault(int(s), set()).update(toks or [])
        return words

    def _triplet_scores(self, model, ai, aj, c) -> tuple[np.ndarray, np.ndarray]:
        """(model score, frozen global-cosine baseline) of triplets (I_i, I_j, C)."""
        cfg = self.cfg
        out, base = [], []
        ch = max(1, cfg.eval_chunk // 2)
        for s in range(0, len(c), ch):
            a, j, cc = ai[s:s + ch], aj[s:s + ch], c[s:s + ch]
            if cfg.objectives == "mcc" or cfg.formulation == "pairwise":
                bt = self._features(np.unique(np.concatenate([a, j])), np.unique(cc))
            else:
                bt = self.assemble(a, j, cc, None, None, train=False, itm=False)
            patches, hI, tok, mask, hT = self._encode(model, bt)
            u_img, u_con = bt["_u_img"], bt["con_id"].numpy()
            ii, ci = np.searchsorted(u_img, a), np.searchsorted(u_con, cc)
            jj = np.searchsorted(u_img, j)
            e = F.normalize(bt["embed"].float(), dim=-1)
            t = F.normalize(bt["txt_pooled"].float(), dim=-1)
            base.append(((e[ii] * t[ci]).sum(-1) + (e[jj] * t[ci]).sum(-1)).numpy())
            if cfg.objectives == "mcc":
                psi = model.psi(hT[torch.from_numpy(ci)])
                hi, hj = hI[torch.from_numpy(ii)], hI[torch.from_numpy(jj)]
                out.append(F.cosine_similarity(torch.einsum("bp,bpr->br", hi, psi), torch.einsum("bp,bpr->br", hj, psi),
                                               dim=-1).cpu().numpy())
                continue
            if cfg.formulation == "pairwise":  # pairwise head on a triplet: sum of the two pairs' logits
                pi = self._fuse_pairs(model, patches, hI, tok, mask, hT, torch.from_numpy(ii), torch.from_numpy(ci))
                pj = self._fuse_pairs(model, patches, hI, tok, mask, hT, torch.from_numpy(jj), torch.from_numpy(ci))
                out.append((model.mcp_logit(pi) + model.mcp_logit(pj)).float().cpu().numpy())
                continue
            z = self._fuse_pairs(model, patches, hI, tok, mask, hT, bt["pair_img"], bt["pair_txt"], cfg.eval_chunk)
            out.append(model.mcp_logit(z[bt["mcp_a"].to(self.device)], z[bt["mcp_b"].to(self.device)]).float().cpu().numpy())
        return np.concatenate(out), np.concatenate(base)

    def job_metrics(self, model, out_dir: Path) -> list:
        model.eval()
        rows: list[Row] = []
        E = self._eval_set()
        note_src = "MCC conditioned cosine" if self.cfg.objectives == "mcc" else "phi_MCP logit"
        if "c" not in E:
            raise ValueError(f"c3: no held-out triplet: {E['n_eval_images']} images in {self.cfg.eval_splits} and no "
                             "encoded concept contained by two of them")
        with torch.no_grad():
            sp, bp = self._triplet_scores(model, E["ai"], E["aj"], E["c"])
            for name in EVAL_TYPES:
                neg = E["negs"].get(name)
                if neg is None:
                    rows.append(Row("c3_mcp", name, "auc", float("nan"), 0, 0.5, len(E["c"]), {"no_source": len(E["c"])},
                                    "fraction", "negatives of this type unavailable"))
                    continue
                v = neg >= 0
                skipped = int((~v).sum())
                if name == "type1":
                    sn, bn = self._triplet_scores(model, E["ai"][v], neg[v], E["c"][v])
                else:  # concept-matched: positive d's image pair with this positive's concept
                    sn, bn = self._triplet_scores(model, E["ai"][neg[v]], E["aj"][neg[v]], E["c"][v])
                n = int(v.sum())
                if n == 0:
                    rows.append(Row("c3_mcp", name, "auc", float("nan"), 0, 0.5, skipped, {"no_negative_found": skipped},
                                    "fraction", "no negative of this type could be drawn"))
                    continue
                sk = {"no_negative_found": skipped} if skipped else {}
                rows.append(Row("c3_mcp", name, "auc", auc(sp[v], sn), n, 0.5, skipped, sk, "fraction", note_src))
                rows.append(Row("c3_mcp", name, "auc_global_cosine", auc(bp[v], bn), n, 0.5, skipped, sk, "fraction",
                                "frozen CLIP: cos(e_i, t_C) + cos(e_j, t_C)"))
                if self.cfg.objectives != "mcc":
                    acc = 50.0 * (float((sp[v] > 0).mean()) + float((sn <= 0).mean()))
                    rows.append(Row("c3_mcp", name, "balanced_accuracy", acc, 2 * n, 50.0, skipped, sk, "%",
                                    "threshold p = 0.5; mean of positive and negative accuracy"))
            rows += self._retrieval_rows(model, E)
        return rows

    def _retrieval_rows(self, model, E) -> list:
        """Concept-conditioned retrieval among held-out images: precision@k of images containing C
        in the top k by cos(psi_c^T h_q, psi_c^T h_k), queries = C's held-out members."""
        cfg = self.cfg
        ev_rows = E["ev_rows"]
        k = cfg.retrieval_k
        if len(ev_rows) <= k:
            return [Row("c3_retrieval", "all", f"precision@{k}", float("nan"), 0, None, len(ev_rows),
                        {"fewer_images_than_k": len(ev_rows)}, "%", "too few held-out images")]
        dev = self.device
        hs, es = [], []
        for s in range(0, len(ev_rows), 256):
            p, e = self.store.get(ev_rows[s:s + 256])  # held-out images: always their own features
            hs.append(model.image_cls(torch.from_numpy(e).to(dev), torch.from_numpy(p).to(dev)).float())
            es.append(F.normalize(torch.from_numpy(e).float(), dim=-1))
        H, Eg = torch.cat(hs), torch.cat(es).to(dev)
        sid_ev = self.store.sids[ev_rows]
        cons = sorted(E["members"])
        rng = np.random.default_rng([cfg.seed, 99])
        if len(cons) > cfg.eval_max_concepts:
            cons = sorted(rng.choice(cons, cfg.eval_max_concepts, replace=False).tolist())
        text = pq_text(self.ct)
        g = self.ct.gather(self.ct.rows(np.array(cons)))
        tok = torch.from_numpy(g["tokens"]).to(dev) if "tokens" in g else None
        msk = torch.from_numpy(g["mask"]).to(dev) if "mask" in g else None
        hC = model.concept_cls(torch.from_numpy(g["pooled"]).to(dev), tok, msk)
        psi = model.psi(hC).float()
        stats: dict[str, list] = {}
        for q, c in enumerate(cons):
            mem = np.isin(sid_ev, E["members"][c])
            qs = np.nonzero(mem)[0]
            if len(qs) < 2:
                continue
            S = conditioned_sim(psi[q], H[qs], H)
            G = Eg[qs] @ Eg.t()
            Sq = torch.arange(len(qs))
            S[Sq, torch.from_numpy(qs)] = float("-inf")
            G[Sq, torch.from_numpy(qs)] = float("-inf")
            memt = torch.from_numpy(mem).to(dev)
            p_model = memt[S.topk(k, dim=1).indices].float().mean(1)
            p_glob = memt[G.topk(k, dim=1).indices].float().mean(1)
            base = (len(qs) - 1) / (len(ev_rows) - 1)
            n = len(text.get(int(c), "").split()) or 0
            # "rare": concepts in <= 10% of the held-out images, where precision@k can exceed its
            # base rate many times over (at a base rate of 1/3, 3x the base rate is already 100%)
            for key in (f"n={n}", "all") + (("rare",) if base <= RARE_BASE else ()):
                st = stats.setdefault(key, [[], [], []])
                st[0].append(p_model.cpu().numpy())
                st[1].append(p_glob.cpu().numpy())
                st[2].append(np.full(len(qs), base))
        rows = []
        note = "" if cfg.objectives != "mcp" else "phi_MCC untrained (objectives: mcp)"
        for key, (pm, pg, br) in sorted(stats.items()):
            pm, pg, br = np.concatenate(pm), np.concatenate(pg), np.concatenate(br)
            rows.append(Row("c3_retrieval", key, f"precision@{k}", 100 * float(pm.mean()), len(pm), 100 * float(br.mean()),
                            0, {}, "%", ("chance = base rate of images containing C; " + note).strip("; ")))
            rows.append(Row("c3_retrieval", key, f"precision@{k}_global_cosine", 100 * float(pg.mean()), len(pg),
                            100 * float(br.mean()), 0, {}, "%", "frozen CLIP image embeddings, unconditioned"))
        return rows

    def evaluate(self, model, out_dir: Path) -> dict:
        try:
            rows = self.job_metrics(model, out_dir)
        except ValueError as e:  # no held-out triplet: say so (metrics.jsonl), never a silent blank
            log(f"evaluation: {e}")
            return {"eval_error": str(e), **{f"data/skipped_{k}": v for k, v in self.skips.items()}}
        res = {f"{r.benchmark}/{r.subset}/{r.metric}": r.value for r in rows if r.n}
        res.update({f"chance/{r.benchmark}/{r.subset}/{r.metric}": r.chance for r in rows if r.n and r.chance is not None})
        res.update({f"data/skipped_{k}": v for k, v in self.skips.items()})
        res["data/train_rows"] = len(self.r_cid)
        return res

    # ------------------------------------------------------------------ harness scoring interface
    def scorable_sample_ids(self):
        return set(self.store.sids.tolist())

    def _text_encoder(self):
        if self._clip is None:
            from pipeline.models.clip import load_clip

            model, _, tok, record = load_clip(self.manifest.models.clip)
            want = (self.ct.clip_record or {}).get("weights_sha256")
            if want and record.get("weights_sha256") != want:
                raise ValueError(f"models.clip ({self.manifest.models.clip}) is not the CLIP that encoded "
                                 f"{self.ct.art.dir}; score_pairs needs the same text tower")
            self._clip = (model, tok)
        return self._clip

    def encode_texts(self, texts: list[str]) -> dict:
        """Frozen CLIP text tower for arbitrary texts, stored as concept_tokens would store them."""
        from pipeline.concepts.concept_tokens import encode_concepts

        model, tok = self._text_encoder()
        proj = bool(self.ct.art.manifest.get("parameters", {}).get("project_tokens", False))
        return encode_concepts(model, tok, texts, self.ct.max_tokens, 256, self.ct.pooled_only, proj)

    def score_pairs(self, model, sample_ids, texts, boxes=None, encoded: dict | None = None):
        """s(I, T) for arbitrary texts (see the package docstring); ``encoded`` (tests, benchmarks):
        precomputed encodings of ``texts`` in encode_texts' format."""
        if boxes is not None:
            self.crop_note = "c3 scores the whole image (cached features have no crops)"
        sids = np.asarray(sample_ids, np.int64)
        rows = self.store.index(sids)
        if (rows < 0).any():
            bad = int(sids[rows < 0][0])
            raise ValueError(f"c3.score_pairs: sample {bad} has no clip_tokens features")
        uniq, t_idx = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
        enc = encoded if encoded is not None else self.encode_texts([str(t) for t in uniq])
        if encoded is not None:
            t_idx = np.arange(len(texts))
        dev = self.device
        out = np.zeros(len(sids), np.float64)
        ch = self.cfg.eval_chunk
        model.eval()
        with torch.no_grad():
            for s in range(0, len(sids), ch):
                r, ti = rows[s:s + ch], t_idx[s:s + ch]
                p, e = self.store.get(r)
                patches, embed = torch.from_numpy(p).to(dev), torch.from_numpy(e).to(dev)
                hI = model.image_cls(embed, patches)
                pooled = torch.from_numpy(enc["pooled"][ti]).to(dev)
                tok = msk = None
                if "tokens" in enc:
                    n = enc["n_tokens"][ti]
                    M = int(n.max())
                    tok = torch.from_numpy(enc["tokens"][ti, :M]).to(dev)
                    msk = torch.from_numpy(np.arange(M)[None] < n[:, None]).to(dev)
                hT = model.concept_cls(pooled, tok, msk)
                if self.cfg.objectives == "mcc":
                    out[s:s + ch] = F.cosine_similarity(hI, hT, dim=-1).cpu().numpy()
                    continue
                z = model.fuse(hI, patches, hT, tok, msk)
                lg = model.mcp_logit(z, z) if self.cfg.formulation == "triplet" else model.mcp_logit(z)
                out[s:s + ch] = lg.float().cpu().numpy()
        return out


def pq_text(ct: ConceptTokens) -> dict[int, str]:
    """concept_id -> text of the encoded concepts (from the artifact's index tables)."""
    if getattr(ct, "_texts", None) is None:
        t = ct.art.read("index", columns=["concept_id", "text"])
        ct._texts = dict(zip(t["concept_id"].to_pylist(), t["text"].to_pylist()))
    return ct._texts
