"""Measured costs for `pipeline plan`: each stage's own work on the dataset's first records, and
the fixed costs a run pays (a process start, Ray's start or attach, its task and actor pools, a
worker's cold build). :mod:`pipeline.sizing.walltime` turns them into wall time.

No stage is run: each stage's *worker code* is called on one torch thread, on the dataset's first
records, at the manifest's batch shapes, into a scratch folder:

* ``ingest``: :func:`~pipeline.stages.ingest.ingest_unit` on units of the first 500, 1,000 and 2,000
  records (the reader's reading timed with it): seconds per image, and each table's Parquet growth;
* ``extract-clip-tokens``: :class:`~pipeline.stages.extract_clip_tokens.ClipTokenWorker` on a
  unit of the first 512 images (decode, both towers, shard and tables): seconds per image; its
  embeddings size build-index's tables (:func:`index_tables`);
* ``negative-captions``: :class:`~pipeline.stages.negative_captions.NegativeCaptionsWorker` on a
  unit of the first 1,000 captions (after units of a quarter and half): seconds per caption, and the
  growth of its tables;
* ``mine-concepts``: the miner on the caption sample (seconds per caption) and the hard-negative
  encoder (:class:`~pipeline.models.text_encoder.TextEncoder`) on mined concept texts of every
  length: seconds per vocabulary entry;
* ``build-index``: :mod:`pipeline.sizing.index_cost` (its build and both sides' searches, the
  stage's own functions timed); the embeddings' reading is timed here with extract-clip-tokens'.

A stage whose workers run several at once is timed again with that many copies started together
in child processes (:func:`at_once`): the slowdown the machine's cores, caches and other load
cause. A worker's cold build (a fresh process importing torch and the stage and building its
models) is timed in a child process (:func:`cold_load`); so are a ``pipeline`` process's imports,
Ray's start or attach and the pipeline's task and actor pools on units that do nothing
(:func:`system`). Everything is cached in ``<output>/_cache/plan/``, keyed by the model specs,
the shapes, torch's version and the CPU count (``system`` by the Ray address).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.sizing import artifacts as A

COST_VERSION = 13
CLIP_IMAGES = 512  # images of the calibration unit (extract-clip-tokens; their embeddings size build-index's tables)
NEG_CAPTIONS = 1000  # captions mined (negative-captions): enough rows for the Parquet's compression to show
VOCAB_TEXTS = 512  # concept texts encoded (mine-concepts)
INGEST_RECORDS = 2000
MINE_RECORDS = 5000  # records whose captions the miner is timed on (seconds per caption)


def _key(parts: dict) -> str:
    import torch

    parts = dict(parts, torch=torch.__version__, cpu=os.cpu_count(), v=COST_VERSION)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _cached(cache: Path, name: str, parts: dict, measure) -> dict:
    path = cache / f"{name}-{_key(parts)}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = dict(measure(), key=parts, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    finally:
        torch.set_num_threads(threads)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    return out


def _best(fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------ fixed costs
_RAY = """
import json, sys, time
t0 = time.perf_counter()
from pipeline.config import RayConfig
from pipeline.runtime import ensure_ray, map_units
from pipeline.sizing.calibrate import NoopWorker, noop_unit
cfg = RayConfig.model_validate_json(sys.argv[1])
ensure_ray(cfg)
t1 = time.perf_counter()
units = [{"unit": f"{i:05d}"} for i in range(2)]
if sys.argv[2] == "tasks":
    list(map_units(units, noop_unit, ray_cfg=cfg))
else:
    list(map_units(units, NoopWorker, ray_cfg=cfg, actor=True, constructor_kwargs={}))
t2 = time.perf_counter()
import ray
ray.shutdown()
t3 = time.perf_counter()
print(json.dumps({"ray_start_s": t1 - t0 + t3 - t2, "pool_s": t2 - t1}))
"""


def noop_unit(unit: dict) -> dict:
    """A unit that does nothing: what :func:`system` times Ray's task machinery with."""
    return {"unit": unit["unit"], "stats": {}}


class NoopWorker:
    """An actor that does nothing: what :func:`system` times Ray's actor machinery with."""

    def __call__(self, unit: dict) -> dict:
        return {"unit": unit["unit"], "stats": {}}


