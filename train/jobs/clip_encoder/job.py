"""The `clip-encoder` job's lifecycle (see train/jobs/clip_encoder/__init__.py): CLIP's contrastive loss on
the training split's pixels and captions, held-out retrieval and zero-shot probes, and the hub-layout export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from train.encoders import export_dir, export_folder, load_corpus, load_pixels
from train.job import Job
from train.jobs.clip_encoder.metrics import clip_rows, exactness, heldout_embeddings, summary
from train.jobs.text_groups.tokenizer import load_tokenizer

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]


def build_processor(image_size: int):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                              image_mean=OPENAI_MEAN, image_std=OPENAI_STD)


def clip_config(cfg, tok):
    from transformers import CLIPConfig

    text = dict(hidden_size=cfg.text_width, intermediate_size=cfg.mlp_ratio * cfg.text_width, num_hidden_layers=cfg.text_layers,
                num_attention_heads=cfg.heads, max_position_embeddings=77, vocab_size=len(tok),
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=cfg.vision_width, intermediate_size=cfg.mlp_ratio * cfg.vision_width,
                  num_hidden_layers=cfg.vision_layers, num_attention_heads=cfg.heads, image_size=cfg.image_size,
                  patch_size=cfg.patch_size)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=cfg.projection_dim)


def caption_pools(corpus, train_ids: np.ndarray, control: str, seed: int) -> list[np.ndarray]:
    """Per training image (in ``train_ids`` order), the indices (into the corpus's captions) it trains with:
    its own; the control: those of another training image (a fixed seeded permutation)."""
    by_sample: dict[int, list[int]] = {}
    for i, s in enumerate(corpus.caption_sample.tolist()):
        by_sample.setdefault(int(s), []).append(i)
    pools = [np.asarray([i for i in by_sample.get(int(s), []) if corpus.texts[i].strip()], np.int64) for s in train_ids]
    if control == "shuffled":
        perm = np.random.default_rng([int(seed), 3636]).permutation(len(pools))
        pools = [pools[j] for j in perm]
    return pools


def epoch_batches(keys: list[tuple], batch: int, hard_frac: float, rng: np.random.Generator,
                  order: str = "sorted") -> list[np.ndarray]:
    """An epoch's batches (indices into ``keys``, ``len(keys) // batch`` of them, no index twice): a
    ``hard_frac`` share of the images, drawn at random, is sorted by its key (ties in random order) and cut
    into consecutive batches, so those batches hold images whose keys agree or are neighbours in sort order
    (clip-encoder: the images' sorted colour sets, so that colour cannot tell them apart); ``order`` "grouped":
    the images of one key stay consecutive but the keys come in random order (twins beside each other, the
    batch otherwise random); the rest are cut from a random permutation; the batches are then shuffled.
    ``hard_frac`` 0: CLIP's random batches."""
    n, nb = len(keys), len(keys) // batch
    perm = rng.permutation(n)
    if not hard_frac:
        return [perm[i : i + batch] for i in range(0, nb * batch, batch)]
    n_hard = int(round(hard_frac * nb)) * batch
    hard, rand = perm[:n_hard], perm[n_hard:]
    if n_hard:
        uniq = sorted(set(keys))
        ranks = rng.permutation(len(uniq)) if order == "grouped" else range(len(uniq))
        rank = dict(zip(uniq, ranks))
        hard = hard[np.argsort(np.asarray([rank[keys[i]] for i in hard]), kind="stable")]
    out = [hard[i : i + batch] for i in range(0, n_hard, batch)] + [rand[i : i + batch] for i in range(0, nb * batch - n_hard, batch)]
    return [out[j] for j in rng.permutation(len(out))]


class ClipEncoderJob(Job):
    NAME = "clip-encoder"

    def __init__(self, cfg, manifest, run_dir, device):
        super().__init__(cfg, manifest, run_dir, device)
        self.corpus = load_corpus(manifest, cfg.samples_artifact, self.NAME)
        c = self.corpus
        self.tokenizer, self.tok_record = load_tokenizer(None)
        self.processor = build_processor(cfg.image_size)
        train_mask = np.isin(c.splits, cfg.train_splits)
        self.train_idx = np.nonzero(train_mask)[0]
        self.eval_idx = np.nonzero(np.isin(c.splits, cfg.eval_splits))[0]
        if len(self.train_idx) < cfg.batch_size:
            raise ValueError(f"{self.NAME}: {len(self.train_idx)} training images (splits {cfg.train_splits}) is fewer "
                             f"than one batch of {cfg.batch_size}")
        if not len(self.eval_idx):
            raise ValueError(f"{self.NAME}: no held-out images in splits {cfg.eval_splits}")
        self.pools = caption_pools(c, c.sample_ids[self.train_idx], cfg.control, cfg.seed)
        keep = np.asarray([len(p) > 0 for p in self.pools])
        self.train_idx, self.pools = self.train_idx[keep], [p for p, k in zip(self.pools, keep) if k]
        if cfg.hard_batches and not c.colors:
            raise ValueError(f"{self.NAME}: hard_batches ({cfg.hard_batches}) sorts images by their objects' colours, and "
                             f"{cfg.samples_artifact} has no instances table with colours")
        self.batch_keys = [tuple(sorted(c.colors.get(int(s), ()))) for s in c.sample_ids[self.train_idx]]
        self._pixels = None
        self._ids = None
        self.export_path = export_dir(manifest, "clip", cfg.control, cfg.export_dir)  # EXPORT of the package

    # --- data: every image decoded once (1400 images at 64 px: 69 MB), every caption tokenised once ---------
    @property
    def pixels(self) -> torch.Tensor:
        if self._pixels is None:
            idx = np.concatenate([self.train_idx, self.eval_idx])
            pv = load_pixels([self.corpus.images[i] for i in idx], self.processor)
            self._pixels = {int(i): k for k, i in enumerate(idx)}, pv
        return self._pixels

    def tokens(self, texts: list[str]) -> dict:
        from pipeline.models.clip import tokenize

        return tokenize(self.tokenizer, texts, self.cfg.max_text_tokens)

    def build_model(self):
        from transformers import CLIPModel

        torch.manual_seed(self.cfg.seed)
        return CLIPModel(clip_config(self.cfg, self.tokenizer))

    def batches_per_epoch(self):
        return self.steps_per_epoch(len(self.train_idx) // self.cfg.batch_size)

    def batches(self, epoch, start):
        cfg = self.cfg
        row, pv = self.pixels
        blocks = epoch_batches(self.batch_keys, cfg.batch_size, cfg.hard_batches, np.random.default_rng([cfg.seed, epoch]),
                               cfg.hard_order)
        for b in self.rank_batches(len(blocks), start):
            pick = blocks[b]
            rng = np.random.default_rng([cfg.seed, epoch, b])
            caps = [int(self.pools[i][rng.integers(len(self.pools[i]))]) for i in pick]
            enc = self.tokens([self.corpus.texts[j] for j in caps])
            pixels = pv[[row[int(self.train_idx[i])] for i in pick]]
            yield {"pixel_values": pixels.to(self.device), "input_ids": enc["input_ids"].to(self.device),
                   "attention_mask": enc["attention_mask"].to(self.device)}

    def loss(self, model, batch):
        out = model(**batch, return_loss=True)
        return out.loss, {"logit_scale": float(model.logit_scale.detach().exp())}

    # --- evaluation -------------------------------------------------------------------------------------
    def heldout(self, model) -> dict:
        row, pv = self.pixels
        sids = self.corpus.sample_ids[self.eval_idx]
        return heldout_embeddings(model, pv[[row[int(i)] for i in self.eval_idx]], sids, self.corpus, self.tokens)

    # --- the harness's scoring interface (train/eval/interface.py): the CLIP's own cosine ----------------
    crop_note = "whole image: clip-encoder scores the full image, not a box crop"

    def scorable_sample_ids(self):
        """The held-out images only: the training images are what the encoder was fitted on."""
        return set(self.corpus.sample_ids[self.eval_idx].tolist())

    def _image_embeds(self, model, sample_ids) -> np.ndarray:
        from train.jobs.clip_encoder.metrics import _norm, _pooled

        row, pv = self.pixels
        at = {int(s): i for s, i in zip(self.corpus.sample_ids.tolist(), range(len(self.corpus.sample_ids)))}
        uniq, inv = np.unique(np.asarray(sample_ids, np.int64), return_inverse=True)
        x = pv[[row[at[int(s)]] for s in uniq]].to(self.device)
        emb = torch.cat([_pooled(model.get_image_features(pixel_values=x[i : i + 256])).float().cpu() for i in range(0, len(x), 256)])
        return _norm(emb.numpy())[inv]

    def score_pairs(self, model, sample_ids, texts, boxes=None):
        from train.jobs.clip_encoder.metrics import _norm, encode_texts

        t = _norm(encode_texts(model, self.tokens, list(texts)))
        return (self._image_embeds(model, sample_ids) * t).sum(1).astype(np.float64)

    def retrieval_scores(self, model, sample_ids, caption_ids, texts) -> dict:
        from train.jobs.clip_encoder.metrics import _norm, encode_texts

        t = _norm(encode_texts(model, self.tokens, list(texts)))
        return {"global": (self._image_embeds(model, sample_ids) @ t.T).astype(np.float64)}

    def job_metrics(self, model, out_dir) -> list:
        return clip_rows(self.heldout(model), self.corpus, self.tokens, model)

    def evaluate(self, model, out_dir):
        out_dir = Path(out_dir)
        emb = self.heldout(model)
        res = summary(emb, self.corpus, self.tokens, model)
        if out_dir.name == "final":
            res.update(self.export(model, emb, res, out_dir))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "clip_encoder_metrics.json").write_text(json.dumps(res, indent=1))
        return res

    def export(self, model, emb: dict, res: dict, out_dir: Path) -> dict:
        """The hub-layout folder, then the exactness check through the pipeline's adapter on it."""
        c = self.corpus
        prov = {"job": self.NAME, "config": self.cfg.model_dump(mode="json"), "tokenizer": self.tok_record,
                "trained_on": {"samples_artifact": str(self.cfg.samples_artifact), "splits": list(self.cfg.train_splits),
                               "images": int(len(self.train_idx)), "captions": int(sum(len(p) for p in self.pools))},
                "run_dir": str(self.run_dir), "metrics": {k: v for k, v in res.items() if isinstance(v, (int, float))}}
        wrote = export_folder(self.export_path, model, self.processor, self.tokenizer, provenance=prov)
        np.savez(self.run_dir / "heldout_embeddings.npz", sample_ids=emb["sample_ids"], image_embed=emb["image_embed"],
                 caption_ids=emb["caption_ids"], text_embed=emb["text_embed"])
        first = emb["sample_ids"][:64]  # a slice of the held-out set, checked through the adapter
        cap_ids, _, texts = c.captions_of(first)
        ex = exactness(str(self.export_path), [c.images[i] for i in self.eval_idx[:64]], emb["image_embed"][:64],
                       texts, emb["text_embed"][np.isin(emb["caption_ids"], cap_ids)], self.cfg.max_text_tokens)
        print(f"{self.NAME}: {'exported' if wrote else 'unchanged (the same weights)'} {self.export_path} (adapter vs training-time embeddings: min cosine "
              f"images {ex['export_min_cos_image']:.6f}, texts {ex['export_min_cos_text']:.6f})")
        return ex
