"""The published configurations the adapters claim, built with random weights from their configs (no
download) and run through the adapter their stage calls, on 2 images / captions:

    .venv/bin/python benchmarks/compat_matrix.py                  # full sizes; prints the table
    .venv/bin/python benchmarks/compat_matrix.py --write          # ... and writes docs/compatibility.md
    .venv/bin/python benchmarks/compat_matrix.py --reduced        # published widths, 1-2 blocks (seconds)

Each row: the stage and adapter call, the output shapes (the papers' / model cards' dims), dtype,
seconds per image (a warm forward of the batch / images, CPU; SAM: the first) and peak memory per
image (resident-set growth during the first forward / images; the weights are loaded before). ``pipeline
plan``'s dims for the same spec (pipeline/sizing/shapes.py, no local folder) are shown beside them.
tests/test_compat_matrix.py runs the reduced rows (fast) and the full ones (slow) and checks the
table's dims.
"""
from __future__ import annotations

import argparse
import gc
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "compatibility.md"
N_IMAGES = 2
TEXTS = ["A man riding a wave on top of a surfboard.", "Two dogs play with a red frisbee in the park."]


@dataclass
class Row:
    name: str  # the published configuration
    spec: str  # the models.<slot> spec whose published dims these are (pipeline plan sizes it)
    stage: str
    call: str
    expect: dict  # output name -> shape after the batch dim (the published dims)
    build: object = field(repr=False, default=None)  # reduced: bool -> (run: () -> {name: tensor})
    slow: bool = False
    warmup: bool = True  # time a second forward (SAM: the first, one forward of 1024 px images is long)


def _seeded(fn):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return fn()


def _images(size=(320, 240)):
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(N_IMAGES)]


# ------------------------------------------------------------------ CLIP (extract-clip-tokens)
def _hf_clip(published: str):
    def build(reduced: bool):
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

        from pipeline.models import clip as A
        from pipeline.models.clip_bpe import fast_clip_tokenizer
        from pipeline.sizing.shapes import PUBLISHED

        p = PUBLISHED[published]
        vision, text = dict(p["vision"]), dict(p["text"])
        if reduced:
            vision["num_hidden_layers"] = text["num_hidden_layers"] = 1
        cfg = CLIPConfig(vision_config=vision, text_config=text, projection_dim=p["projection_dim"])
        model = _seeded(lambda: CLIPModel(cfg)).eval()
        size = vision["image_size"]
        proc = CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                                  image_mean=A.OPENAI_MEAN, image_std=A.OPENAI_STD)
        return _clip_run(model, proc, fast_clip_tokenizer("ViT-B-16"))
    return build


def _open_clip(arch: str):
    def build(reduced: bool):
        from pipeline.models import clip as A

        if reduced:
            import open_clip
            from open_clip.factory import get_model_config

            from pipeline.models.open_clip_adapter import OpenClip, OpenClipProcessor, OpenClipTokenizer

            cfg = get_model_config(arch)
            cfg["vision_cfg"] = dict(cfg["vision_cfg"], layers=1)
            cfg["text_cfg"] = dict(cfg["text_cfg"], layers=1)
            model = OpenClip(_seeded(lambda: open_clip.CLIP(**cfg)).eval(), arch)
            proc = OpenClipProcessor(open_clip.image_transform(224, is_train=False), 224)
            return _clip_run(model, proc, OpenClipTokenizer(arch))
        model, proc, tok, rec = A.load_clip(f"open_clip:{arch}")  # open_clip.create_model_and_transforms
        return _clip_run(model, proc, tok)
    return build


def _clip_run(model, proc, tok):
    from pipeline.models import clip as A

    pv = A.preprocess_images(proc, _images())

    def run():
        img = A.encode_images(model, pv)
        txt = A.encode_texts(model, tok, TEXTS, max_tokens=A.TEXT_MAX_TOKENS)
        return {"patch_tokens": img["patch_tokens"], "image_embed": img["image_embed"],
                "text_tokens": txt["text_tokens"][:, :1], "text_embed": txt["text_embed"]}
    return run


# ------------------------------------------------------------------ GroupViT (extract-image-groups)
def _groupvit(reduced: bool):
    from transformers import CLIPImageProcessor, GroupViTConfig, GroupViTModel

    from pipeline.models import groupvit as G
    from pipeline.models.clip import OPENAI_MEAN, OPENAI_STD

    # GroupViTConfig's defaults are nvidia/groupvit-gcc-yfcc's config.json (pipeline/sizing/shapes.py)
    vision = dict(depths=[1, 1, 1], num_hidden_layers=3) if reduced else {}
    text = dict(num_hidden_layers=1) if reduced else {}
    cfg = GroupViTConfig(vision_config=vision, text_config=text, projection_dim=256, projection_intermediate_dim=4096)
    model = _seeded(lambda: GroupViTModel(cfg)).eval()
    proc = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                              image_mean=OPENAI_MEAN, image_std=OPENAI_STD)
    pv = proc(images=_images(), return_tensors="pt")["pixel_values"]
    return lambda: G.encode_groups(model, pv)