_PROCESS = """
import time
t0 = time.perf_counter()
import pipeline.cli, pipeline.stage, ray, pyarrow, polars, numpy  # what `pipeline run <stage>` imports
pipeline.stage.registry()
print(time.perf_counter() - t0)
"""


def _child(code: str, *args: str, timeout: int = 300) -> str:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"calibration child failed: {r.stderr[-800:]}")
    return r.stdout.strip().splitlines()[-1]


def system(cache: Path, ray_cfg) -> dict:
    """Seconds of a ``pipeline`` process's start (its imports and the stage registry), of Ray's
    start or attach (the manifest's ``ray`` section: its address, or an embedded Ray) and shutdown,
    and of the pipeline's own task and actor pools (:func:`pipeline.runtime.map_units`) on two
    units that do nothing, each timed in a child process (cached)."""
    address = ray_cfg.address

    def measure():
        process = float(_child(_PROCESS))
        try:
            tasks = json.loads(_child(_RAY, ray_cfg.model_dump_json(), "tasks"))  # each pool in a fresh process:
            actors = json.loads(_child(_RAY, ray_cfg.model_dump_json(), "actors"))  # a stage pays Ray Data's first use
            ray = {"ray_start_s": min(tasks["ray_start_s"], actors["ray_start_s"]), "task_pool_s": tasks["pool_s"],
                   "actor_pool_s": actors["pool_s"]}
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
            ray = {"ray_start_s": None, "task_pool_s": None, "actor_pool_s": None, "error": str(e)[-300:]}
        return {"process_s": process, **ray, "parallel": {str(k): parallel_factor(k) for k in range(2, (os.cpu_count() or 1) + 1)}}

    return _cached(cache, "system", {"what": "system", "ray": address or "embedded"}, measure)


_SPIN = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(192, 192)
d = {}
t0 = time.perf_counter()
for i in range(800):  # tensor ops and Python work, as the stages' workers do (about half a second alone)
    a = torch.tanh(a @ a.T / 192)
    for j in range(150):
        d[(i * 150 + j) % 4099] = str(j) * 3
print(time.perf_counter() - t0)
"""


def parallel_factor(k: int) -> float:
    """How much slower each of ``k`` workers runs when all run at once on this machine (its other
    load, its cores, memory bandwidth) than one alone: ``k`` copies of a small torch and Python
    loop started together, their slowest against one alone (>= 1)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(n):
        procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
        return max(float(p.communicate()[0].strip().splitlines()[-1]) for p in procs)

    single = min(run(1) for _ in range(2))
    return max(1.0, sum(run(k) for _ in range(2)) / 2 / single)


_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
exec(sys.argv[1])
print(time.perf_counter() - t0)
"""


def cold_load(code: str) -> float:
    """Seconds a fresh process takes to import and build a stage's worker (``code``): what each
    actor (and the driver, for provenance) pays before its first item."""
    return float(_child(_LOAD, code))


# ------------------------------------------------------------------ per-stage work
def _profiles(folder: Path, tables: dict) -> None:
    """Append each table's ``(rows, file bytes, data bytes, dictionary bytes)`` found under ``folder``."""
    import pyarrow.parquet as pq

    for f in folder.rglob("*.parquet"):
        if f.parent.name != "errors":
            rows, data, dic = A.parquet_parts(pq.read_metadata(f))
            tables.setdefault(f.parent.name, []).append((rows, f.stat().st_size, data, dic))


def _unit_records(size_records: list, n: int) -> list[dict]:
    """The dataset's first records as a unit's records (what ingest hands the image stages)."""
    out, cid = [], 0
    for sid, rec in enumerate(size_records[:n]):
        caps = [[cid + k, t] for k, t in enumerate(rec["captions"])]
        cid += len(caps)
        out.append({"sample_id": sid, "source_id": str(sid), "image": rec["image"], "captions": caps})
    return out


