"""``pipeline plan``: per enabled stage, rows, bytes on disk, forward cost and wall time, before a run.

Nothing here downloads weights or runs a stage. Rows come from the dataset counted by its reader
(:mod:`pipeline.sizing.dataset`), bytes from the artifacts' layouts at the models' shapes
(:mod:`pipeline.sizing.artifacts`, :mod:`pipeline.sizing.shapes`) and, for Parquet tables whose
content compresses, from the stages' own workers on the first records. Time:

* on CPU, for a stage whose models can be built here (the ``*-random`` presets, ``scene-oracle``,
  a local folder or packaged model; ingest and build-index need none): the stage's own worker timed
  on the dataset's first records, alone and with as many copies at once as the stage runs, plus
  the fixed costs of a run (process start, Ray, the pools, cold worker builds), all measured
  (:mod:`pipeline.sizing.calibrate`) and composed by :mod:`pipeline.sizing.walltime`;
* otherwise on CPU, forward FLOPs counted on the meta device over a calibration on this machine: a
  CLIP vision tower built from its config with random weights (the manifest's published CLIP when
  one forward is under :data:`CALIBRATE_MAX_FLOPS`, else ViT-B/16's shapes), one torch thread, the
  best of a few forwards; cached in ``<output>/_cache/plan/calibration.json``;
* on GPUs, one published anchor: SAM's ViT-H image encoder (5.96 TFLOP per image, counted here)
  takes ~0.15 s on an NVIDIA A100 (segment-anything.com, FAQ "How long does inference take?"),
  i.e. ~40 TFLOP/s effective; every model's FLOPs are divided by that rate (an assumption for the
  other architectures, stated in the output).

On the FLOP paths wall time = rows x seconds per image / the stage's parallel workers on the
manifest's cluster (Ray's CPUs and GPUs for ``ray.address``; this machine's for an embedded run;
``--cpus`` / ``--gpus`` state another node), without fixed costs. Each stage's ``time_basis`` says
which path and what it covers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

from pipeline.sizing import artifacts as A
from pipeline.sizing import shapes as S
from pipeline.sizing import walltime as W
from pipeline.sizing.dataset import DatasetSize, count_dataset

SCHEMA_VERSION = 1
MEASURE = True  # time each CPU stage's own worker (pipeline.sizing.calibrate); tests switch it off
CALIBRATE_MAX_FLOPS = 40e9  # time a model directly when one forward is under this (seconds on one core)
GPU_ANCHOR = {"node": "NVIDIA A100", "flops_per_s": 5.96e12 / 0.15,
              "source": "SAM ViT-H image encoder ~0.15 s/image on an A100 (segment-anything.com FAQ); 5.96 TFLOP/image counted here"}
CLUSTER_TIMEOUT_S = 60
SAM_DECODER_FLOPS_PER_POINT = 3.62e9  # vit_h mask decoder, 3 masks per point (BENCHMARKS.md, extract-visual-tokens)


# ------------------------------------------------------------------ calibration (seconds per FLOP here)
def _clip_forward(spec: str):
    """(forward, flops, what) of a CLIP vision tower with random weights: the manifest's own when it
    is a real architecture of at most CALIBRATE_MAX_FLOPS per image, else ViT-B/16's (a tiny model
    is bound by per-call overheads, not FLOPs, and says nothing of a real model's rate)."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from pipeline.models import clip as adapter

    vision = adapter.RANDOM_PRESETS["base-random"]["vision"]
    if spec in S.PUBLISHED and 0 < S.clip(spec)["flops_image"] <= CALIBRATE_MAX_FLOPS:
        vision = S.PUBLISHED[spec]["vision"]
    cfg = CLIPVisionConfig(**vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CLIPVisionModel(cfg).eval()
    x = torch.randn(1, 3, cfg.image_size, cfg.image_size)
    flops = S.count_flops(lambda: model(pixel_values=x))
    return (lambda: model(pixel_values=x)), flops, f"CLIP vision {cfg.hidden_size}x{cfg.num_hidden_layers} @ {cfg.image_size}px"


def calibrate(spec: str, cache: Path, repeats: int = 2) -> dict:
    """This machine's FLOP/s on one torch thread, timed on a real-shape transformer forward (cached)."""
    import torch

    key = {"clip": spec, "torch": torch.__version__, "cpu": os.cpu_count(), "v": 2}
    path = cache / "calibration.json"
    try:
        old = json.loads(path.read_text())
        if old.get("key") == key:
            return old
    except (OSError, ValueError):
        pass
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fwd, flops, what = _clip_forward(spec)
        with torch.no_grad():
            fwd()  # warm-up
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                fwd()
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    out = {"key": key, "model": what, "flops": flops, "seconds": best, "flops_per_s": flops / best,
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def _decode_seconds(manifest, output: Path, n: int = 8) -> float | None:
    """Seconds to open and fully decode one of the dataset's images (the first ``n`` records)."""
    from pipeline.readers import open_image, read_dataset
    from pipeline.sizing.dataset import plan_dataset

    t, k = 0.0, 0
    try:
        for rec in read_dataset(plan_dataset(manifest, output), output, defer_masks=True):
            if k >= n:
                break
            try:
                t0 = time.perf_counter()
                open_image(rec.image)
                t += time.perf_counter() - t0
                k += 1
            except Exception:
                continue
    except Exception:
        return None
    return t / k if k else None


# ------------------------------------------------------------------ the cluster
def cluster(manifest, cpus: int | None, gpus: int | None) -> dict:
    """The node (or cluster) a plan is for: ``--cpus`` / ``--gpus`` as given (the one not given: this
    machine's CPUs, no GPU), else Ray's resources for ``ray.address``, else this machine's."""
    if cpus is not None or gpus is not None:
        given = " ".join(f"--{k} {v}" for k, v in (("cpus", cpus), ("gpus", gpus)) if v is not None)
        return {"cpus": cpus if cpus is not None else os.cpu_count(), "gpus": gpus if gpus is not None else 0,
                "source": f"given: {given}" + ("" if cpus is not None else "; CPUs this machine's")}
    if manifest.ray.address:  # asked in a child process with a time limit: an unreachable GCS makes ray.init wait minutes
        import subprocess
        import sys

        code = ("import json, sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False); "
                "print(json.dumps(ray.cluster_resources()))")
        try:
            r = subprocess.run([sys.executable, "-c", code, manifest.ray.address], capture_output=True, text=True,
                               timeout=CLUSTER_TIMEOUT_S)
            res = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
        except subprocess.TimeoutExpired:
            res = None
        if res is None:
            raise ValueError(f"ray.address {manifest.ray.address}: cannot reach the cluster within {CLUSTER_TIMEOUT_S} s; "
                             "give --cpus/--gpus to plan for a node without it")
        return {"cpus": int(res.get("CPU", 0)), "gpus": int(res.get("GPU", 0)), "source": f"ray {manifest.ray.address}"}
    n_gpus = 0
    try:
        import torch

        n_gpus = torch.cuda.device_count()
    except Exception:
        pass
    return {"cpus": manifest.ray.num_cpus or os.cpu_count(), "gpus": n_gpus, "source": "this machine (embedded Ray)"}


# ------------------------------------------------------------------ the plan
def _stage_flops(name: str, cfg, manifest, size: DatasetSize, art: A.ArtifactSize) -> tuple[float | None, str]:
    """Forward FLOPs per image of a stage's models, and what they cover."""
    m = manifest.models
    caps = size.captions_per_image
    words = sum(S.words(c) for r in size.sample for c in r.captions) / max(1, sum(len(r.captions) for r in size.sample))
    if name == "extract-clip-tokens":
        sh = S.clip(m.clip)
        return sh["flops_image"] + caps * sh["flops_text"] * (words + 2) / max(1, sh["text_len"]), "vision + text towers"
    if name == "extract-image-groups":
        return S.groupvit(m.groupvit)["flops_image"], "GroupViT vision tower"
    if name == "extract-visual-tokens":
        f = S.sam(m.sam)["flops_image"]
        if cfg.segmenter == "sam" and f:
            return f + cfg.points_per_side ** 2 * SAM_DECODER_FLOPS_PER_POINT, "SAM encoder + mask decoder per point"
        return f, "SAM image encoder"
    if name == "extract-regions":
        f = S.detector(m.detector)["flops_image"]
        return f, "detector backbone + FPN + box head (RPN, NMS not counted)" if f else "detector FLOPs not counted"
    if name == "negative-captions":  # per caption: a p and a q pass of the MLM per noun; the word encoder on the
        mlm, we = S.text_model(m.mlm), S.text_model(m.word_encoder)  # caption and on K negatives per featured noun
        toks = 1.3 * words + 2
        nouns = art.rows.get("negatives", 0) / max(1, size.captions)
        k = cfg.negative_feature_k if cfg.negative_features != "none" else 0
        sets = nouns if cfg.negative_features == "all" else min(1.0, nouns) if cfg.negative_features == "sampled" else 0.0
        return (caps * toks * (2 * nouns * mlm["flops_token"] + we["flops_token"] * (1 + sets * k)),
                f"masked LM (p and q per noun, {nouns:.1f} nouns per caption) + word encoder (caption + {sets * k:.0f} negatives)")
    if name == "encode-concepts":  # the CLIP text tower over the vocabulary, ~(n-gram words + 2) tokens each
        mined, sh = _mined(size, manifest), S.clip(m.clip)
        total = mined["vocab"] * sh["flops_text"] * (manifest.stages.mine_concepts.n_max / 2 + 2) / max(1, sh["text_len"])
        return total / max(1, size.images), "CLIP text tower over the concept vocabulary (per image: total / images)"
    if name == "mine-concepts":  # the hard-negative text encoder over the vocabulary; the n-gram index is not modelled
        enc = S.text_model(cfg.text_encoder or m.text_encoder)
        total = _mined(size, manifest)["vocab"] * enc["flops_token"] * (cfg.n_max / 2 + 2)
        return total / max(1, size.images), "vocabulary encoder only (the driver's n-gram index is not modelled)"
    if name == "build-index":  # exact or IVF top-K search, both directions, as matrix products
        from pipeline.stages.build_index import resolve_kind

        p = S.clip(m.clip)["projection_dim"]
        n, c = size.images, size.captions
        frac = {side: cfg.nprobe_fraction if resolve_kind(rows, cfg.index, cfg.flat_max) == "ivf" else 1.0
                for side, rows in (("images", n), ("captions", c))}  # a query scans that share of the other side
        return (2 * p * n * c * (frac["images"] + frac["captions"]) / max(1, n),
                "FAISS search, both directions, as BLAS (each side's index exact or IVF; k-means not counted)")
    return None, "no model forward"


def build_plan(manifest, *, cpus: int | None = None, gpus: int | None = None, size: DatasetSize | None = None,
               calibrate_cpu: bool = True, say=None) -> dict:
    """The plan (the ``--json`` object). ``calibrate_cpu`` (``pipeline plan --calibrate``): time the CPU
    stages here (:func:`calibrate`, :func:`_measured`; minutes the first time, then cached); without it
    FLOPs and bytes only, and wall time for the GPU stages alone (FLOPs / :data:`GPU_ANCHOR`). ``say``:
    a line of progress per calibrated stage."""
    from pipeline.io import storage
    from pipeline.stage import dependency_order, registry

    output = storage.local_path(manifest.output)
    reg = registry()
    names = dependency_order([s for s in reg if getattr(manifest.stages, reg[s].key).enabled])
    size = size or count_dataset(manifest, output)
    check_size(manifest, size, names)
    m = manifest.models
    clus = cluster(manifest, cpus, gpus)
    t_start = time.perf_counter()
    cal = calibrate(m.clip, output / "_cache" / "plan") if calibrate_cpu else None
    decode_s = _decode_seconds(manifest, output) if size.source != "given" and calibrate_cpu else None
    sized: dict[str, A.ArtifactSize] = {}
    stages = []
    for name in names:
        if say and calibrate_cpu:
            say(f"calibrating {name} ...")
        cfg = getattr(manifest.stages, reg[name].key)
        a = _artifact(name, cfg, manifest, size, sized, output if calibrate_cpu and MEASURE else None, clus)
        sized[a.artifact] = a
        flops, covers = _stage_flops(name, cfg, manifest, size, a)
        st = _timed(name, cfg, a, flops, covers, size, clus, cal, decode_s)
        if calibrate_cpu and MEASURE and st["device"] == "cpu":
            _measured(st, name, cfg, manifest, size, a, output, clus)
        stages.append(st)
    if calibrate_cpu:
        _record_duration(output / "_cache" / "plan", names, time.perf_counter() - t_start)
    total = sum(s["total_bytes"] for s in stages)
    return {"schema_version": SCHEMA_VERSION, "manifest": getattr(manifest, "name", None), "output": str(manifest.output),
            "dataset": {"kind": manifest.dataset.kind, "images": size.images, "captions": size.captions, "source": size.source,
                        "exact": size.exact, "note": size.note},
            "cluster": clus, "calibrated": bool(calibrate_cpu),
            "calibration": cal and {k: cal[k] for k in ("model", "flops", "seconds", "flops_per_s", "measured_at")},
            "gpu_anchor": GPU_ANCHOR, "stages": stages, "total_bytes": total, "free_bytes": free_bytes(output)}


# ------------------------------------------------------------------ what a plan can size, and how long --calibrate takes
MAX_UNITS = 10_000_000  # units (shards, query chunks) of one stage the plan lists one by one
# A first --calibrate's seconds per stage: the calibrated plan of manifests/tiny.yaml's 9 stages took 5 min 14 s on
# the 2-core reference machine (issue 48, 2026-11-28), ~35 s a stage, rounded up; a later --calibrate is estimated
# by the last one recorded in <output>/_cache/plan/durations.json.
FIRST_CALIBRATION_S = 40.0
DURATIONS = "durations.json"


def check_size(manifest, size: DatasetSize, names: list[str]) -> None:
    """Refuse (ValueError, one line) a dataset with no images and a size whose units the plan could not
    list: more than :data:`MAX_UNITS` shards (or query chunks) in one stage."""
    ds = manifest.dataset
    if size.images < 1:
        where = ", ".join(f"dataset.{k} {getattr(ds, k)}" for k in ("images", "captions", "path") if getattr(ds, k, None))
        raise ValueError(f"the {ds.kind} dataset ({where or 'no location given'}) has no images ({size.source}): "
                         "nothing to plan; point the manifest's dataset at a folder with images")
    for name in names:
        cfg = getattr(manifest.stages, name.replace("-", "_"))
        if name == "build-index":
            key, per, rows = "query_chunk", cfg.query_chunk, size.images + size.captions
        elif name == "negative-captions":
            key, per, rows = "shard_size", cfg.shard_size, size.captions
        elif name in ("mine-concepts", "encode-concepts"):
            continue  # units of the vocabulary: sized from a sample, bounded
        else:
            key, per, rows = "shard_size", getattr(cfg, "shard_size", 0) or size.images, size.images
        units = math.ceil(rows / max(1, per))
        if units > MAX_UNITS:
            opt = f"stages.{name.replace('-', '_')}.{key}"
            raise ValueError(f"{size.images:,} images make {units:,} units of {per:,} in {name} ({opt} {per:,}); the "
                             f"plan lists each unit and takes at most {MAX_UNITS:,}: set {opt} to "
                             f"{math.ceil(rows / MAX_UNITS):,} or more, or plan fewer images")


def calibration_estimate(output: Path, names: list[str]) -> str:
    """How long ``--calibrate`` should take, said before it starts: the last calibration of these stages
    here (recorded in the cache), else :data:`FIRST_CALIBRATION_S` per stage."""
    try:
        last = json.loads((Path(output) / "_cache" / "plan" / DURATIONS).read_text()).get(",".join(names))
    except (OSError, ValueError, AttributeError):
        last = None
    if last:
        return (f"about {fmt_seconds(last['seconds'])} (the last calibration of these {len(names)} stages here, "
                f"{last['at']}; measurements it cached are reused)")
    return (f"about {fmt_seconds(FIRST_CALIBRATION_S * len(names))} ({len(names)} stages x ~{FIRST_CALIBRATION_S:.0f} s "
            f"on 2 cores: each stage's own worker timed on the first records, then cached)")


def _record_duration(cache: Path, names: list[str], seconds: float) -> None:
    path = cache / DURATIONS
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    old[",".join(names)] = {"seconds": round(seconds, 1), "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(old, indent=1))
    except OSError:
        pass


def _measured(st: dict, name, cfg, manifest, size: DatasetSize, a: A.ArtifactSize, output: Path, clus: dict) -> None:
    """Replace a CPU stage's FLOP-based time by its measured per-item cost plus the fixed costs
    (:mod:`pipeline.sizing.calibrate`) when its models can be built here."""
    from pipeline.sizing import calibrate as C

    cache, m = output / "_cache" / "plan", manifest.models
    if size.source == "given":  # a dataset not on this machine (and often a node stated by --cpus/--gpus): the FLOP path
        return
    cost = None
    if name == "ingest":
        cost = C.ingest(cache, cfg, manifest, output)
    elif name == "extract-clip-tokens":
        cost = _clip_cost(manifest, output, size, clus)
    elif name == "negative-captions" and W.loadable(m.mlm) and W.loadable(m.word_encoder) and (records := _first_records(manifest, output)):
        cost = C.negatives(cache, m, cfg, records, _busy(name, cfg, manifest, size, clus))
    elif name == "mine-concepts" and W.loadable(cfg.text_encoder or m.text_encoder):
        enc = cfg.text_encoder or m.text_encoder
        texts = [c for r in (size.text_sample or size.sample)[:C.MINE_RECORDS] for c in r.captions]
        cost = dict(C.concepts(cache, enc, cfg, texts, _mined(size, manifest)["texts"]))
        if cfg.hard_negatives:  # FAISS's exact search of the vocabulary, 8,192 concepts a batch, k + max(8, k) deep
            from pipeline.concepts.hard_negatives import search_depth
            from pipeline.sizing.index_cost import flat_pair_seconds

            vocab = _mined(size, manifest)["vocab"]
            cost["hn_per_pair_s"] = flat_pair_seconds(cache, S.text_model(enc)["hidden"], search_depth(vocab, cfg.hard_negatives_k),
                                                      min(vocab, 8192), vocab, threads=os.cpu_count() or 1)  # the driver's
    elif name == "build-index":
        from pipeline.sizing import index_cost

        cost = index_cost.costs(cache, S.clip(m.clip)["projection_dim"], cfg, size.images, size.captions,
                                math.ceil(max((len(r.captions) for r in size.sample), default=1)), cfg.query_chunk)
        if clip := _clip_cost(manifest, output, size, clus):
            cost["read_per_row_s"] = clip.get("embed_read_per_row_s", 0.0)
    if cost is None:
        return
    if name in ("ingest", "build-index", "mine-concepts"):  # their units run as Ray tasks, which import the stage's module
        cost = dict(cost, import_s=C.stage_import(cache, f"pipeline.stages.{name.replace('-', '_')}"))
    workers = st["workers"] if name != "mine-concepts" else max(1, int(clus["cpus"] // max(1, cfg.torch_threads)))
    wall, how = W.stage_wall(name, cfg, manifest, size, a.rows, cost, C.system(cache, manifest.ray), workers)
    st.update(wall_seconds=wall, time_basis=how, seconds_per_image=wall / max(1, size.images), measured=True)


def _busy(name, cfg, manifest, size, clus) -> int:
    """Workers of a CPU stage busy at once: the cluster's CPUs over each worker's, at most its units."""
    workers = max(1, int(clus["cpus"] // max(1e-9, getattr(cfg, "num_cpus", None) or getattr(cfg, "torch_threads", 1) or 1)))
    return max(1, min(workers, len(W.units_of(name, cfg, size, {}, manifest))))


def _clip_cost(manifest, output: Path, size, clus) -> dict | None:
    """extract-clip-tokens' calibration (cached): its seconds, and the unit's embeddings and their
    reading time that build-index's plan uses; None when its CLIP cannot be built here."""
    from pipeline.sizing import calibrate as C

    m, cfg = manifest.models, manifest.stages.extract_clip_tokens
    if not (W.loadable(m.clip) and (records := _first_records(manifest, output))):
        return None
    return C.clip_tokens(output / "_cache" / "plan", m.clip, cfg, records, _busy("extract-clip-tokens", cfg, manifest, size, clus))


def _first_records(manifest, output: Path) -> list[dict]:
    from pipeline.sizing import calibrate as C

    if _FIRST.get("key") != id(manifest):
        _FIRST.update(key=id(manifest), value=C.first_records(manifest, output, max(C.CLIP_IMAGES, C.NEG_CAPTIONS // 4)))
    return _FIRST["value"]


_FIRST: dict = {}


def _artifact(name, cfg, manifest, size, sized, output: Path | None = None, clus: dict | None = None) -> A.ArtifactSize:
    m = manifest.models
    if name == "ingest":
        if output is not None and size.source != "given":  # ingest's worker on the first records (cached)
            from pipeline.sizing import calibrate as C

            return A.samples(size, cfg, C.ingest(output / "_cache" / "plan", cfg, manifest, output)["tables"])
        return A.samples(size, cfg)
    if name == "extract-clip-tokens":
        sh = S.clip(m.clip)
        return A.clip_tokens(size, cfg, sh, lambda text, cap: S.caption_tokens(sh, text, cap))
    if name == "extract-image-groups":
        return A.image_groups(size, cfg, S.groupvit(m.groupvit, manifest.dataset.synthetic.image_size))
    if name == "extract-regions":
        return A.regions(size, cfg, S.detector(m.detector))
    if name == "extract-visual-tokens":
        shape = S.sam(m.sam)
        if cfg.embedding == "clip_pool":  # I is the CLIP's image embedding (the SAM still runs: its FLOPs added)
            c = S.clip(m.clip)
            shape = {**shape, "image_feature_dim": c["projection_dim"], "flops_image": shape["flops_image"] + c["flops_image"]}
        return A.visual_tokens(size, cfg, shape, manifest.dataset.kind)
    if name == "negative-captions":
        measured = None
        if output is not None and size.source != "given":
            from pipeline.sizing import calibrate as C

            if W.loadable(m.mlm) and W.loadable(m.word_encoder) and (records := _first_records(manifest, output)):
                measured = C.negatives(output / "_cache" / "plan", m, cfg, records, _busy(name, cfg, manifest, size, clus)).get("tables")
        return A.negatives(size, cfg, S.text_model(m.word_encoder)["hidden"], _pos_tags(m.spacy, size), measured)
    if name == "mine-concepts":
        enc = cfg.text_encoder or m.text_encoder
        return A.concepts(size, cfg, S.text_model(enc)["hidden"], _mined(size, manifest))
    if name == "encode-concepts":
        sh = S.clip(m.clip)
        return A.concept_tokens(_mined(size, manifest), size, cfg, sh, lambda text, cap: S.caption_tokens(sh, text, cap))
    if name == "build-index":
        measured = None
        if output is not None and size.source != "given":
            from pipeline.sizing import calibrate as C

            cache = output / "_cache" / "plan"
            emb = (_clip_cost(manifest, output, size, clus) or {}).get("embeddings")
            if emb and (cache / emb).is_file():
                measured = C.index_tables(cache / emb, cfg)
        return A.index(size, cfg, S.clip(m.clip)["projection_dim"], measured)
    raise ValueError(f"pipeline plan: no size model for stage {name}")


def _mined(size: DatasetSize, manifest) -> dict:
    key = id(size)
    if _MINED.get("key") != key:
        _MINED.update(key=key, value=A.mined_sample(size, manifest.stages.mine_concepts))
    return _MINED["value"]


_MINED: dict = {}


def _pos_tags(spacy_name: str, size: DatasetSize) -> list[list[str]]:
    from pipeline.models.spacy_tagger import Tagger

    texts = [c for r in size.sample for c in r.captions]
    return [[w.pos for w in ws] for ws in Tagger(spacy_name).tag(texts)] if texts else []


def _timed(name, cfg, a: A.ArtifactSize, flops, covers, size, clus, cal, decode_s) -> dict:
    rows = size.images
    if name in ("mine-concepts", "encode-concepts"):  # the timed part is the vocabulary's encoder units
        units = len(A.unit_rows(a.rows.get("vocab", a.rows.get("index", 1)), cfg.encode_unit)) or 1
    elif name == "build-index":
        units = len(A.unit_rows(sum(a.rows.values()), cfg.query_chunk)) or 1
    else:
        units = len(A.unit_rows(rows, getattr(cfg, "shard_size", rows) or rows)) or 1
    on_gpu = bool(getattr(cfg, "num_gpus", 0)) and clus["gpus"] > 0
    s_img, how = None, covers
    if flops:
        if on_gpu:
            s_img, how = flops / GPU_ANCHOR["flops_per_s"], f"{covers}; FLOPs / the A100 anchor"
        elif cal:
            s_img, how = flops / cal["flops_per_s"], f"{covers}; FLOPs / this CPU's calibrated rate"
    elif name == "ingest" and decode_s is not None:
        s_img, how = decode_s, "image decode, measured on the dataset's first images"
    if s_img is not None and name.startswith("extract-") and decode_s is not None:  # the actor decodes its images
        if on_gpu:  # in a prefetch thread on its CPU while the GPU computes
            s_img, how = max(s_img, decode_s), f"{how}; or the actor's image decode (measured), whichever is slower"
        else:  # on the same core
            s_img, how = s_img + decode_s, f"{how}; + the image decode (measured)"
    if on_gpu:
        workers = max(1, int(clus["gpus"] // cfg.num_gpus))
    else:
        workers = max(1, int(clus["cpus"] // max(1e-9, getattr(cfg, "num_cpus", 1.0) or 1.0)))
    workers = min(workers, units)
    wall = s_img * rows / workers if s_img is not None else None
    return {"stage": name, "artifact": a.artifact, "rows": a.rows, "exact_rows": a.exact_rows, "bytes": a.bytes,
            "total_bytes": a.total, "notes": a.notes, "flops_per_image": flops, "seconds_per_image": s_img,
            "device": "gpu" if on_gpu else "cpu", "workers": workers, "wall_seconds": wall, "time_basis": how}


def free_bytes(output) -> int | None:
    p = Path(output)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def space_warning(plan: dict) -> str | None:
    free = plan.get("free_bytes")
    if free is not None and plan["total_bytes"] > free:
        return (f"warning: the run needs ~{fmt_bytes(plan['total_bytes'])} but {plan['output']} has "
                f"{fmt_bytes(free)} free: it would not fit")
    return None


# ------------------------------------------------------------------ output
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    from pipeline.stage import format_seconds

    return format_seconds(s)


WIDTH = 120  # the table and every line of `pipeline plan`'s text


def _wrap(text: str, indent: str = "  ") -> list[str]:
    """``text`` in lines of at most :data:`WIDTH` characters (a number stays with its unit)."""
    import re
    import textwrap

    glued = re.sub(r"(\d) (B|kB|MB|GB|TB|PB|s|ms|GFLOP)\b", "\\1\u00a0\\2", text)
    return [line.replace("\u00a0", " ") for line in textwrap.wrap(
        glued, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False)] or [indent]


def format_plan(plan: dict) -> str:
    """The plan as text: aligned columns, no line over :data:`WIDTH` characters (a stage's rows column
    shows its first tables' counts, as many as fit; all of them, its bytes per table and what its time
    covers follow below the table)."""
    d, c = plan["dataset"], plan["cluster"]
    lines = _wrap(f"plan for {plan['manifest']} -> {plan['output']}", "")
    lines += _wrap(f"dataset: {d['kind']}, {d['images']:,} images, {d['captions']:,} captions ({d['source']}"
                   f"{'' if d['exact'] else '; ' + (d['note'] or 'approximate')})", "")
    lines += _wrap(f"cluster: {c['cpus']} CPUs, {c['gpus']} GPUs ({c['source']})", "")
    cal = plan.get("calibration")
    if cal:
        lines += _wrap(f"calibration: {cal['model']}: {cal['flops'] / 1e9:.1f} GFLOP in {cal['seconds']:.2f} s on one "
                       f"thread = {cal['flops_per_s'] / 1e9:.1f} GFLOP/s (measured {cal['measured_at']})", "")
    head = ["stage", "artifact", "rows", "bytes", "GFLOP/img", "s/img", "dev", "workers", "wall"]
    right = {"rows", "bytes", "GFLOP/img", "s/img", "workers", "wall"}
    body = []
    for s in plan["stages"]:
        fl = f"{s['flops_per_image'] / 1e9:.2f}" if s["flops_per_image"] else "-"
        sp = f"{s['seconds_per_image']:.3g}" if s["seconds_per_image"] is not None else "-"
        body.append([s["stage"], s["artifact"], list(s["rows"].items()), fmt_bytes(s["total_bytes"]), fl, sp, s["device"],
                     str(s["workers"]), fmt_seconds(s["wall_seconds"])])
    fixed = [max(len(head[i]), *(len(r[i]) for r in body)) if body else len(head[i]) for i in range(len(head)) if i != 2]
    room = WIDTH - 2 - sum(fixed) - (len(head) - 1) * 2  # what the rows column may take
    for r, s in zip(body, plan["stages"]):
        approx = "" if s["exact_rows"] else "~"
        text = approx + ", ".join(f"{k} {v:,}" for k, v in r[2][:1])
        for k in range(2, len(r[2]) + 1):
            longer = approx + ", ".join(f"{a} {v:,}" for a, v in r[2][:k])
            if len(longer) > room:
                break
            text = longer
        r[2] = text if len(text) <= room else text[: room - 3] + "..."
    widths = [max(len(head[i]), *(len(r[i]) for r in body)) if body else len(head[i]) for i in range(len(head))]

    def row(cells) -> str:
        return "  " + "  ".join(f"{x:>{w}}" if h in right else f"{x:<{w}}" for x, w, h in zip(cells, widths, head)).rstrip()

    lines.append(row(head))
    lines += [row(r) for r in body]
    known = [s["wall_seconds"] for s in plan["stages"] if s["wall_seconds"] is not None]
    wall = f"wall {fmt_seconds(sum(known))} for the {len(known)} timed stage{'' if len(known) == 1 else 's'}" if known else ""
    if len(known) < len(plan["stages"]) and not plan.get("calibrated", True):
        wall += ("; " if wall else "") + "CPU stages: FLOPs and bytes only (`pipeline plan --calibrate` times them here)"
    lines += _wrap(f"total {fmt_bytes(plan['total_bytes'])} on disk ({fmt_bytes(plan['free_bytes'])} free)" +
                   (f"; {wall}" if wall else ""))
    for s in plan["stages"]:
        rows = ", ".join(f"{k} {v:,}" for k, v in s["rows"].items())
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in s["bytes"].items())
        lines += _wrap(f"{s['artifact']}: rows {rows}; bytes {parts}; time: {s['time_basis']}"
                       + ("; " + "; ".join(s["notes"]) if s["notes"] else ""))
    if any(s["device"] == "gpu" for s in plan["stages"]):
        lines += _wrap(f"gpu anchor: {plan['gpu_anchor']['source']}")
    return "\n".join(lines)