# ------------------------------------------------------------------ SAM (extract-visual-tokens)
def _sam(kind: str):
    def build(reduced: bool):
        from pipeline.models.sam import SamModel

        if reduced:
            import importlib

            B = importlib.import_module("segment_anything.build_sam")  # the module (the package exports a function of that name)

            # published width, 4 windowed blocks (no global attention) whose outputs are pooled as the
            # released model's 4 global-attention blocks are: the published feature dim at a fraction of the cost
            width, heads = {"vit_b": (768, 12), "vit_h": (1280, 16)}[kind]
            orig = B.sam_model_registry[kind]
            B.sam_model_registry[kind] = lambda checkpoint=None: B._build_sam(width, 4, heads, [], checkpoint)
            try:
                m = SamModel(f"{kind}:random", feature_layers=[0, 1, 2, 3])
            finally:
                B.sam_model_registry[kind] = orig
        else:
            m = SamModel(f"{kind}:random")
        ims = [np.asarray(im) for im in _images()]

        def run():
            e = m.encode(ims)
            return {"embeddings": e.embeddings, "image_features": torch.as_tensor(e.image_features)}
        return run
    return build


# ------------------------------------------------------------------ BERT (negative-captions MLM, word features)
def _bert(reduced: bool):
    from transformers import BertConfig, BertForMaskedLM

    from pipeline.models import mlm as M
    from pipeline.sizing.shapes import PUBLISHED

    p = {k: v for k, v in PUBLISHED["bert-base-uncased"].items() if k != "kind"}
    if reduced:
        p["num_hidden_layers"] = 1
    model = _seeded(lambda: BertForMaskedLM(BertConfig(**p))).eval()
    tok = M.offline_tokenizer()  # bert-base-uncased's WordPiece vocabulary (30,522), shipped offline
    lm = M.MaskedLM(model, tok, model.base_model, M.mlm_head(model), {})
    enc = tok(TEXTS, return_tensors="pt", padding=True)

    @torch.no_grad()
    def run():
        h = lm.encoder(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
        return {"hidden": h[:, :1], "mlm_logits": lm.head(h[:, 0])}
    return run


ROWS = [
    Row("openai CLIP ViT-B/16", "openai/clip-vit-base-patch16", "extract-clip-tokens", "clip.encode_images / encode_texts",
        {"patch_tokens": (196, 768), "image_embed": (512,), "text_tokens": (1, 512), "text_embed": (512,)},
        _hf_clip("openai/clip-vit-base-patch16")),
    Row("openai CLIP ViT-L/14", "openai/clip-vit-large-patch14", "extract-clip-tokens", "clip.encode_images / encode_texts",
        {"patch_tokens": (256, 1024), "image_embed": (768,), "text_tokens": (1, 768), "text_embed": (768,)},
        _hf_clip("openai/clip-vit-large-patch14"), slow=True),
    Row("open_clip ViT-B-16", "open_clip:ViT-B-16", "extract-clip-tokens", "clip.encode_images / encode_texts (open_clip:)",
        {"patch_tokens": (196, 768), "image_embed": (512,), "text_tokens": (1, 512), "text_embed": (512,)},
        _open_clip("ViT-B-16")),
    Row("GroupViT gcc-yfcc", "nvidia/groupvit-gcc-yfcc", "extract-image-groups", "groupvit.encode_groups",
        {"groups": (8, 384), "groups_projected": (8, 256), "image_embed": (256,), "assign": (8, 196)}, _groupvit),
    Row("SAM ViT-B", "vit_b:random", "extract-visual-tokens", "sam.SamModel.encode",
        {"embeddings": (256, 64, 64), "image_features": (4 * 768 + 256,)}, _sam("vit_b"), warmup=False),
    Row("SAM ViT-H", "vit_h:random", "extract-visual-tokens", "sam.SamModel.encode",
        {"embeddings": (256, 64, 64), "image_features": (4 * 1280 + 256,)}, _sam("vit_h"), slow=True, warmup=False),
    Row("bert-base-uncased", "bert-base-uncased", "negative-captions", "mlm.MaskedLM encoder + head",
        {"hidden": (1, 768), "mlm_logits": (30522,)}, _bert),
]
# Which rows the fast test runs at reduced depth (one per family: published widths, 1-2 blocks).
REDUCED = ["openai CLIP ViT-B/16", "open_clip ViT-B-16", "GroupViT gcc-yfcc", "SAM ViT-B", "bert-base-uncased"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:  # Linux: resident pages
        return int(f.read().split()[1]) * resource.getpagesize()


class PeakRss:
    """The highest resident set size seen while the block runs (sampled every 2 ms in a thread)."""

    def __enter__(self):
        self.peak, self._stop = _rss_bytes(), threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_bytes())


def measure(row: Row, reduced: bool = False) -> dict:
    """Build the row's model (random weights), run its adapter once to warm up, then once timed."""
    run = row.build(reduced)
    gc.collect()
    before = _rss_bytes()
    t0 = time.perf_counter()
    with PeakRss() as rss:  # the first forward: what it allocates beyond the loaded weights
        out = run()
    seconds = time.perf_counter() - t0
    peak = rss.peak - before
    if row.warmup:  # the seconds of a second, warm forward
        t0 = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - t0
    shapes = {k: tuple(v.shape[1:]) for k, v in out.items()}
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in out.values()})
    return {"name": row.name, "spec": row.spec, "stage": row.stage, "call": row.call, "shapes": shapes,
            "dtype": ",".join(dtypes), "s_per_image": seconds / N_IMAGES, "peak_mb_per_image": peak / N_IMAGES / 1e6,
            "reduced": reduced}