def first_records(manifest, output: Path, n: int) -> list[dict]:
    """The first ``n`` readable records of the dataset: image reference and kept captions."""
    from pipeline.readers import read_dataset
    from pipeline.sizing.dataset import plan_dataset

    out = []
    for rec in read_dataset(plan_dataset(manifest, output), output, defer_masks=True):
        if len(out) >= n:
            break
        caps = [c.strip() for c in rec.captions if c and c.strip()]
        if rec.image and caps and not any(i is None for i, _ in rec.problems):
            out.append({"image": str(rec.image), "captions": caps})
    return out


def clip_tokens(cache: Path, spec: str, cfg, records: list[dict], together: int = 1) -> dict:
    """extract-clip-tokens' worker on a unit of the first images: seconds per image alone and, with
    ``together`` > 1, when that many workers run at once; the cold build of the worker."""
    parts = {"together": together, "stage": "extract-clip-tokens", "clip": spec, "batch": cfg.batch_size, "text_batch": cfg.text_batch_size,
             "max_text": cfg.max_text_tokens, "project": cfg.project_tokens, "precision": cfg.token_precision,
             "n": len(records), "first": records[0]["image"] if records else None}

    def measure():
        args = [spec, "cpu", 1, cfg.batch_size, cfg.text_batch_size, cfg.max_text_tokens, cfg.project_tokens, cfg.token_precision]
        load = cold_load(f"from pipeline.stages.extract_clip_tokens import ClipTokenWorker; ClipTokenWorker(*{args!r})")
        recs = _unit_records(records, CLIP_IMAGES)
        with tempfile.TemporaryDirectory() as tmp:
            per_item, folder = clip_work(args, recs, tmp)
            read = _save_embeddings(Path(folder), cache / f"embeddings-{_key(parts)}.npz")
        out = {"load_s": load, "per_item_s": per_item, "item": "image", "items": len(recs),
               "embeddings": f"embeddings-{_key(parts)}.npz", "embed_read_per_row_s": read}
        if together > 1:
            out["per_item_s_together"] = {str(together): at_once(together, "clip_work", {"args": args, "recs": recs})}
        return out

    return _cached(cache, "cost", parts, measure)


def clip_work(args: list, recs: list[dict], tmp: str | None = None, barrier: str | None = None, passes: int = 3):
    """ClipTokenWorker built from ``args``, then called on one unit of ``recs`` ``passes`` times:
    (the median pass's seconds per image, the last output folder)."""
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages import extract_clip_tokens as st
    from pipeline.stages._image_units import image_units

    worker = st.ClipTokenWorker(*args)
    _wait(barrier)
    tmp = tmp or tempfile.mkdtemp()
    times, folder = [], None
    for k in range(passes):
        writer = ArtifactWriter(Path(tmp) / f"o{k}-{os.getpid()}", "clip_tokens", st.NAME, {})
        folder = str(writer.dir)
        (name, unit_input, payload), = image_units(recs, len(recs))
        t0 = time.perf_counter()
        worker(dict(payload, artifact_dir=folder, stage=st.NAME, unit=name, fingerprint=writer.unit_fingerprint(name, unit_input)))
        times.append((time.perf_counter() - t0) / max(1, len(recs)))
    return sorted(times)[len(times) // 2], folder


def _wait(barrier: str | None) -> None:
    """Meet the other children of :func:`at_once` (each writes its mark, then waits for all)."""
    if not barrier:
        return
    folder, k = barrier.rsplit("|", 1)
    Path(folder, f"ready-{os.getpid()}").touch()
    deadline = time.time() + 300
    while len(list(Path(folder).glob("ready-*"))) < int(k) and time.time() < deadline:
        time.sleep(0.05)


_AT_ONCE = """
import json, sys, torch
torch.set_num_threads(1)
from pipeline.sizing import calibrate as C
kw = json.loads(open(sys.argv[2]).read())
print(json.dumps(getattr(C, sys.argv[1])(**kw, barrier=sys.argv[3])[0]))
"""


def at_once(k: int, fn: str, kwargs: dict) -> float:
    """Seconds per item of ``fn`` (a work function of this module) when ``k`` copies run at once,
    as ``k`` workers of a stage do on this machine (its cores, caches, memory bandwidth and other
    load): ``k`` child processes, started together after each has built its worker; their mean."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kwargs.json"
        path.write_text(json.dumps(kwargs))
        procs = [subprocess.Popen([sys.executable, "-c", _AT_ONCE, fn, str(path), f"{tmp}|{k}"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env) for _ in range(k)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
    vals = [float(o.strip().splitlines()[-1]) for o in outs if o.strip()]
    return sum(vals) / len(vals) if vals else float("nan")


def _save_embeddings(folder: Path, path: Path) -> float:
    """The calibration unit's image and caption embeddings (what build-index reads), for sizing the
    index's tables; returns the seconds per row of reading them as build-index does."""
    import numpy as np
    import pyarrow.parquet as pq

    def mat(col):
        col = col.combine_chunks()
        return np.asarray(col.values.to_numpy(zero_copy_only=False), np.float32).reshape(-1, col.type.list_size)

    t0 = time.perf_counter()  # build-index reads these columns of every shard
    imgs = pq.read_table(next((folder / "images").glob("*.parquet")), columns=["sample_id", "image_embed"])
    caps = pq.read_table(next((folder / "captions").glob("*.parquet")), columns=["caption_id", "sample_id", "text_embed"])
    read_s = time.perf_counter() - t0
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, img_ids=imgs["sample_id"].to_numpy(), img=mat(imgs["image_embed"]), cap_ids=caps["caption_id"].to_numpy(),
             cap_owner=caps["sample_id"].to_numpy(), cap=mat(caps["text_embed"]))
    return read_s / max(1, imgs.num_rows + caps.num_rows)


