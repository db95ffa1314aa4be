"""C3's held-out evaluation (eval splits only; partners and negatives from them, full membership).

MCP: AUC (and balanced accuracy at p = 0.5) of each held-out positive (I_i, I_j, C) against one
negative per type, with chance 0.5 / 50% and the frozen global-cosine baseline
(cos(e_i, t_C) + cos(e_j, t_C)). type1: (I_i, I'_j, C), I'_j a held-out image without C. Type 2 is
concept-matched (see :meth:`HeldOut.donors`): the negative carries the concept of the positive it
is ranked against, so a scorer of the concept alone is at AUC 0.5 exactly; ``type2_as_trained``
beside them: (I_i, I_j, C') with C' drawn as training draws it (independent of the positives'
concepts), the row on which a concept prior shows (``control: images_zeroed`` measures it).
Retrieval (MCC): precision@k of images containing C among the top k by
cos(psi_c^T h_q, psi_c^T h_k), with its base rate, per concept length, overall and over rare
concepts.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F

from pipeline.loaders.concept_tokens import ConceptTokens
from train.eval.interface import Row
from train.eval.intervals import auc_estimate, interval, mean
from train.jobs.c3.model import conditioned_sim, encode_batch, fuse_pairs

EVAL_TYPES = ("type1", "type2_random", "type2_hard", "type2_binding", "type2_as_trained")
AS_TRAINED_NOTE = ("C' drawn as training draws it (type2_source, from the training rows' concepts), not "
                   "concept-matched: a model of the concept alone can exceed 0.5 here (the concept prior)")
RARE_BASE = 0.1  # c3_retrieval/rare: concepts contained by at most this share of the held-out images


def pq_text(ct: ConceptTokens) -> dict[int, str]:
    """concept_id -> text of the encoded concepts (from the artifact's index tables)."""
    if getattr(ct, "_texts", None) is None:
        t = ct.art.read("index", columns=["concept_id", "text"])
        ct._texts = dict(zip(t["concept_id"].to_pylist(), t["text"].to_pylist()))
    return ct._texts


class HeldOut:
    """The held-out triplets of the eval split (built once) and the figures of a model on them.

    ``data``: the job's :class:`~train.jobs.c3.batches.TripletBatches` (store, encodings,
    membership, hard negatives, the negative draws and the batch layout); ``is_eval`` [store rows];
    ``samples`` (captions, for the binding negatives; may be None) and ``concepts`` artifacts."""

    def __init__(self, cfg, data, is_eval: np.ndarray, samples, concepts, device):
        self.cfg, self.data, self.is_eval, self.samples, self.concepts, self.device = (
            cfg, data, is_eval, samples, concepts, device)
        self.store, self.ct, self.member = data.store, data.ct, data.member
        self._eval_cache = None

    def eval_set(self) -> dict:
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
        negs = {"type1": self.data.draw_non_member(c, ev_rows, rng, avoid=ai),
                "type2_random": self.donors(ai, aj, c, rng, "random"),
                "type2_hard": self.donors(ai, aj, c, rng, "hard") if self.data.hn_keys is not None else None,
                "type2_binding": self.donors(ai, aj, c, rng, "binding")}
        # as training draws C' (own stream: the concept-matched draws above stay as they were)
        negs["type2_as_trained"] = self.data.draw_concept(c, ai, aj, np.random.default_rng([cfg.seed, 4243]),
                                                          cfg.type2_source, self.data.r_cid)
        res.update({"ai": ai, "aj": aj, "c": c, "negs": negs, "members": members, "ev_rows": ev_rows})
        self._eval_cache = res
        return res

    def donors(self, ai, aj, c, rng, kind: str) -> np.ndarray | None:
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
            hard = self.data.hard_of(c)  # hard[d]: the nearest concepts of d's concept
        elif kind == "binding":
            cap_words = self.caption_words(si)
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

    def caption_words(self, sids) -> dict[int, set] | None:
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

    def triplet_scores(self, model, ai, aj, c) -> tuple[np.ndarray, np.ndarray]:
        """(model score, frozen global-cosine baseline) of triplets (I_i, I_j, C)."""
        cfg = self.cfg
        out, base = [], []
        ch = max(1, cfg.eval_chunk // 2)
        for s in range(0, len(c), ch):
            a, j, cc = ai[s:s + ch], aj[s:s + ch], c[s:s + ch]
            if cfg.objectives == "mcc" or cfg.formulation == "pairwise":
                bt = self.data.features(np.unique(np.concatenate([a, j])), np.unique(cc))
            else:
                bt = self.data.assemble(a, j, cc, None, None, train=False, itm=False)
            patches, hI, tok, mask, hT = encode_batch(model, bt, self.device)
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
                pi = fuse_pairs(model, patches, hI, tok, mask, hT, torch.from_numpy(ii), torch.from_numpy(ci))
                pj = fuse_pairs(model, patches, hI, tok, mask, hT, torch.from_numpy(jj), torch.from_numpy(ci))
                out.append((model.mcp_logit(pi) + model.mcp_logit(pj)).float().cpu().numpy())
                continue
            z = fuse_pairs(model, patches, hI, tok, mask, hT, bt["pair_img"], bt["pair_txt"], cfg.eval_chunk)
            out.append(model.mcp_logit(z[bt["mcp_a"].to(self.device)], z[bt["mcp_b"].to(self.device)]).float().cpu().numpy())
        return np.concatenate(out), np.concatenate(base)

    def rows(self, model) -> list:
        """The held-out MCP figures per negative type and the concept-conditioned retrieval."""
        model.eval()
        rows: list[Row] = []
        E = self.eval_set()
        note_src = "MCC conditioned cosine" if self.cfg.objectives == "mcc" else "phi_MCP logit"
        if "c" not in E:
            raise ValueError(f"c3: no held-out triplet: {E['n_eval_images']} images in {self.cfg.eval_splits} and no "
                             "encoded concept contained by two of them")
        with torch.no_grad():
            sp, bp = self.triplet_scores(model, E["ai"], E["aj"], E["c"])
            for name in EVAL_TYPES:
                neg = E["negs"].get(name)
                if neg is None:
                    rows.append(Row("c3_mcp", name, "auc", float("nan"), 0, 0.5, len(E["c"]), {"no_source": len(E["c"])},
                                    "fraction", "negatives of this type unavailable"))
                    continue
                v = neg >= 0
                skipped = int((~v).sum())
                n = int(v.sum())
                if n == 0:  # before scoring: nothing to score (few held-out images)
                    rows.append(Row("c3_mcp", name, "auc", float("nan"), 0, 0.5, skipped, {"no_negative_found": skipped},
                                    "fraction", "no negative of this type could be drawn"))
                    continue
                if name == "type1":
                    sn, bn = self.triplet_scores(model, E["ai"][v], neg[v], E["c"][v])
                elif name == "type2_as_trained":  # the positive's image pair with an independently drawn C'
                    sn, bn = self.triplet_scores(model, E["ai"][v], E["aj"][v], neg[v])
                else:  # concept-matched: positive d's image pair with this positive's concept
                    sn, bn = self.triplet_scores(model, E["ai"][neg[v]], E["aj"][neg[v]], E["c"][v])
                sk = {"no_negative_found": skipped} if skipped else {}
                # intervals (train.eval.intervals): triplets reuse images, and the AUC compares every positive with
                # every negative, so a triplet is clustered two ways: by its anchor image and by its negative's own
                # image (type 1: the non-member image; concept-matched type 2: the donor positive's anchor), each
                # way resampled independently; type2_as_trained's negative is the positive's own image pair
                img = E["ai"][v]
                img2 = None if name == "type2_as_trained" else (neg[v] if name == "type1" else E["ai"][neg[v]])
                note = note_src + ("; " + AS_TRAINED_NOTE if name == "type2_as_trained" else "")
                est, fest = auc_estimate(sp[v], sn, img, img2), auc_estimate(bp[v], bn, img, img2)
                rows.append(Row("c3_mcp", name, "auc", est.value, n, 0.5, skipped, sk, "fraction", note, est=est)
                            .with_ci(interval(est)))
                rows.append(Row("c3_mcp", name, "auc_global_cosine", fest.value, n, 0.5, skipped, sk, "fraction",
                                "frozen CLIP: cos(e_i, t_C) + cos(e_j, t_C)", baseline_for=f"{name}/auc", est=fest)
                            .with_ci(interval(fest)))
                if self.cfg.objectives != "mcc":
                    acc = 50.0 * (float((sp[v] > 0).mean()) + float((sn <= 0).mean()))
                    per = 0.5 * ((sp[v] > 0).astype(np.float64) + (sn <= 0))  # per triplet: its mean of the two
                    est = mean(per, img)
                    rows.append(Row("c3_mcp", name, "balanced_accuracy", acc, 2 * n, 50.0, skipped, sk, "%",
                                    "threshold p = 0.5; mean of positive and negative accuracy", est=est)
                                .with_ci(interval(est, 100.0)))
            rows += self.retrieval_rows(model, E)
        return rows

    def retrieval_rows(self, model, E) -> list:
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
                st = stats.setdefault(key, [[], [], [], []])
                st[0].append(p_model.cpu().numpy())
                st[1].append(p_glob.cpu().numpy())
                st[2].append(np.full(len(qs), base))
                st[3].append(sid_ev[qs])  # the query images: one image queries for each concept it holds
        rows = []
        note = "" if cfg.objectives != "mcp" else "phi_MCC untrained (objectives: mcp)"
        for key, (pm, pg, br, qi) in sorted(stats.items()):
            pm, pg, br, qi = np.concatenate(pm), np.concatenate(pg), np.concatenate(br), np.concatenate(qi)
            # per query, clustered by the query image; the frozen baseline on the same queries in the same order
            em, eg = mean(pm, qi), mean(pg, qi)
            rows.append(Row("c3_retrieval", key, f"precision@{k}", 100 * float(pm.mean()), len(pm), 100 * float(br.mean()),
                            0, {}, "%", ("chance = base rate of images containing C; " + note).strip("; "), est=em)
                        .with_ci(interval(em, 100.0)))
            rows.append(Row("c3_retrieval", key, f"precision@{k}_global_cosine", 100 * float(pg.mean()), len(pg),
                            100 * float(br.mean()), 0, {}, "%", "frozen CLIP image embeddings, unconditioned",
                            baseline_for=f"{key}/precision@{k}", est=eg).with_ci(interval(eg, 100.0)))
        return rows
