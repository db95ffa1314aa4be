"""Tangible/intangible visual tokens, triplets, 4-NN and attention ranks (Kalibhat et al. Sec. 4.1-4.2).

Per image (see ``pipeline/visual_tokens/graph.py`` for the exact graph rules):

1. a segmenter (``segmenter``: ``sam`` automatic masks, or ``annotations`` = ground-truth masks)
   gives instances V with masks, boxes, scores and embeddings (``embedding``: SAM decoder token,
   SAM's encoder feature pooled under the mask, or ``clip_pool``: the CLIP's (``models.clip``)
   projected patch grid pooled under the mask), projected to ``width``, and the image feature I
   (SAM's pooled encoder layers; with ``clip_pool`` the CLIP's image embedding);
   With ``models.sam: scene-oracle`` (the testbed instrument, generated dataset and
   ``segmenter: annotations`` only) no SAM runs: a tangible token is the oracle's object vector of
   its ground-truth instance and I the oracle's pooled scene embedding (``pipeline/models/segmenter.py``);
2. a relation predictor (``relations``: ``learned`` RAM-style head = the paper's RAM,
   ``geometric``, ``annotations``) scores every ordered pair over the predicate vocabulary
   (default the 56 PSG predicates); scores over ``relation_threshold`` become triplets, each
   distinct predicate an intangible token embedded by the text encoder ``models.predicate_encoder``
   (``scene-oracle``: a fixed vector per predicate name);
3. truncation to ``context_length`` (highest-scoring instances kept), 4-NN by box centres and the
   rank matrix over T = (I, V, U).

Output ``visual_tokens`` (WebDataset, one shard per unit of ``shard_size`` samples), per sample
key ``sample_key(sample_id)``:

    tangible.npy      float16 [V, width]      tangible tokens (instance embeddings)
    intangible.npy    float16 [U, width]      intangible tokens (predicate text embeddings)
    image_feature.npy float16 [D_I]           pooled multi-layer encoder feature
    boxes.npy         float32 [V, 4]          x0, y0, x1, y1 in pixels of the original image
    masks.json        [V] COCO RLE dicts (compressed counts, pycocotools-compatible)
    triplets.npy      int32   [E, 3]          (subject in V, object in V, predicate in U)
    triplet_scores.npy float32 [E]            predictor score of each triplet
    knn.npy           int32   [V, 4]          nearest other instances, nearest first, -1 padded
    ranks.npy         uint8   [T, T]          T = 1 + V + U, token order (I, V..., U...)
    meta.json         sample_id, source_id, width, height, instance_ids, instance_scores,
                      categories, predicates (names of U), predicate_ids (vocabulary indices),
                      n_candidates (instances before truncation)

Rejected images (undecodable, smaller than ``min_side``, larger than ``max_pixels``, annotation
masks of the wrong size) are listed in ``errors.parquet``; greyscale, palette and RGBA images are
converted to RGB by the reader (alpha dropped). Read shards with
:mod:`pipeline.loaders.visual_tokens`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.io.wds import ShardWriter, sample_key
from pipeline.models.device import device_field, resolve_device
from pipeline.stage import RunContext, StageConfig, StageError, describe_exception, isolate_failures, unit_writer
from pipeline.stages._image_actor import run_image_stage
from pipeline.stages._image_units import plan_image_units, prefetched_batches, unit_records
from pipeline.visual_tokens.predicates import DEFAULT_PREDICATE_MAP

NAME = "extract-visual-tokens"
READS = ["samples"]
WRITES = ["visual_tokens"]


class Config(StageConfig):
    shard_size: int = Field(256, ge=1, description="samples per output shard (unit of resume)")
    segmenter: Literal["sam", "annotations"] = Field("sam", description="sam: automatic masks; annotations: ground-truth instances")
    relations: Literal["learned", "geometric", "annotations"] = Field(
        "learned", description="learned: RAM-style head (models.relation_head checkpoint), the paper's RAM; geometric; annotations"
    )
    embedding: Literal["decoder_token", "mask_pool", "clip_pool"] = Field(
        "decoder_token", description="tangible embedding: SAM mask-decoder token; mask_pool: SAM's encoder features pooled "
        "under the mask; clip_pool: models.clip's projected patch grid pooled under the mask, I its image embedding "
        "(the segmenter's masks, the CLIP's features)"
    )
    width: int = Field(512, ge=1, description="token width (paper: 512)")
    context_length: int = Field(77, ge=1, description="max |T| = 1 + |V| + |U| (paper: 77)")
    relation_threshold: float = Field(0.05, ge=0, le=1, description="triplet score threshold (paper/RAM: 0.05)")
    max_predicates_per_pair: int | None = Field(None, ge=1, description="keep at most this many predicates per pair (None: all over threshold)")
    predicates: str | list[str] = Field(
        "auto", description="predicate vocabulary: auto (psg56+left for the generated dataset, so every generated "
        "relation is directed in the rank matrix; psg56 for real data), psg56, psg56+left, synthetic, or a list")
    predicate_map: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_PREDICATE_MAP), description="dataset predicate -> vocabulary ('~p': swap subject/object)")
    # SAM automatic mask generator (SamAutomaticMaskGenerator defaults) + Relate-Anything dedup + paper score threshold
    points_per_side: int = Field(32, ge=1)
    points_per_batch: int = Field(64, ge=1)
    pred_iou_thresh: float = 0.88
    stability_score_thresh: float = 0.95
    stability_score_offset: float = 1.0
    box_nms_thresh: float = 0.7
    dedup_iou: float = Field(0.8, description="Relate-Anything: drop a mask with IoU > this with a larger kept one")
    score_threshold: float = Field(0.9, description="instance score threshold (paper: 0.9 on the segmenter's score)")
    min_mask_area: int = Field(1, ge=1)
    min_mask_region_area: int = Field(0, ge=0, description="SamAutomaticMaskGenerator's option: fill holes and drop "
                                      "islands under this many pixels in each mask, then box NMS again (0: off, SAM's default)")
    feature_layers: list[int] | None = Field(None, description="encoder blocks pooled into the image feature (default: global-attention blocks)")
    batch_size: int = Field(4, ge=1, description="images per image-encoder call")
    min_side: int = Field(8, ge=1, description="reject images with a side shorter than this (pixels)")
    max_pixels: int = Field(100_000_000, ge=1, description="reject images with more pixels than this")
    seed: int = Field(0, description="seed of the fixed width projections")
    num_cpus: float = Field(1.0, gt=0)
    device: str = device_field()


AMG_KEYS = ("points_per_side", "points_per_batch", "pred_iou_thresh", "stability_score_thresh", "stability_score_offset",
            "box_nms_thresh", "dedup_iou", "score_threshold", "min_mask_area", "min_mask_region_area")


def amg_options(c: Config) -> dict:
    """The automatic mask generator's options (:meth:`pipeline.models.sam.SamModel.generate`) of a stage config:
    what ``segmenter: sam`` runs (also what train/jobs/sam_segmenter measures, so its numbers are this path's)."""
    return {k: getattr(c, k) for k in AMG_KEYS}


def _pred_vocab(cfg: Config) -> list[str]:
    from pipeline.visual_tokens.predicates import resolve_vocabulary

    try:
        return resolve_vocabulary(cfg.predicates)
    except ValueError as e:
        raise StageError(f"stages.extract_visual_tokens.predicates: {e}") from None


class VisualTokenWorker:
    """Ray actor: loads SAM, the relation predictor and the predicate embeddings once."""

    def __init__(self, cfg: dict, models: dict, threads: int):
        import torch

        from pipeline.models.relations import PredicateEncoder, make_relation_predictor
        from pipeline.models.scene_oracle import is_oracle
        from pipeline.visual_tokens.predicates import PredicateMapper, resolve_vocabulary

        torch.set_num_threads(max(1, threads))
        self.cfg = Config.model_validate(cfg)
        c = self.cfg
        self.oracle = is_oracle(models["sam"])
        if self.oracle:  # the testbed instrument: ground-truth instances, no SAM (pipeline/models/segmenter.py)
            from pipeline.models.segmenter import OracleSegmenter

            self.segmenter = OracleSegmenter(width=c.width, seed=c.seed)
        else:
            self._load_sam(c, models)
        self.vocab = resolve_vocabulary(c.predicates)
        self.mapper = PredicateMapper(self.vocab, c.predicate_map)
        self.predictor = make_relation_predictor(
            c.relations, self.vocab, self.mapper, checkpoint=models.get("relation_head"), embedding_info=embedding_info(c, models)
        ) if c.relations == "learned" else make_relation_predictor(c.relations, self.vocab, self.mapper)  # fmt: skip
        self.pred_emb = PredicateEncoder(models["predicate_encoder"], c.width, c.seed).encode(self.vocab).astype(np.float16)

    def _load_sam(self, c: Config, models: dict) -> None:
        from pipeline.models.clip_grid import ClipMaskEncoder, is_clip_pool
        from pipeline.models.sam import SamModel
        from pipeline.models.segmenter import make_segmenter

        spec, device = models["sam"], resolve_device(c.device)
        features = ClipMaskEncoder(features_spec(models), device=device, role="features") if c.embedding == "clip_pool" else None
        if is_clip_pool(spec):  # a CLIP's patch grid pooled under the ground-truth masks (pipeline/models/clip_grid.py)
            self.sam = ClipMaskEncoder(spec, device=device)
        elif features is not None and c.segmenter == "annotations":  # the masks are given: no SAM to run
            self.sam = features
        else:
            self.sam = SamModel(spec, device=device, feature_layers=c.feature_layers)
        self.segmenter = make_segmenter(c.segmenter, self.sam, embedding=c.embedding, width=c.width, seed=c.seed,
                                        features=features, **(amg_options(c) if c.segmenter == "sam" else {}))

    def _decode(self, records):
        from pipeline.readers.images import open_image

        c = self.cfg
        kept, images, failed = [], [], []
        for r in records:
            w, h = r.get("width"), r.get("height")
            if w and h and w * h > c.max_pixels:  # known from ingest: do not even decode
                failed.append((r, "image_too_large", f"{w}x{h} > max_pixels {c.max_pixels}"))
                continue
            try:
                im = open_image(r.get("image_path") or r["image"])
            except Exception as e:
                failed.append((r, "unreadable_image", describe_exception(e)))
                continue
            W, H = im.size
            if min(W, H) < c.min_side:
                failed.append((r, "image_too_small", f"{W}x{H}: a side is under min_side {c.min_side}"))
            elif W * H > c.max_pixels:
                failed.append((r, "image_too_large", f"{W}x{H} > max_pixels {c.max_pixels}"))
            else:
                kept.append(r)
                images.append(np.asarray(im, dtype=np.uint8))
        return kept, images, failed

    def _segment(self, w, kept, images):
        """Segment a batch; a sample the segmenter fails on is rejected alone (shared policy:
        :func:`pipeline.stage.isolate_failures` retries the batch without it)."""
        ann = self.cfg.segmenter == "annotations"

        def run(recs, ims):
            inst = [r.get("instances", []) for r in recs] if ann else None
            if self.oracle:
                return list(zip(recs, ims, self.segmenter.segment(ims, inst, scenes=[r.get("scene", []) for r in recs],
                                                                  sample_ids=[r["sample_id"] for r in recs])))
            return list(zip(recs, ims, self.segmenter.segment(ims, inst)))

        _, out = isolate_failures(w, kept, images, run, reason="segmentation_failed")
        return out or []

    def __call__(self, payload: dict) -> dict:
        from pipeline.visual_tokens.graph import build_graph

        c = self.cfg
        w = unit_writer(payload)
        t_dec = t_model = t_post = 0.0
        stats = {"instances": 0, "triplets": 0, "intangible": 0, "truncated_instances": 0, "unmapped_predicates": 0}
        rows = 0
        path = w.shard_path()
        with ShardWriter(path) as sw:
            for kept, images, failed, dt in prefetched_batches(
                unit_records(payload), c.batch_size, self._decode, failure=lambda r, e: (r, "unreadable_image", describe_exception(e))
            ):
                t_dec += dt
                for r, reason, detail in failed:
                    w.error(reason, detail, sample_id=r["sample_id"], source_id=r["source_id"])
                if not kept:
                    continue
                t0 = time.perf_counter()
                segs = self._segment(w, kept, images)
                preds, ok_segs = [], []
                for r, im, seg in segs:
                    try:
                        scores, st = self.predictor.predict(seg, image_size=im.shape[:2], relations=r.get("relations"))
                    except Exception as e:
                        w.error("relations_failed", describe_exception(e), sample_id=r["sample_id"], source_id=r["source_id"])
                        continue
                    stats["unmapped_predicates"] += st.get("unmapped_predicates", 0)
                    preds.append(scores)
                    ok_segs.append((r, im, seg))
                segs = ok_segs
                t1 = time.perf_counter()
                t_model += t1 - t0
                for (r, im, seg), scores in zip(segs, preds):
                    g = build_graph(seg.scores, scores, seg.boxes, threshold=c.relation_threshold, context=c.context_length, max_per_pair=c.max_predicates_per_pair)
                    k = g.keep
                    fields = sample_fields(r, im.shape[:2], seg, g, self.vocab, self.pred_emb)
                    sw.write(sample_key(r["sample_id"]), fields)
                    rows += 1
                    stats["instances"] += len(k)
                    stats["triplets"] += len(g.triplets)
                    stats["intangible"] += len(g.predicates)
                    stats["truncated_instances"] += len(seg.scores) - len(k)
                t_post += time.perf_counter() - t1
        w.record_shard(path, rows)
        stats.update(rows=rows, rejected=len(w.errors), decode_s=round(t_dec, 4), model_s=round(t_model, 4), post_s=round(t_post, 4))
        res = w.commit(stats)
        return {"unit": res.unit, "stats": res.stats}


def sample_fields(record: dict, image_hw: tuple[int, int], seg, g, vocab: list[str], pred_emb: np.ndarray) -> dict:
    """The WebDataset fields of one sample (see the module docstring) from its segmentation and graph."""
    from pipeline.masks import rle_encode_many

    k = g.keep
    return {
        "tangible.npy": seg.embeddings[k].astype(np.float16),
        "intangible.npy": pred_emb[g.predicates],
        "image_feature.npy": seg.image_feature.astype(np.float16),
        "boxes.npy": seg.boxes[k].astype(np.float32),
        "masks.json": rle_encode_many(seg.masks[k]),
        "triplets.npy": g.triplets.astype(np.int32),
        "triplet_scores.npy": g.triplet_scores.astype(np.float32),
        "knn.npy": g.knn.astype(np.int32),
        "ranks.npy": g.ranks,
        "meta.json": {
            "sample_id": int(record["sample_id"]),
            "source_id": record.get("source_id"),
            "height": int(image_hw[0]),
            "width": int(image_hw[1]),
            "instance_ids": [int(x) for x in seg.instance_ids[k]],
            "instance_scores": [round(float(x), 6) for x in seg.scores[k]],
            "categories": [seg.categories[i] for i in k] if seg.categories else [],
            "predicates": [vocab[p] for p in g.predicates],
            "predicate_ids": [int(p) for p in g.predicates],
            "n_candidates": int(len(seg.scores)),
        },
    }


def embedding_info(cfg: Config, models: dict) -> dict:
    """What the tangible tokens depend on; stored in / checked against relation-head checkpoints."""
    from pipeline.models.scene_oracle import is_oracle

    if is_oracle(models["sam"]):  # the embedding option does not apply: the oracle's object vectors
        return {"sam": models["sam"], "embedding": "object_vector", "width": cfg.width, "seed": cfg.seed,
                "segmenter_feature": "scene-oracle"}
    from pipeline.models.clip_grid import is_clip_pool

    feature = "clip-pool" if is_clip_pool(models["sam"]) or cfg.embedding == "clip_pool" else "sam"
    info = {"sam": models["sam"], "embedding": cfg.embedding, "width": cfg.width, "seed": cfg.seed, "segmenter_feature": feature}
    if cfg.embedding == "clip_pool":  # only then: checkpoints trained on SAM's own features keep matching
        info["features"] = features_spec(models)
    from pipeline.models.provenance import spec_weights_sha256

    for key in ("sam", "features"):  # the weights by content: a moved or linked output folder still matches
        digest = spec_weights_sha256(info.get(key))
        if digest:
            info[f"{key}_sha256"] = digest
    return info


def features_spec(models: dict) -> str:
    """``embedding: clip_pool``'s feature model: the manifest's CLIP as a :mod:`pipeline.models.clip_grid` spec."""
    if not models.get("clip"):
        raise StageError("stages.extract_visual_tokens.embedding: clip_pool pools models.clip's patch grid: set models.clip")
    return f"clip-pool:{models['clip']}"


def model_records(cfg: Config, models: dict) -> dict:
    """Provenance of every model used, computed without loading large checkpoints."""
    from pipeline.models.provenance import is_tiny_random, model_record, weights_hash

    from pipeline.models.scene_oracle import SceneOracle, is_oracle
    from pipeline.models.scene_oracle import record as oracle_record

    from pipeline.models.clip_grid import ClipMaskEncoder, is_clip_pool
    from pipeline.models.sam_checkpoint import is_sam_folder

    recs = {}
    if is_oracle(models["sam"]):
        o = SceneOracle()
        recs["sam"] = oracle_record("sam", oracle=o.params(), image_feature_dim=o.proj, token_dim=o.d_v,
                                    tangible="object vector (colour + shape) + noise, projected to width",
                                    image_feature="pooled scene embedding (bag of colours and shapes) + noise")
    elif is_clip_pool(models["sam"]):
        recs["sam"] = ClipMaskEncoder(models["sam"]).record
    elif cfg.embedding == "clip_pool" and cfg.segmenter == "annotations":  # the masks are given: no SAM is loaded
        pass
    elif is_tiny_random(models["sam"]) or is_sam_folder(models["sam"]):  # small: built (tiny) or loaded (a folder)
        from pipeline.models.sam import SamModel

        recs["sam"] = SamModel(models["sam"], feature_layers=cfg.feature_layers).record
    else:
        from pipeline.models.sam import parse_spec

        _, path = parse_spec(models["sam"])
        if not Path(path).is_file():
            raise StageError(f"models.sam: checkpoint {path} not found")
        recs["sam"] = model_record("sam", models["sam"], random_weights=False, weights_sha256=weights_hash([path]))
    if cfg.embedding == "clip_pool":
        recs["features"] = ClipMaskEncoder(features_spec(models), role="features").record
    spec = models["predicate_encoder"]
    from pipeline.models.clip import is_random_spec

    if is_oracle(spec):
        from pipeline.models.relations import ORACLE_PREDICATES

        recs["predicate_encoder"] = oracle_record("predicate_encoder", predicate_vectors=ORACLE_PREDICATES)
    elif is_random_spec(spec):
        from pipeline.models.relations import PredicateEncoder

        enc = PredicateEncoder(spec, cfg.width, cfg.seed)
        enc._load()
        recs["predicate_encoder"] = enc.record
    else:
        if not Path(spec).is_dir():  # a hub id must be in the local cache (offline): fail here, naming the key
            try:
                from huggingface_hub import snapshot_download

                snapshot_download(spec, local_files_only=True)
            except Exception:
                raise StageError(f"models.predicate_encoder: {spec!r} not found or not loadable (no local folder or "
                                 "cached Hugging Face snapshot)") from None
        files = [p for p in Path(spec).glob("*") if p.suffix in (".safetensors", ".bin")] if Path(spec).is_dir() else []
        recs["predicate_encoder"] = model_record("predicate_encoder", spec, random_weights=False, weights_sha256=weights_hash(files) if files else None)
    if cfg.relations == "learned":
        ck = models.get("relation_head")
        if not ck:
            raise StageError("relations: learned needs models.relation_head (a `train run relation-head` checkpoint); or set stages.extract_visual_tokens.relations to geometric/annotations")
        from pipeline.models.relations import relation_checkpoint_file

        ck = relation_checkpoint_file(ck)  # a file, or an export folder's relation_head.pt
        if not ck.is_file():
            raise StageError(f"models.relation_head: checkpoint {ck} not found")
        from pipeline.io.checkpoint import CheckpointError, load_checkpoint

        try:
            meta = load_checkpoint(ck).get("provenance", {})
        except CheckpointError as e:
            raise StageError(f"models.relation_head: {e}") from None
        recs["relation_head"] = model_record(
            "relation_head", str(ck), random_weights=False, weights_sha256=weights_hash([ck]), trained_on=meta
        )
    return recs


def run(ctx: RunContext, cfg: Config) -> dict:
    m = ctx.manifest.models
    if cfg.predicates == "auto":  # resolved once here: the workers, params and manifest see the real name
        from pipeline.visual_tokens.predicates import default_vocabulary

        cfg = cfg.model_copy(update={"predicates": default_vocabulary(ctx.manifest.dataset.kind)})
    models = {"sam": m.sam, "predicate_encoder": m.predicate_encoder, "relation_head": m.relation_head}
    if cfg.embedding == "clip_pool":
        models["clip"] = m.clip
    vocab = _pred_vocab(cfg)
    from pipeline.models.clip_grid import is_clip_pool
    from pipeline.models.scene_oracle import is_oracle, require_generated

    oracle = is_oracle(m.sam)
    for role in ("sam", "predicate_encoder"):
        if is_oracle(getattr(m, role)):
            require_generated(ctx.manifest, role)
    if is_clip_pool(m.sam) and (cfg.segmenter != "annotations" or cfg.embedding != "mask_pool"):
        raise StageError(f"models.sam: {m.sam} pools ground-truth masks only: set stages.extract_visual_tokens.segmenter: "
                         "annotations and embedding: mask_pool")
    if cfg.embedding == "clip_pool" and (oracle or is_clip_pool(m.sam)):
        raise StageError(f"stages.extract_visual_tokens.embedding: clip_pool pools models.clip under the segmenter's masks; "
                         f"models.sam: {m.sam} does not segment: set models.sam to a SAM checkpoint")
    if oracle and cfg.segmenter != "annotations":
        raise StageError("models.sam: scene-oracle embeds ground-truth instances: set stages.extract_visual_tokens.segmenter: annotations")
    attach = (("instances",) if cfg.segmenter == "annotations" else ()) + (("relations",) if cfg.relations == "annotations" else ()) \
        + (("scene",) if oracle else ())
    plan = plan_image_units(ctx, cfg.shard_size, attach, missing_hint="use segmenter: sam / relations: learned|geometric")
    from pipeline.models.provenance import cached_info

    # cached: a rerun with nothing to do builds no model (relation_head is keyed by its file's stat)
    recs = cached_info(ctx.output, "visual_tokens", models, lambda: model_records(cfg, models),
                       feature_layers=cfg.feature_layers, width=cfg.width, seed=cfg.seed, relations=cfg.relations)
    sam_rec = recs.get("features") or recs["sam"]  # what the image feature I comes from
    extra = {
        "dims": {"width": cfg.width, "image_feature": sam_rec.get("image_feature_dim"), "context_length": cfg.context_length},
        "predicates": vocab,
        "embedding": embedding_info(cfg, models),
        "token_order": "image_feature, tangible V, intangible U",
    }
    schema = {
        "tangible.npy": f"float16 [V, {cfg.width}]",
        "intangible.npy": f"float16 [U, {cfg.width}]",
        "image_feature.npy": f"float16 [{sam_rec.get('image_feature_dim')}]",
        "boxes.npy": "float32 [V, 4] xyxy pixels",
        "masks.json": "[V] COCO RLE",
        "triplets.npy": "int32 [E, 3] (subject in V, object in V, predicate in U)",
        "triplet_scores.npy": "float32 [E]",
        "knn.npy": "int32 [V, 4] nearest first, -1 padded",
        "ranks.npy": "uint8 [T, T], T = 1 + V + U",
        "meta.json": "sample_id, source_id, width, height, instance_ids, instance_scores, categories, predicates, predicate_ids, n_candidates",
    }
    man, summary = run_image_stage(
        ctx, cfg, artifact="visual_tokens", stage=NAME, plan=plan, actor=VisualTokenWorker, models=recs,
        constructor_kwargs=dict(cfg=cfg.model_dump(mode="json"), models=models), extra=extra, schema=schema,
    )
    st = man["stats"]
    model_s, post_s = st.get("model_s", 0.0), st.get("post_s", 0.0)
    return {
        **summary,
        "instances": st.get("instances", 0),
        "triplets": st.get("triplets", 0),
        "post_over_model": round(post_s / model_s, 4) if model_s else None,
    }


def inspect_view(artifact, n: int) -> str:

    lines = []
    for f in artifact.files("shards"):
        from pipeline.loaders.visual_tokens import iter_samples

        for s in iter_samples(f):
            meta = s["meta.json"]
            names = meta["predicates"]
            trip = [f"{a}-{names[c]}->{b}" for a, b, c in s["triplets.npy"][:6].tolist()]
            lines.append(
                f"sample {meta['sample_id']}: V={len(s['tangible.npy'])} U={len(names)} E={len(s['triplets.npy'])} "
                f"T={s['ranks.npy'].shape[0]} triplets {trip}{' ...' if len(s['triplets.npy']) > 6 else ''}"
            )
            if len(lines) >= n:
                return "\n".join(lines)
    return "\n".join(lines)