def index_tables(npz: Path, cfg) -> dict:
    """build-index's two tables on the calibration unit's embeddings (exact search, the stage's own
    :func:`~pipeline.stages.build_index.search_excluding` and schemas), for its first quarter, half and
    all of it: each table's :func:`~pipeline.sizing.artifacts.parquet_growth` (queries and database
    grow together, as in the stage)."""
    import faiss
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.stages.build_index import NEG_CAPTION_SCHEMA, NEG_IMAGE_SCHEMA, l2_normalize, search_excluding

    e = np.load(npz)
    profiles: dict[str, list] = {}
    n_all = len(e["img_ids"])
    for n in (n_all // 4, n_all // 2, n_all):
        ii = e["img_ids"][:n]
        keep = np.isin(e["cap_owner"], ii)
        ci, co = e["cap_ids"][keep], e["cap_owner"][keep]
        xi, xc = e["img"][:n], e["cap"][keep]
        if cfg.normalize:
            xi, xc = l2_normalize(xi), l2_normalize(xc)
        k = min(cfg.k, len(ci) - 1, n - 1)
        if k < 1:
            return {}
        cap_index, img_index = faiss.IndexFlatIP(xc.shape[1]), faiss.IndexFlatIP(xi.shape[1])
        cap_index.add(np.ascontiguousarray(xc))
        img_index.add(np.ascontiguousarray(xi))
        max_caps = int(np.bincount(np.searchsorted(ii, co)).max()) if len(co) else 1
        ids, sc = search_excluding(cap_index, xi, k, (np.arange(len(ci)), co), ii, max_caps)  # results are positions
        ids = np.where(ids >= 0, ci[np.maximum(ids, 0)], -1)
        t_img = pa.table({"sample_id": pa.array(ii, pa.int64()), "caption_ids": pa.array(list(ids), pa.list_(pa.int64())),
                          "scores": pa.array(list(sc), pa.list_(pa.float32()))}, schema=NEG_IMAGE_SCHEMA)
        ids, sc = search_excluding(img_index, xc, k, None, np.searchsorted(ii, co), 1)
        ids = np.where(ids >= 0, ii[np.maximum(ids, 0)], -1)
        t_cap = pa.table({"caption_id": pa.array(ci, pa.int64()), "sample_id": pa.array(co, pa.int64()),
                          "image_ids": pa.array(list(ids), pa.list_(pa.int64())),
                          "scores": pa.array(list(sc), pa.list_(pa.float32()))}, schema=NEG_CAPTION_SCHEMA)
        for name, t in (("image_negatives", t_img), ("caption_negatives", t_cap)):
            buf = __import__("io").BytesIO()
            pq.write_table(t, buf, compression="zstd")
            rows, data, dic = A.parquet_parts(pq.read_metadata(pa.BufferReader(buf.getvalue())))
            profiles.setdefault(name, []).append((rows, len(buf.getvalue()), data, dic))
    return {name: A.parquet_growth(*v) for name, v in profiles.items()}


def negatives(cache: Path, models, cfg, records: list[dict], together: int = 1) -> dict:
    """negative-captions' worker on units of the first captions: seconds per caption alone and,
    with ``together`` > 1, when that many workers run at once; the cold build; its tables' growth."""
    from pipeline.stages.negative_captions import miner_options

    opts = miner_options(cfg).__dict__
    texts = [c for r in records for c in r["captions"]][:NEG_CAPTIONS]  # as the stage writes them
    parts = {"together": together, "stage": "negative-captions", "mlm": models.mlm, "we": models.word_encoder, "spacy": models.spacy,
             "opts": opts, "batch": cfg.caption_batch, "texts": texts}

    def measure():
        args = [models.mlm, models.word_encoder, models.spacy, opts, None, 1, cfg.caption_batch]
        load = cold_load(f"from pipeline.stages.negative_captions import NegativeCaptionsWorker; NegativeCaptionsWorker(*{args!r})")
        per_item, tables, stats = negatives_work(args, texts)
        out = {"load_s": load, "per_item_s": per_item, "item": "caption", "items": stats.get("captions", len(texts)),
               "nouns_per_caption": stats.get("nouns", 0) / max(1, stats.get("captions", len(texts))),
               "tables": {name: A.parquet_growth(*v) for name, v in tables.items() if len(v) == 3}}
        if together > 1:
            out["per_item_s_together"] = {str(together): at_once(together, "negatives_work", {"args": args, "texts": texts})}
        return out

    return _cached(cache, "cost", parts, measure)


def negatives_work(args: list, texts: list[str], barrier: str | None = None):
    """NegativeCaptionsWorker built from ``args``, called on units of the first quarter and half of
    ``texts`` (warm-ups) then on all: (seconds per caption of the last, each table's Parquet
    profiles, its stats)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.stages.negative_captions import NegativeCaptionsWorker

    w = NegativeCaptionsWorker(*args)
    _wait(barrier)
    with tempfile.TemporaryDirectory() as tmp:
        cap = Path(tmp) / "captions.parquet"
        pq.write_table(pa.table({"caption_id": list(range(len(texts))), "sample_id": [i // 5 for i in range(len(texts))],
                                 "text": texts}), cap)
        sids = sorted({i // 5 for i in range(len(texts))})
        tables: dict[str, list] = {}
        for k, unit in enumerate((sids[: len(sids) // 4], sids[: len(sids) // 2], sids)):  # the first ones warm up
            d = Path(tmp) / str(k)
            d.mkdir()
            t0 = time.perf_counter()
            stats = w({"captions_path": str(cap), "sample_ids": unit, "stage": "plan", "artifact_dir": str(d),
                       "unit": f"{k:05d}", "fingerprint": "plan"})["stats"]
            seconds = time.perf_counter() - t0
            _profiles(d, tables)
    return seconds / max(1, stats.get("captions", 1)), tables, stats


def concepts(cache: Path, spec: str, cfg, texts: list[str], vocab_texts: list[str]) -> dict:
    parts = {"stage": "mine-concepts", "enc": spec, "params": cfg.mining_params().__dict__, "batch": cfg.encode_batch,
             "n": len(texts), "first": texts[:3], "hn": cfg.hard_negatives}

    def measure():
        from pipeline.concepts.mining import mine

        sids = list(range(len(texts)))
        mine_s = _best(lambda: mine(sids, texts, cfg.mining_params()))
        out = {"mine_per_caption_s": mine_s / max(1, len(texts)), "item": "vocabulary entry"}
        if cfg.hard_negatives and vocab_texts:
            from pipeline.models.text_encoder import TextEncoder

            out["load_s"] = cold_load(f"from pipeline.models.text_encoder import TextEncoder; TextEncoder({spec!r}, torch_threads=1)")
            enc = TextEncoder(spec, torch_threads=1)
            v = vocab_texts[:: max(1, len(vocab_texts) // VOCAB_TEXTS)][:VOCAB_TEXTS]  # every length of n-gram
            out["per_item_s"] = _best(lambda: enc.encode(v, batch_size=cfg.encode_batch)) / len(v)
            out["items"] = len(v)
        return out

    return _cached(cache, "cost", parts, measure)


def ingest(cache: Path, cfg, manifest, output: Path) -> dict:
    """ingest's worker (:func:`pipeline.stages.ingest.ingest_unit`) on units of the first
    :data:`INGEST_RECORDS` records and of their first quarter and half, into a scratch folder: seconds
    per image (the worker's checks and writes, and apart the driver's reading) and, per table, rows
    per image and its Parquet growth (:func:`~pipeline.sizing.artifacts.parquet_growth`)."""
    parts = {"stage": "ingest", "dataset": manifest.dataset.model_dump(mode="json"), "verify": cfg.verify_images,
             "n": INGEST_RECORDS}

    def measure():
        from itertools import islice

        import pyarrow.parquet as pq

        from pipeline.loaders.samples import dataset_image_root
        from pipeline.readers import read_dataset
        from pipeline.sizing.dataset import plan_dataset
        from pipeline.stages.ingest import _record_payload, ingest_unit

        ds = plan_dataset(manifest, output)

        def read(n):
            out, cid = [], 0
            for i, rec in enumerate(islice(read_dataset(ds, output, defer_masks=True), n)):
                out.append(_record_payload(rec, i, cid))
                cid += len(rec.captions)
            return out

        read(1)  # the reader's own start (an annotation file's parse) is paid once, not per image
        t0 = time.perf_counter()
        recs = read(INGEST_RECORDS)
        read_s = time.perf_counter() - t0
        root = dataset_image_root(ds, output)
        payload = {"verify_images": cfg.verify_images, "max_pixels": cfg.max_pixels, "min_caption_chars": cfg.min_caption_chars,
                   "has_annotations": True, "image_root": str(root) if root else None, "stage": "plan",
                   "fingerprint": "plan"}
        tables: dict[str, list] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for k, chunk in enumerate((recs[: len(recs) // 4], recs[: len(recs) // 2], recs)):
                d = Path(tmp) / str(k)
                d.mkdir()
                t0 = time.perf_counter()
                ingest_unit(dict(payload, records=chunk, artifact_dir=str(d), unit=f"{k:05d}"))
                work = time.perf_counter() - t0
                _profiles(d, tables)
        n = max(1, len(recs))
        per_table = {name: dict(A.parquet_growth(*v), rows_per_image=v[-1][0] / n) for name, v in tables.items() if len(v) == 3}
        return {"per_item_s": work / n, "read_per_item_s": read_s / n, "item": "image", "items": n, "tables": per_table,
                "generate_s": _generate_seconds(manifest.dataset)}

    return _cached(cache, "cost", parts, measure)


def _generate_seconds(ds, n: int = 200) -> float | None:
    """Seconds per image the synthetic generator takes (ingest's reader generates a dataset that
    is not yet on disk), timed on ``n`` images of the same parameters in a scratch folder."""
    if ds.kind != "synthetic":
        return None
    from pipeline.readers import read_dataset

    small = ds.model_copy(deep=True)
    small.synthetic.n_images = n
    with tempfile.TemporaryDirectory() as tmp:
        small.synthetic.root = tmp
        t0 = time.perf_counter()
        for _ in read_dataset(small, Path(tmp), defer_masks=True):
            pass
        return (time.perf_counter() - t0) / n


def stage_import(cache: Path, module: str) -> float:
    """Seconds a fresh worker process takes to import a stage's module beyond what the task pool's
    timing already covered (a task stage's workers import it before their first unit), timed in a
    child process (cached)."""
    code = ("import time, pipeline.sizing.calibrate; t0 = time.perf_counter(); "  # what the pool's worker already imported
            f"import {module}; print(time.perf_counter() - t0)")
    return _cached(cache, "import", {"module": module}, lambda: {"import_s": float(_child(code))})["import_s"]