def plan_dims(row: Row) -> str:
    """What ``pipeline plan`` sizes for the spec without a local folder (pipeline/sizing/shapes.py)."""
    from pipeline.sizing import shapes as S

    if row.stage == "extract-clip-tokens":
        c = S.clip(row.spec)
        return f"{c['n_patches']}x{c['vision_dim']}, text {c['text_dim']}, joint {c['projection_dim']}"
    if row.stage == "extract-image-groups":
        g = S.groupvit(row.spec)
        return f"{g['n_groups']}x{g['group_dim']}, joint {g['projection_dim']}"
    if row.stage == "extract-visual-tokens":
        return f"features {S.sam(row.spec)['image_feature_dim']}"
    return f"hidden {S.text_model(row.spec)['hidden']}"


NOT_RUN = "not run here"


def not_run(text: str) -> dict[str, str]:
    """configuration -> the reason the doc gives for not running it."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[3].startswith(NOT_RUN):
            out[cells[0]] = cells[3]
    return out


def _fmt_shape(s) -> str:
    return "x".join(str(d) for d in s)


def table(results: list[dict]) -> str:
    lines = ["| configuration | spec | stage (adapter) | outputs per item | dtype | s / image | peak MB / image | plan's dims |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | `{r['spec']}` | {r['stage']} (`{r['call']}`) | {NOT_RUN}: {r['skipped']} | - | - | - | "
                         f"{r['plan']} |")
            continue
        outs = ", ".join(f"{k} {_fmt_shape(v)}" for k, v in r["shapes"].items())
        lines.append(f"| {r['name']} | `{r['spec']}` | {r['stage']} (`{r['call']}`) | {outs} | {r['dtype']} | "
                     f"{r['s_per_image']:.2f} | {r['peak_mb_per_image']:.0f} | {r['plan']} |")
    return "\n".join(lines)


def parse_table(text: str) -> dict[str, dict[str, tuple]]:
    """configuration -> {output: shape} from the doc's table (what the test checks)."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] not in ("configuration", "---") and not cells[3].startswith(NOT_RUN):
            shapes = {}
            for item in cells[3].split(", "):
                k, _, dims = item.partition(" ")
                shapes[k] = tuple(int(d) for d in dims.split("x"))
            out[cells[0]] = shapes
    return out


HEADER = """# Compatibility matrix: the published configurations through their stages

Each configuration the adapters claim, built from its published config **with random weights**
(nothing downloaded) and run through the adapter its stage calls on {n} images / captions, on this
machine's CPU: the output dims are the papers' and model cards' (ViT-B/16: 196 patches x 768, joint
512; ViT-L/14: 256 x 1024, joint 768; GroupViT: 8 groups x 384, joint 256; SAM: 64 x 64 x 256
embeddings, pooled features of the 4 global-attention blocks + neck; BERT-base: 768, 30,522-way MLM).
`text_tokens` and `hidden` show one token. Seconds and peak memory are per image of a batch of {n}:
seconds of a second (warm) forward (SAM: of the first), peak memory the resident-set growth during
the first forward beyond the loaded weights. "plan's dims": what `pipeline plan` sizes for the
spec without any local folder (pipeline/sizing/shapes.py). Written by
`.venv/bin/python benchmarks/compat_matrix.py --write` (torch threads: {threads}); the dims are
checked by tests/test_compat_matrix.py.

"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(REPO)}")
    ap.add_argument("--reduced", action="store_true", help="published widths at 1-2 blocks (the fast test's rows)")
    ap.add_argument("--only", nargs="*", help="configuration names")
    ap.add_argument("--skip", nargs=2, action="append", default=[], metavar=("NAME", "REASON"),
                    help="a slow configuration not run here, with the reason written in its row")
    a = ap.parse_args(argv)
    skip = dict(a.skip)
    results = []
    for row in ROWS:
        if a.only and row.name not in a.only or a.reduced and row.name not in REDUCED:
            continue
        if row.name in skip:
            if not row.slow:
                ap.error(f"--skip {row.name!r}: only the slow configurations may be skipped")
            results.append({"name": row.name, "spec": row.spec, "stage": row.stage, "call": row.call,
                            "skipped": skip[row.name], "plan": plan_dims(row)})
            continue
        r = measure(row, a.reduced)
        r["plan"] = plan_dims(row)
        results.append(r)
        print(f"{row.name}: {r['s_per_image']:.2f} s/image", file=sys.stderr)
        gc.collect()
    text = HEADER.format(n=N_IMAGES, threads=torch.get_num_threads()) + table(results) + "\n"
    print(table(results))
    if a.write:
        DOC.write_text(text)


if __name__ == "__main__":
    main()
