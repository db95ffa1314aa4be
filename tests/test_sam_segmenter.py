"""sam-segmenter's pieces against independent references: SAM's focal and dice losses (a per-pixel brute force
and torchvision's sigmoid_focal_loss), the prompt simulation (points inside their masks, the box noise's size
and cap, error-region points labelled by the region they fall in, uniformly), the SAM-folder round trip through
pipeline.models.sam.load_sam (every tensor equal, the record trained not random, a mismatched config refused in
one line), and the connected-components baseline and recall metrics on planted scenes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pipeline.models.sam_checkpoint import CONFIG, WEIGHTS, build_sam, write_sam_folder
from train.jobs.sam_segmenter import Config
from train.jobs.sam_segmenter.losses import dice, focal, iou_loss, mask_iou, mask_loss
from train.jobs.sam_segmenter.masks_eval import best_iou, box_ious, components, mask_ious, masks_to_boxes, summarize
from train.jobs.sam_segmenter.prompts import error_points, first_prompts, mask_boxes, noisy_boxes

SMALL = dict(img_size=32, patch_size=8, encoder_width=16, encoder_depth=2, encoder_heads=2, global_attn=[1], window_size=2,
             prompt_dim=16, decoder_mlp_dim=32, decoder_heads=2, mask_in_chans=4, iou_head_hidden_dim=16)


def _brute_focal(logit: float, t: int, alpha=0.25, gamma=2.0) -> float:
    p = 1 / (1 + math.exp(-logit))
    ce = -math.log(p) if t else -math.log(1 - p)
    p_t = p if t else 1 - p
    return (alpha if t else 1 - alpha) * (1 - p_t) ** gamma * ce


def test_focal_and_dice_match_a_per_pixel_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 5, 4, generator=g, dtype=torch.float64) * 3
    target = torch.rand(3, 1, 5, 4, generator=g) > 0.6
    f, d = focal(logits, target), dice(logits, target)
    assert f.shape == d.shape == (3, 2)
    for i in range(3):
        for k in range(2):
            px = [(float(logits[i, k, y, x]), int(target[i, 0, y, x])) for y in range(5) for x in range(4)]
            assert f[i, k].item() == pytest.approx(sum(_brute_focal(l, t) for l, t in px) / 20, rel=1e-9)
            p = [1 / (1 + math.exp(-l)) for l, _ in px]
            inter = sum(pi * t for pi, (_, t) in zip(p, px))
            ref = 1 - (2 * inter + 1) / (sum(p) + sum(t for _, t in px) + 1)
            assert d[i, k].item() == pytest.approx(ref, rel=1e-9)
    assert torch.allclose(mask_loss(logits, target, 20.0, 1.0), 20 * f + d)


def test_focal_equals_torchvision_sigmoid_focal_loss():
    from torchvision.ops import sigmoid_focal_loss

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 16, 16, generator=g)
    target = (torch.rand(4, 3, 16, 16, generator=g) > 0.5).float()
    ref = sigmoid_focal_loss(logits, target, alpha=0.25, gamma=2.0, reduction="none").flatten(2).mean(-1)
    assert torch.allclose(focal(logits, target), ref, atol=1e-6)


def test_iou_head_target_is_the_thresholded_masks_iou_and_not_differentiated():
    logits = torch.tensor([[[[1.0, 1.0], [-1.0, -1.0]]]], requires_grad=True)  # predicts the top row
    target = torch.tensor([[[[1, 0], [1, 0]]]], dtype=torch.bool)  # the left column: IoU 1/3
    assert mask_iou(logits, target).item() == pytest.approx(1 / 3)
    pred = torch.tensor([[0.5]], requires_grad=True)
    loss = iou_loss(pred, logits, target)
    assert loss.item() == pytest.approx((0.5 - 1 / 3) ** 2)
    loss.sum().backward()
    assert logits.grad is None and pred.grad.item() == pytest.approx(2 * (0.5 - 1 / 3))


def _two_squares(h=40, w=40):
    m = np.zeros((2, h, w), bool)
    m[0, 5:15, 5:20] = True
    m[1, 22:35, 25:38] = True
    return m


def test_first_prompts_points_lie_in_their_masks_and_boxes_are_noisy_within_the_cap():
    masks = _two_squares()
    rng = np.random.default_rng(0)
    for _ in range(50):
        fp = first_prompts(masks, rng, 0.5, 0.1, 2.5)
        for k in range(2):
            x, y = fp["points"][k, 0]
            assert masks[k, int(y), int(x)]
            assert np.abs(fp["boxes"][k] - mask_boxes(masks)[k]).max() <= 2.5 + 1e-6
    assert mask_boxes(masks).tolist() == [[5, 5, 20, 15], [25, 22, 38, 35]]
    # the noise: std 10% of the side when the cap is far (side 100 -> std 10), clipped at the cap
    b = np.tile(np.array([[100.0, 100.0, 200.0, 200.0]], np.float32), (20000, 1))
    d = noisy_boxes(b, np.random.default_rng(1), 0.1, 1e9, (1000, 1000)) - b
    assert np.std(d) == pytest.approx(10.0, rel=0.03)
    d = noisy_boxes(b, np.random.default_rng(1), 0.1, 5.0, (1000, 1000)) - b
    assert np.abs(d).max() == pytest.approx(5.0) and (np.abs(d) == 5.0).mean() == pytest.approx(2 * 0.3085, abs=0.02)
    assert set(np.random.default_rng(2).random(2000) < 0.5) == {True, False}
    assert first_prompts(masks, np.random.default_rng(3), 1.0, 0.1, 2.5)["is_box"].all()
    assert not first_prompts(masks, np.random.default_rng(3), 0.0, 0.1, 2.5)["is_box"].any()


def test_error_points_are_uniform_over_the_error_region_and_labelled_by_it():
    gt = np.zeros((1, 6, 6), bool)
    gt[0, 0:3, 0:3] = True
    pred = np.zeros((1, 6, 6), bool)
    pred[0, 0:3, 0:2] = True   # misses column 2 of the object: 3 false-negative pixels
    pred[0, 5, 5] = True       # one false positive
    rng = np.random.default_rng(0)
    counts: dict = {}
    for _ in range(4000):
        p, lab = error_points(pred, gt, rng)
        x, y = int(p[0, 0]), int(p[0, 1])
        assert lab[0] == (1 if gt[0, y, x] else 0) and gt[0, y, x] != pred[0, y, x]
        counts[(x, y)] = counts.get((x, y), 0) + 1
    assert sorted(counts) == [(2, 0), (2, 1), (2, 2), (5, 5)]
    from scipy.stats import chisquare

    assert chisquare(list(counts.values())).pvalue > 0.001
    p, lab = error_points(gt, gt, rng)  # no error: a padding point
    assert lab.tolist() == [-1]


def _small_arch():
    return Config(**SMALL).architecture()


def test_export_load_round_trip_keeps_every_tensor_and_says_trained(tmp_path):
    from pipeline.models.sam import SamModel, load_sam

    torch.manual_seed(0)
    sam = build_sam(_small_arch())
    (tmp_path / "sam").mkdir()
    write_sam_folder(tmp_path / "sam", sam, _small_arch(), {"job": "sam-segmenter", "trained_on": {"images": 3}})
    loaded, global_attn, rec = load_sam(str(tmp_path / "sam"))
    a, b = sam.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert global_attn == [1] and rec["random_weights"] is False and rec["trained_here"]["job"] == "sam-segmenter"
    m = SamModel(str(tmp_path / "sam"))
    assert m.img_size == 32 and m.patch == 8
    enc = m.encode([np.zeros((32, 32, 3), np.uint8)])
    g = m.generate(enc.embeddings[:1], enc.input_sizes[0], enc.original_sizes[0], points_per_side=4, pred_iou_thresh=0,
                   stability_score_thresh=0, score_threshold=-1e9)
    assert g["masks"].shape[1:] == (32, 32)


def test_a_config_that_does_not_match_the_weights_is_refused_in_one_line(tmp_path):
    from pipeline.models.sam import load_sam

    folder = tmp_path / "sam"
    folder.mkdir()
    write_sam_folder(folder, build_sam(_small_arch()), _small_arch())
    cfg = json.loads((folder / CONFIG).read_text())
    cfg["architecture"]["encoder_embed_dim"] = 24
    (folder / CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_sam(str(folder))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{folder}: {CONFIG} does not match {WEIGHTS}: image_encoder.pos_embed: weights [1, 4, 4, 16] "
                          "vs config [1, 4, 4, 24]; ")
    assert msg.endswith("more); export config and weights together (train run sam-segmenter)")
    cfg["architecture"]["encoder_embed_dim"] = 16
    cfg["architecture"]["extra"] = 1
    (folder / CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"architecture keys missing \[\], unknown \['extra'\]"):
        load_sam(str(folder))


def test_components_baseline_finds_planted_objects_on_a_patterned_background():
    img = np.zeros((40, 40, 3), np.uint8) + np.array([200, 200, 200], np.uint8)
    img[::2] -= 20  # a striped background: 20 from the border's median at most
    masks = _two_squares()
    img[masks[0]] = (255, 0, 0)
    img[masks[1]] = (0, 0, 255)
    cc = components(img, tau=40.0, min_area=16)
    assert len(cc) == 2
    iou = mask_ious(cc, masks)
    assert sorted(best_iou(iou).tolist()) == [1.0, 1.0]
    assert len(components(img, tau=10.0, min_area=16)) == 1  # below the stripes: the background is one component


def test_recall_metrics_against_hand_counts():
    gt = _two_squares()
    pred = gt[:1].copy()
    pred[0, 5:15, 5:15] = False  # 5 of its 15 columns left: IoU 1/3 with the first square
    iou = mask_ious(pred, gt)
    assert iou[0, 0] == pytest.approx(1 / 3) and iou[1, 0] == 0
    assert box_ious(masks_to_boxes(gt), masks_to_boxes(gt)).diagonal().tolist() == [1.0, 1.0]
    res = summarize([best_iou(iou), np.ones(3)], [0, 1], "mask", [np.zeros(2), np.ones(3)])
    assert res["mask_recall50"] == pytest.approx(60.0) and res["mask_mean_best_iou"] == pytest.approx(100 * (1 / 3 + 3) / 5)
    assert res["mask_recall50_minus_baseline"][0] == pytest.approx(0.0)
    lo, hi = res["mask_recall50_ci"]
    assert lo < 60 < hi


def test_generate_small_region_cleanup_leaves_no_small_island_and_tight_boxes(tmp_path):
    """generate(min_mask_region_area=A) (SAM's postprocess_small_regions): each returned mask has no hole or island
    under A pixels and its box is that cleaned mask's tight box; the plain AMG's masks (A=0) do have such islands."""
    from scipy import ndimage

    from pipeline.models.sam import SamModel

    torch.manual_seed(0)
    (tmp_path / "sam").mkdir()
    write_sam_folder(tmp_path / "sam", build_sam(_small_arch()), _small_arch(), {"job": "sam-segmenter"})
    m = SamModel(str(tmp_path / "sam"))
    rng = np.random.default_rng(0)
    enc = m.encode([rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)])
    kw = dict(points_per_side=6, pred_iou_thresh=0, stability_score_thresh=0, score_threshold=-1e9, dedup_iou=1.0,
              box_nms_thresh=1.0)
    plain = m.generate(enc.embeddings[:1], enc.input_sizes[0], enc.original_sizes[0], **kw)
    area = 6
    eight = np.ones((3, 3), bool)

    def smallest(x):
        lab, n = ndimage.label(x, structure=eight)
        return np.bincount(lab.ravel())[1:].min() if n else 10**9

    assert min(smallest(p) for p in plain["masks"].numpy()) < area  # random weights: ragged masks to clean
    clean = m.generate(enc.embeddings[:1], enc.input_sizes[0], enc.original_sizes[0], min_mask_region_area=area, **kw)
    assert 0 < len(clean["masks"]) <= len(plain["masks"])
    for mk, box in zip(clean["masks"].numpy(), clean["boxes"].numpy()):
        lab, n = ndimage.label(mk, structure=eight)
        sizes = np.bincount(lab.ravel())[1:]
        assert n == 1 or sizes.min() >= area
        ys, xs = np.nonzero(mk)
        assert box.tolist() == [xs.min(), ys.min(), xs.max(), ys.max()]
