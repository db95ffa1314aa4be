"""Implementation of the `text-groups` job (see train/jobs/text_groups/__init__.py for the description)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline.io.artifacts import Artifact
from pipeline.loaders.image_groups import ImageGroups
from train.eval.interface import Row
from train.jobs.text_groups import discovery as D
from train.jobs.text_groups.losses import info_nce, reconstruction
from train.jobs.text_groups.model import TextGroupTransformer, VanillaText
from train.jobs.text_groups.tokenizer import encode, load_tokenizer
from train.job import Job, open_artifact, resolve_artifact
from train.loop import load_checkpoint

CLUSTERINGS = ("kmeans", "spectral", "meanshift")
SIMPLE_BASELINES = ("random", "one-group", "chunks")
NO_LEARNING = (*SIMPLE_BASELINES, "untrained")  # baselines that learn nothing (the verdicts' bar)


def _log(msg: str) -> None:
    print(f"text-groups: {msg}", file=sys.stderr)


class TokenTable:
    """Tokenised captions stored ragged (flat int32 ids + start/length per caption), gathered into
    padded batches with one vectorised index."""

    def __init__(self, tok, texts: list[str], max_len: int):
        enc = encode(tok, texts, max_len)
        self.lengths = enc.lengths.astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        keep = np.arange(enc.ids.shape[1])[None, :] < self.lengths[:, None]
        self.flat = enc.ids[keep].astype(np.int32)
        self.truncated, self.empty = enc.truncated, enc.empty

    def batch(self, rows: np.ndarray, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lens = self.lengths[rows]
        L = int(pad_to or lens.max())
        pos = np.arange(L)[None, :]
        mask = pos < lens[:, None]
        idx = np.where(mask, self.starts[rows][:, None] + pos, 0)
        ids = np.where(mask, self.flat[idx], 0).astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(mask)


class TextGroupsJob(Job):
    NAME = "text-groups"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.tok, self.tok_record = load_tokenizer(getattr(getattr(manifest, "models", None), "groupvit", None))
        open_artifact(manifest, cfg.groups_artifact, "image_groups", "text-groups")  # missing: one line naming the stage
        self.groups = ImageGroups(resolve_artifact(manifest, cfg.groups_artifact))
        self.d_img = int(self.groups.shape["groups"][-1])
        self.samples = open_artifact(manifest, cfg.samples_artifact, "samples", self.NAME)
        self.crop_note = "image groups are computed on the whole image (boxes are not used)"
        split = self.samples.read("samples", ["sample_id", "split"]).to_pydict()
        self.split_of = dict(zip(split["sample_id"], split["split"]))
        caps = self.samples.read("captions", ["caption_id", "sample_id", "text"]).to_pydict()
        self.stats: dict[str, int] = {}
        train_sids = {s for s, sp in self.split_of.items() if sp in set(cfg.train_splits)}
        have = set(self.groups.sample_ids.tolist())
        self.stats["train_images_without_groups"] = len(train_sids - have)
        train_sids &= have
        rows = [i for i, s in enumerate(caps["sample_id"]) if s in train_sids]
        rows.sort(key=lambda i: (caps["sample_id"][i], caps["caption_id"][i]))
        texts = [caps["text"][i] or "" for i in rows]
        table = TokenTable(self.tok, texts, cfg.max_len)
        ok = table.lengths > 0
        self.stats["train_captions_empty_after_tokenisation"] = int((~ok).sum())
        self.stats["train_captions_truncated"] = int(table.truncated)
        self.tokens = table
        sids = np.asarray([caps["sample_id"][i] for i in rows], np.int64)
        good = np.nonzero(ok)[0]  # caption rows (sorted by sample id) with tokens
        img_ids, first, count = np.unique(sids[good], return_index=True, return_counts=True)
        self.img_ids, self.cap_first, self.cap_count, self.cap_rows = img_ids, first, count, good
        self.stats["train_images_without_captions"] = len(train_sids) - len(img_ids)
        self.img_rows = self.groups.rows(img_ids) if len(img_ids) else np.zeros(0, np.int64)
        n = len(img_ids)
        if cfg.control == "shuffled":  # the training-time control: groups of another image, fixed before training
            perm = np.random.default_rng([cfg.seed, 1887]).permutation(n)
            self.img_rows = self.img_rows[perm]
            self.stats["control_shuffled_pairs_kept"] = int((perm == np.arange(n)).sum())
        if cfg.batch_size:  # train.job.Job.fit_batch: the short-split rule, one process or N workers
            self.batch_size = self.fit_batch(n, "training images")
        else:
            bs = 4096 if device.type == "cuda" else 64
            self.batch_size = max(2, min(bs, n)) if n >= 2 else bs
        self.stats["train_images"] = n
        self.stats["train_captions"] = int(len(good))
        _log(", ".join(f"{k} {v}" for k, v in self.stats.items()) + f"; batch {self.batch_size}")
        self._vanilla = False  # not loaded yet

    # --- model ------------------------------------------------------------------------------
    def _new_model(self, variant: str | None = None):
        c = self.cfg
        variant = variant or c.variant
        if variant == "vanilla":
            m = VanillaText(d=c.width, heads=c.heads, layers=c.vanilla_layers, max_len=c.max_len, d_img=self.d_img,
                            d_proj=c.d_proj)
        else:
            m = TextGroupTransformer(d=c.width, heads=c.heads, n_groups=c.n_groups, layers_pre=c.layers_pre,
                                     layers_post=c.layers_post, max_len=c.max_len, d_img=self.d_img, d_proj=c.d_proj,
                                     decoder=variant != "no-reconstruction", gumbel=c.gumbel, gumbel_tau=c.gumbel_tau,
                                     assign_eps=c.assign_eps, pre_assign=c.pre_assign_attn,
                                     hard=c.hard_assignment, isolate_groups=c.isolate_groups,
                                     group_init_std=c.group_init_std, pos_init_std=c.pos_init_std)
        rec = torch.tensor(list(json.dumps(self.tok_record, sort_keys=True).encode()), dtype=torch.uint8)
        m.register_buffer("tokenizer_record", rec)  # the tokenizer travels with every checkpoint
        if self.cfg.recon_vocab == "corpus" and m.decoder is not None:
            m.set_output_vocab(np.unique(self.tokens.flat))
        return m

    def build_model(self):
        return self._new_model()

    def untrained_model(self):
        """The model as initialised by the loop (same seed), without touching the global RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            return self._new_model().to(self.device).eval()

    # --- data -------------------------------------------------------------------------------
    def batches_per_epoch(self) -> int:
        return self.steps_per_epoch(len(self.img_ids) // self.batch_size)

    def _batch(self, img_idx: np.ndarray, cap_rows: np.ndarray) -> dict:
        ids, mask = self.tokens.batch(cap_rows, pad_to=self.cfg.max_len if self.cfg.full_logits else None)
        groups = self.groups.gather(None, rows=self.img_rows[img_idx])
        return {"sample_id": torch.from_numpy(self.img_ids[img_idx]), "image_groups": torch.from_numpy(groups),
                "ids": ids, "mask": mask}

    def batches(self, epoch: int, start: int):
        """Pure function of (seed, epoch): a permutation of the training images, one random caption each."""
        B = self.batch_size
        perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.img_ids))
        for b in self.rank_batches(len(self.img_ids) // B, start):
            idx = perm[b * B:(b + 1) * B]
            u = np.random.default_rng([self.cfg.seed, epoch, b + 1]).random(len(idx))
            pick = self.cap_first[idx] + np.minimum((u * self.cap_count[idx]).astype(np.int64), self.cap_count[idx] - 1)
            yield {k: v.to(self.device) for k, v in self._batch(idx, self.cap_rows[pick]).items()}

    # --- loss -------------------------------------------------------------------------------
    def loss(self, model, batch):
        c = self.cfg
        out = model.encode(batch["ids"], batch["mask"])
        total = torch.zeros((), device=batch["ids"].device)
        extras: dict[str, float] = {}
        if c.variant != "no-contrastive":
            t = model.text_embed(out["groups"])
            i = model.image_embed(batch["image_groups"])
            lc, logits = info_nce(t, i, c.tau)
            total = total + lc
            target = torch.arange(len(t), device=t.device)
            extras["loss_contrastive"] = float(lc.detach())
            extras["acc_i2t"] = 100.0 * float((logits.argmax(1) == target).float().mean())
        if c.variant != "no-reconstruction":
            logits, targets, tm = model.reconstruction_logits(batch["ids"], batch["mask"], out["groups"], full=c.full_logits)
            lr = reconstruction(logits, targets, tm, c.reconstruction_reduction)
            total = total + c.lambda_rec * lr
            extras["loss_reconstruction"] = float(lr.detach())
        if "assign" in out:
            hard = out["assign"].detach()
            used = (hard > 0).any(-1).sum(-1).float().mean()
            extras["groups_used"] = float(used)
            # fraction of real tokens whose training assignment (argmax with Gumbel noise) is the
            # noiseless argmax that evaluation and phrase discovery use: 1/K = the assignment logits are
            # lost in the noise (the grouping has not been learnt), 1 = deterministic assignment
            m = batch["mask"]
            same = (hard.argmax(1) == out["soft"].detach().argmax(1))[m]
            extras["assign_stable"] = float(same.float().mean())
        return total, extras

    # --- scoring interface ------------------------------------------------------------------
    def scorable_sample_ids(self):
        return self.groups.sample_ids

    @torch.no_grad()
    def _text_embed(self, model, texts: list[str]) -> tuple[torch.Tensor, np.ndarray]:
        enc = encode(self.tok, list(texts), self.cfg.max_len)
        ok = enc.lengths > 0
        out = torch.zeros(len(texts), self.cfg.d_proj)
        rows = np.nonzero(ok)[0]
        for s in range(0, len(rows), self.cfg.eval_chunk):
            r = rows[s:s + self.cfg.eval_chunk]
            L = int(enc.lengths[r].max())
            ids = torch.from_numpy(enc.ids[r, :L]).to(self.device)
            mask = torch.from_numpy(np.arange(L)[None] < enc.lengths[r][:, None]).to(self.device)
            out[torch.from_numpy(r)] = model.text_embed(model.encode(ids, mask)["groups"]).float().cpu()
        return out, ok

    @torch.no_grad()
    def score_pairs(self, model, sample_ids, texts, boxes=None):
        """Cosine of the mean-pooled projected text groups and image groups (Sec. 4.2); NaN for a
        text with no token after tokenisation (the harness counts those)."""
        sids = np.asarray(sample_ids, np.int64)
        te, ok = self._text_embed(model, list(texts))
        uniq, inv = np.unique(sids, return_inverse=True)
        ie = torch.zeros(len(uniq), self.cfg.d_proj)
        for s in range(0, len(uniq), self.cfg.eval_chunk):
            g = torch.from_numpy(self.groups.gather(uniq[s:s + self.cfg.eval_chunk])).to(self.device)
            ie[s:s + len(g)] = model.image_embed(g).float().cpu()
        score = (te * ie[torch.from_numpy(inv)]).sum(-1).double().numpy()
        score[~ok] = np.nan
        return score

    text_only_note = ("text-only bar: the job's text embedding against one constant image, the mean image "
                      "embedding of the held-out images")

    @torch.no_grad()
    def score_pairs_text_only(self, model, sample_ids, texts, boxes=None):
        """The text-only bar (train/eval/interface.py): :meth:`score_pairs` with every image replaced by the
        mean of the model's image embeddings of the held-out images (up to 1000)."""
        te, ok = self._text_embed(model, list(texts))
        score = (te @ self._constant_image(model)).double().numpy()
        score[~ok] = np.nan
        return score

    def _constant_image(self, model) -> torch.Tensor:
        key = (id(model), tuple(p._version for p in model.parameters()))
        if getattr(self, "_const", (None,))[0] != key:
            sids = self.held_out_ids() or sorted(int(s) for s in self.groups.sample_ids[:1000])
            g = torch.from_numpy(self.groups.gather(sids)).to(self.device)
            self._const = (key, model.image_embed(g).float().cpu().mean(0))
        return self._const[1]

    def held_out_ids(self) -> list[int]:
        """Up to 1000 images of the splits not trained on that have image groups (held-out retrieval's images)."""
        return [s for s, sp in sorted(self.split_of.items()) if sp not in set(self.cfg.train_splits) and s in self.groups][:1000]

    # --- phrase discovery -------------------------------------------------------------------
    def _sources(self) -> list[tuple[str, Artifact, bool]]:
        out = [("samples", self.samples, False)]
        for p in self.cfg.discovery_artifacts:
            path = resolve_artifact(self.manifest, p)
            named = Path(str(path).rstrip("/"))  # a URL too: only its last two names are used
            out.append((named.parent.name + "/" + named.name if named.name == "samples" else named.name, Artifact(path), True))
        return out

    def _gold(self, art: Artifact) -> D.GoldCaptions:
        split = art.read("samples", ["sample_id", "split"]).to_pydict()
        want = {s for s, sp in zip(split["sample_id"], split["split"]) if sp in set(self.cfg.discovery_splits)}
        caps = art.read("captions", ["caption_id", "sample_id", "text"]).to_pydict()
        captions = sorted((c, t or "") for c, s, t in zip(caps["caption_id"], caps["sample_id"], caps["text"]) if s in want)
        ph = art.read("phrases", ["caption_id", "start", "end"]).to_pydict()
        spans: dict[int, list[tuple[int, int]]] = {}
        for c, s, e in zip(ph["caption_id"], ph["start"], ph["end"]):
            spans.setdefault(int(c), []).append((int(s), int(e)))
        gold = D.gold_captions(self.tok, captions, spans, self.cfg.max_len, self.cfg.discovery_max_captions,
                               image_of=dict(zip(caps["caption_id"], caps["sample_id"])))
        gold.skipped = {k: v for k, v in gold.skipped.items() if v}
        return gold

    @torch.no_grad()
    def _encode_texts(self, model, texts: list[str]) -> list[dict]:
        """Per text: word-token group labels (argmax over groups of the grouping attention) and
        word-token features (the last layer's), SOT/EOT excluded."""
        enc = encode(self.tok, texts, self.cfg.max_len)
        res = []
        for s in range(0, len(texts), self.cfg.eval_chunk):
            r = np.arange(s, min(len(texts), s + self.cfg.eval_chunk))
            L = int(enc.lengths[r].max())
            ids = torch.from_numpy(enc.ids[r, :L]).to(self.device)
            mask = torch.from_numpy(np.arange(L)[None] < enc.lengths[r][:, None]).to(self.device)
            out = model.encode(ids, mask)
            lab = out["soft"].argmax(1).cpu().numpy() if "soft" in out else None
            feats = out["tokens"].float().cpu().numpy()
            for j, i in enumerate(r):
                n = int(enc.lengths[i])
                res.append({"labels": None if lab is None else lab[j, 1:n - 1], "feats": feats[j, 1:n - 1],
                            "soft": None if lab is None else out["soft"][j, :, 1:n - 1].float().cpu().numpy()})
        return res

    def _vanilla_model(self, model):
        if self.cfg.variant == "vanilla":
            return model, "this run"
        if self._vanilla is False:
            self._vanilla = None
            run = self.vanilla_dir()
            if run is not None:
                ck = run / "checkpoints" / "final.pt"
                if ck.is_file():
                    st = load_checkpoint(ck)
                    conf = st.get("config") or {}
                    if conf.get("variant") == "vanilla":
                        c = self.cfg
                        m = VanillaText(d=conf.get("width", c.width), heads=conf.get("heads", c.heads),
                                        layers=conf.get("vanilla_layers", c.vanilla_layers),
                                        max_len=conf.get("max_len", c.max_len), d_img=self.d_img,
                                        d_proj=conf.get("d_proj", c.d_proj))
                        m.register_buffer("tokenizer_record", torch.zeros(0, dtype=torch.uint8))
                        sd = st["model"]
                        m.tokenizer_record = sd["tokenizer_record"].clone()
                        if "out_vocab" in sd:
                            m.set_output_vocab(sd["out_vocab"])
                        m.load_state_dict(sd)
                        self._vanilla = (m.to(self.device).eval(), str(ck))
        if self._vanilla:
            return self._vanilla
        run = self.vanilla_dir()
        if run is None:
            return None, "vanilla_run is null"
        return None, (f"no trained vanilla run in {run} (`train run text-groups --set train.text_groups.variant=vanilla` "
                      "with the same manifest and options trains it)")

    def vanilla_dir(self) -> Path | None:
        """The vanilla run the clustering baselines read (``vanilla_run``): ``auto``, the folder
        ``train run text-groups`` writes with this run's options and ``variant=vanilla``; a folder
        (relative to ``output``); None when ``vanilla_run`` is null."""
        v = self.cfg.vanilla_run
        if not v:
            return None
        if v == "auto":
            from train.cli import run_folder

            vanilla = type(self.cfg).model_validate({**self.cfg.model_dump(), "variant": "vanilla", "run_dir": None})
            return Path(run_folder("text-groups", self.manifest, vanilla))
        from pipeline.io.storage import local_path

        return Path(local_path(resolve_artifact(self.manifest, v)))  # training runs are local

    def discovery(self, model, out_dir: Path | None = None) -> list[Row]:
        rows: list[Row] = []
        K = self.cfg.n_groups
        for name, art, explicit in self._sources():
            if "phrases" not in art.tables():
                if explicit:
                    raise ValueError(f"discovery artifact {art.dir} has no phrases table")
                _log(f"phrase discovery: {art.dir} has no phrases table; skipped")
                continue
            gold = self._gold(art)
            if not gold.caption_ids:
                raise ValueError(f"phrase discovery on {art.dir}: 0 scorable captions in splits "
                                 f"{self.cfg.discovery_splits} (skipped: {gold.skipped or 'none'})")
            methods: dict[str, list[np.ndarray]] = {}
            notes: dict[str, str] = {}
            van, van_note = self._vanilla_model(model)
            if self.cfg.variant != "vanilla":
                enc = self._encode_texts(model, gold.texts)
                methods["model"] = [e["labels"] for e in enc]
            if self.cfg.baselines:
                if self.cfg.variant != "vanilla":
                    methods["untrained"] = [e["labels"] for e in self._encode_texts(self.untrained_model(), gold.texts)]
                rng = np.random.default_rng([self.cfg.seed, 7])
                for b in SIMPLE_BASELINES:
                    methods[b] = [D.baseline_labels(b, n, K, rng) for n in gold.n_tokens]
                if van is not None:
                    feats = [e["feats"] for e in self._encode_texts(van, gold.texts)]
                    for b in CLUSTERINGS:
                        methods[b] = [D.baseline_labels(b, len(f), 4, rng, f) for f in feats]
                        notes[b] = f"4 clusters over the vanilla model's token features ({van_note})"
                else:
                    _log(f"clustering baselines skipped: {van_note}")
            scores = {m: D.score_labels(lab, gold) for m, lab in methods.items()}
            skipped = int(sum(gold.skipped.values()))
            reasons = dict(gold.skipped)
            base_note = (f"{gold.truncated} captions truncated at {self.cfg.max_len} tokens; "
                         f"{gold.phrases_dropped} phrases outside the tokens dropped; K={K}")
            for subset in ("all", "ge2_phrases"):
                chance = scores.get("random", {}).get(subset, {})
                for m, sc in scores.items():
                    s = sc[subset]
                    if not s.get("n"):
                        continue
                    for metric in D.METRICS:
                        label = metric if m == "model" else f"{metric}[{m}]"
                        note = "chance = random assignment of tokens to K groups; " + base_note
                        if m in notes:
                            note += "; " + notes[m]
                        rows.append(Row(benchmark=f"phrase-discovery/{name}", subset=subset, metric=label,
                                        value=s[metric], n=s["n"], chance=chance.get(metric), skipped=skipped,
                                        skip_reasons=reasons, unit="fraction" if metric == "tIoU" else "%", note=note,
                                        # the no-learning baselines (not the clusterings of a trained model's features)
                                        baseline_for=f"{subset}/{metric}" if m in NO_LEARNING else "",
                                        est=s[f"{metric}_est"]).with_ci(s[f"{metric}_ci"]))
            if out_dir is not None and self.cfg.figures and self.cfg.variant != "vanilla":
                self._figure(model, gold, Path(out_dir) / f"assignments_{name.replace('/', '_')}.png")
        return rows

    def _figure(self, model, gold: D.GoldCaptions, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        pick = [i for i, p in enumerate(gold.phrases) if len(p) >= 2][: self.cfg.figures]
        pick = pick or list(range(min(self.cfg.figures, len(gold.texts))))
        enc = self._encode_texts(model, [gold.texts[i] for i in pick])
        toks = encode(self.tok, [gold.texts[i] for i in pick], self.cfg.max_len)
        cmap = plt.get_cmap("tab10" if self.cfg.n_groups <= 10 else "tab20")
        fig, axes = plt.subplots(len(pick), 1, figsize=(12, 1.0 * len(pick) + 0.6), squeeze=False)
        for ax, i, e, ids, n in zip(axes[:, 0], pick, enc, toks.ids, toks.lengths):
            words = [w.replace("</w>", "") for w in self.tok.convert_ids_to_tokens(ids[1:n - 1].tolist())]
            x = 0.0
            gold_tok = set()
            for a, b in gold.phrases[i]:
                gold_tok.update(range(a, b))
            for j, (w, g) in enumerate(zip(words, e["labels"])):
                wdt = 0.012 * (len(w) + 2)
                ax.text(x, 0.5, w, fontsize=9, va="center", bbox=dict(facecolor=cmap(int(g) % cmap.N), alpha=0.6, pad=2))
                if j in gold_tok:
                    ax.plot([x, x + wdt * 0.8], [0.12, 0.12], color="black", lw=1.5)
                x += wdt
            ax.set_xlim(0, max(1.0, x))
            ax.set_ylim(0, 1)
            ax.axis("off")
        fig.suptitle("token -> group (colour = argmax group; underlined = inside a gold phrase)", fontsize=9)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=90, bbox_inches="tight")
        plt.close(fig)

    def _discovery_cached(self, model, out_dir):
        """evaluate() and the harness's job_metrics() run back to back on the final model: score once."""
        key = (id(model), sum(p._version for p in model.parameters()), tuple(p.data_ptr() for p in model.parameters())[:4])
        hit = getattr(self, "_disc_cache", None)
        if hit is not None and hit[0] == key:
            return hit[1]
        rows = self.discovery(model, out_dir)
        self._disc_cache = (key, rows)
        return rows

    def job_metrics(self, model, out_dir):
        rows = list(self._discovery_cached(model, out_dir))
        r = self._val_retrieval(model, hits=True)
        if r:
            from train.eval.intervals import interval, proportion

            est = proportion(r["hits"], r["sids"])  # one query per image
            row = Row(benchmark="retrieval/held-out", subset="i2t", metric="R@1", value=r["val_r1_i2t"],
                      n=int(r["val_images"]), chance=r["val_r1_chance"], unit="%",
                      note="image -> text among the held-out images (first caption each); chance 100/N",
                      est=est).with_ci(interval(est, 100.0))
            rows.append(row)
            hit0, why = self._frozen_retrieval(r["sids"], r["texts"])
            if hit0 is None:
                row.note += f"; no frozen GroupViT baseline: {why}"
            else:
                e0 = proportion(hit0, r["sids"])
                rows.append(Row(benchmark="retrieval/held-out", subset="i2t", metric="R@1[frozen]",
                                value=100.0 * float(hit0.mean()), n=len(hit0), chance=r["val_r1_chance"], unit="%",
                                note="the frozen GroupViT's own retrieval on the same images and captions: "
                                     "cos(image_groups image_embed, GroupViT text embedding)",
                                baseline_for="i2t/R@1", est=e0).with_ci(interval(e0, 100.0)))
        return rows

    def _frozen_retrieval(self, sids: list[int], texts: list[str]) -> tuple[np.ndarray | None, str]:
        """Image -> text R@1 hits of the frozen GroupViT the image groups come from (its own image
        embedding against its own text tower's), on these images and their captions; (None, why) where
        the GroupViT the image_groups artifact records has no text tower (the scene-oracle instrument),
        cannot be loaded, or is not the one whose weights made the artifact."""
        from pipeline.loaders.image_groups import ImageGroups
        from pipeline.models import groupvit as gv

        rec = (self.groups.art.manifest.get("models") or {}).get("groupvit") or {}
        spec = rec.get("spec")
        if not gv.has_text_tower(spec):
            return None, f"the image groups were made by {spec!r}, which has no text tower"
        if getattr(self, "_gv_text", None) is None:
            try:
                m, _, got = gv.load_groupvit(str(spec), "cpu")
                tok = gv.text_tokenizer(str(spec))
            except (OSError, ValueError) as e:
                return None, f"the image groups' GroupViT {spec!r} could not be loaded ({str(e).splitlines()[0][:120]})"
            if rec.get("weights_sha256") and got.get("weights_sha256") != rec["weights_sha256"]:
                return None, f"{spec!r} now holds other weights than those that made the image groups"
            self._gv_text = (m, tok)
        if getattr(self, "_gv_images", None) is None:
            self._gv_images = ImageGroups(self.groups.art, fields=("image_embed",))
        img = torch.nn.functional.normalize(torch.from_numpy(self._gv_images.gather(sids, "image_embed")), dim=-1)
        txt = torch.nn.functional.normalize(gv.encode_texts(*self._gv_text, texts), dim=-1)
        return ((img @ txt.t()).argmax(1) == torch.arange(len(sids))).numpy(), ""

    def evaluate(self, model, out_dir: Path) -> dict[str, float]:
        out_dir = Path(out_dir)
        rows = self._discovery_cached(model, out_dir)
        res: dict[str, float] = {}
        for r in rows:
            if r.benchmark != "phrase-discovery/samples" or not r.metric.startswith("tIoU"):
                continue
            key = "pd_" + ("ge2" if r.subset == "ge2_phrases" else "all") + "_" + r.metric.replace("[", "_").replace("]", "")
            res[key] = r.value
        if rows:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "phrase_discovery.json").write_text(json.dumps([r.as_dict() for r in rows], indent=1))
        res.update(self._val_retrieval(model))
        return res

    @torch.no_grad()
    def _val_retrieval(self, model, hits: bool = False) -> dict:
        """Image->text R@1 (%) among up to 1000 eval-split images, first caption each (chance 100/N)."""
        if self.cfg.variant == "no-contrastive":
            return {}
        sids = self.held_out_ids()
        if len(sids) < 2:
            return {}
        caps = self.samples.read("captions", ["caption_id", "sample_id", "text"]).to_pydict()
        first: dict[int, tuple[int, str]] = {}
        for c, s, t in zip(caps["caption_id"], caps["sample_id"], caps["text"]):
            if s in set(sids) and t and t.strip() and (s not in first or c < first[s][0]):
                first[s] = (c, t)
        sids = [s for s in sids if s in first]
        if len(sids) < 2:
            return {}
        te, ok = self._text_embed(model, [first[s][1] for s in sids])
        g = torch.from_numpy(self.groups.gather(sids)).to(self.device)
        ie = model.image_embed(g).float().cpu()
        sim = ie @ te.t()
        hit = (sim.argmax(1) == torch.arange(len(sids))).numpy()
        out = {"val_r1_i2t": float(hit.mean()) * 100, "val_r1_chance": 100.0 / len(sids), "val_images": float(len(sids))}
        return dict(out, hits=hit, sids=sids, texts=[first[s][1] for s in sids]) if hits else out
