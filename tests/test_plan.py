"""`pipeline plan` (pipeline/sizing/): container sizes against the real writers, the CLI's JSON and
its free-space warning (fast), and the plan against what `pipeline run all` writes (slow)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.sizing import artifacts as A

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("shape,dtype", [((196, 768), "float16"), ((5, 17, 512), "float16"), ((0, 4), "float32"),
                                         ((3,), "int64"), ((77, 77), "uint8"), ((5, 0, 2), "int32"), ((2,), "bool")])
def test_npy_bytes_equal_np_save(shape, dtype):
    buf = io.BytesIO()
    np.save(buf, np.zeros(shape, dtype))
    assert A.npy_bytes(shape, dtype) == len(buf.getvalue())


def test_tar_bytes_equal_the_shard_writer(tmp_path):
    """Per-sample members and the tar's end and record padding, against ShardWriter's real files."""
    from pipeline.io.wds import ShardWriter, sample_key

    rng = np.random.default_rng(0)
    for n_samples in (1, 7, 40):
        fields = {"a.npy": rng.standard_normal((16, 24)).astype(np.float16), "b.npy": np.zeros((3, 5, 2), np.int32),
                  "c.json": {"k": list(range(7))}}
        path = tmp_path / f"{n_samples}.tar"
        with ShardWriter(path) as w:
            for i in range(n_samples):
                w.write(sample_key(i), fields)
        per = A.sample_bytes([A.npy_bytes((16, 24), "float16"), A.npy_bytes((3, 5, 2), "int32"),
                              len(json.dumps(fields["c.json"], sort_keys=True, separators=(",", ":")))])
        assert A.tar_bytes(per, n_samples, shard_size=n_samples) == path.stat().st_size


CAPTIONS = ["A man riding a wave on top of a surfboard.", "Two dogs play with a red frisbee in the park.",
            "A kitchen with a stove, a sink and white cabinets.", "A plate of food with broccoli and rice."] * 20


def _plan(args, tmp_path, **kw):
    out = tmp_path / "out"
    (tmp_path / "captions.txt").write_text("\n".join(CAPTIONS))
    args = [a if a != "CAPTIONS" else str(tmp_path / "captions.txt") for a in args]
    res = CliRunner(**kw).invoke(app, ["plan", "--manifest", "manifests/tiny.yaml", "--set", f"output={out}", *args])
    return res


@pytest.fixture
def no_calibration(monkeypatch):
    """The CPU calibration is a ViT-B/16 forward and each stage's worker timed (seconds to a minute);
    these tests check the rest."""
    from pipeline.sizing import plan

    monkeypatch.setattr(plan, "calibrate", lambda spec, cache: {"model": "fixed", "flops": 1e9, "seconds": 0.1,
                                                                "flops_per_s": 1e10, "measured_at": "-"})
    monkeypatch.setattr(plan, "MEASURE", False)


def test_plan_json_schema(tmp_path, monkeypatch, no_calibration):
    monkeypatch.chdir(REPO)
    res = _plan(["--json", "--images", "118287", "--captions-per-image", "5", "--captions-sample", "CAPTIONS"], tmp_path)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["schema_version"] == 1
    assert plan["dataset"] == {"kind": "synthetic", "images": 118287, "captions": 591435, "source": "given",
                               "exact": False, "note": plan["dataset"]["note"]}
    assert set(plan["cluster"]) == {"cpus", "gpus", "source"}
    names = [s["stage"] for s in plan["stages"]]
    assert names[0] == "ingest" and "extract-clip-tokens" in names and len(names) == 9
    for s in plan["stages"]:
        assert set(s) >= {"stage", "artifact", "rows", "bytes", "total_bytes", "flops_per_image", "seconds_per_image",
                          "device", "workers", "wall_seconds", "time_basis", "exact_rows", "notes"}
        assert s["total_bytes"] == sum(s["bytes"].values()) > 0
    assert plan["total_bytes"] == sum(s["total_bytes"] for s in plan["stages"])
    clip = next(s for s in plan["stages"] if s["stage"] == "extract-clip-tokens")
    assert clip["rows"]["shards"] == 118287 and clip["rows"]["captions"] == 591435


def test_plan_sizes_published_models_without_local_folders(tmp_path, monkeypatch, no_calibration):
    """Every published configuration of the compatibility matrix (docs/compatibility.md) is sized from
    its published config or open_clip's own: no folder, no download."""
    from pipeline.sizing import shapes as S

    monkeypatch.chdir(REPO)
    models = {"clip": "open_clip:ViT-L-14", "groupvit": "nvidia/groupvit-gcc-yfcc", "sam": "vit_h:random",
              "mlm": "bert-base-uncased", "word_encoder": "bert-base-uncased"}
    sets = [x for k, v in models.items() for x in ("--set", f"models.{k}={v}")]
    res = _plan(["--json", "--images", "1000", "--captions-per-image", "5", "--captions-sample", "CAPTIONS", *sets], tmp_path)
    assert res.exit_code == 0, res.output
    stages = {s["stage"]: s for s in json.loads(res.stdout)["stages"]}
    assert stages["extract-clip-tokens"]["flops_per_image"] >= S.clip("openai/clip-vit-large-patch14")["flops_image"]
    assert stages["extract-image-groups"]["flops_per_image"] >= S.groupvit("nvidia/groupvit-gcc-yfcc")["flops_image"]


def test_plan_given_size_needs_sample_captions(tmp_path, monkeypatch, no_calibration):
    monkeypatch.chdir(REPO)
    res = _plan(["--images", "1000"], tmp_path)
    assert res.exit_code == 2 and "--captions-sample" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_plan_warns_when_the_output_disk_is_too_small(tmp_path, monkeypatch, no_calibration):
    from pipeline.sizing import plan

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(plan, "free_bytes", lambda output: 1000)
    res = _plan(["--images", "1000", "--captions-sample", "CAPTIONS"], tmp_path)
    assert res.exit_code == 0, res.output
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "would not fit" in warnings[0] and "1.0 kB free" in warnings[0]
    monkeypatch.setattr(plan, "free_bytes", lambda output: 10**15)
    res = _plan(["--images", "1000", "--captions-sample", "CAPTIONS"], tmp_path)
    assert not [line for line in res.stderr.splitlines() if line.startswith("warning:")]


def _on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.heavy
def test_plan_matches_what_pipeline_run_writes(tmp_path, monkeypatch, no_calibration):
    """The tiny manifest (63 good images of 64, every stage): rows exact where the plan says so,
    bytes within 10% in total and for each artifact over 5% of the total."""
    import subprocess
    import sys

    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    res = _plan(["--json"], tmp_path)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["dataset"]["images"] == 63 and plan["dataset"]["exact"]
    run = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "all", "--manifest", "manifests/tiny.yaml",
                          "--set", f"output={out}", "--no-report"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    total_real = 0
    for s in plan["stages"]:
        folder = out / s["artifact"]
        real = _on_disk(folder)
        total_real += real
        m = json.loads((folder / "_manifest.json").read_text())
        tables = {k: v["rows"] for k, v in m["tables"].items()}
        if s["exact_rows"]:
            for table, rows in s["rows"].items():
                assert tables[table] == rows, (s["artifact"], table, tables[table], rows)
        if real > 0.05 * plan["total_bytes"]:
            assert abs(s["total_bytes"] - real) <= 0.10 * real, (s["artifact"], s["total_bytes"], real)
    assert abs(plan["total_bytes"] - total_real) <= 0.10 * total_real, (plan["total_bytes"], total_real)


def test_makespan_is_a_pool_taking_units_in_order():
    """Against a brute-force event simulation of workers that each take the next unit when free."""
    import heapq
    import itertools

    from pipeline.sizing.walltime import makespan

    def simulate(units, workers):
        free = [(0, w) for w in range(workers)]
        loads = [0] * workers
        for u in units:
            t, w = heapq.heappop(free)
            loads[w] = t + u
            heapq.heappush(free, (t + u, w))
        return max(loads)

    rng = np.random.default_rng(0)
    for n, w in itertools.product((1, 2, 5, 9), (1, 2, 3)):
        units = rng.integers(1, 50, n).tolist()
        assert makespan(units, w) == simulate(units, w)
    assert makespan([2000, 1000], 2) == 2000 and makespan([5000, 5000, 5000, 5000], 2) == 10000 and makespan([], 2) == 0


def test_parquet_growth_predicts_a_larger_file_of_the_same_content():
    """A table of templated captions (as generated datasets have: repeats that dictionaries and zstd
    find more of in more rows): profiled on 1,000 and 2,000 rows, its Parquet bytes at 8,000 rows
    within 10%; and at 2,000 rows exactly the profiled file's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    nouns = ["dog", "cat", "man", "woman", "car", "tree", "ball", "red cup", "kite", "boat"]
    texts = [f"A {rng.choice(nouns)} {rng.choice(['next to', 'on', 'under', 'behind'])} a {rng.choice(nouns)}."
             for _ in range(8000)]
    table = pa.table({"caption_id": np.arange(8000), "sample_id": np.arange(8000) // 5, "text": texts,
                      "score": rng.random(8000).astype(np.float32)})

    def profile(n):
        buf = io.BytesIO()
        pq.write_table(table.slice(0, n), buf, compression="zstd")
        rows, data, dic = A.parquet_parts(pq.read_metadata(pa.BufferReader(buf.getvalue())))
        return rows, len(buf.getvalue()), data, dic

    g = A.parquet_growth(profile(1000), profile(2000))
    real = profile(8000)[1]
    assert abs(A.grown_bytes(g, 8000) - real) <= 0.10 * real, (A.grown_bytes(g, 8000), real)
    assert A.grown_bytes(g, 2000) == profile(2000)[1]


def test_vocabulary_extrapolated_from_a_caption_sample(tmp_path):
    """The concept miner's vocabulary on 4,000 generated records, estimated from their first
    1,000 (growth exponent fitted on the sample's quarter, half and whole), within 10% of the miner
    run on all 4,000; concept rows within 10% too."""
    from pipeline.concepts.mining import mine
    from pipeline.config import load_manifest
    from pipeline.readers import read_dataset
    from pipeline.sizing.dataset import DatasetSize, SampleRecord

    m = load_manifest(REPO / "manifests" / "tiny.yaml", overrides=[f"output={tmp_path}", "dataset.synthetic.n_images=4000"])
    recs = [SampleRecord([c for c in r.captions if c and c.strip()]) for r in read_dataset(m.dataset, tmp_path, defer_masks=True)]
    recs = [r for r in recs if r.captions][:4000]
    cfg = m.stages.mine_concepts
    texts = [c for r in recs for c in r.captions]
    concepts, vocab = mine([i for i, r in enumerate(recs) for _ in r.captions], texts, cfg.mining_params())
    size = DatasetSize(len(recs), len(texts), "test", exact=False, sample=recs[:256], text_sample=recs[:1000])
    est = A.mined_sample(size, cfg)
    assert not est["exact"] and 0 < est["heaps_exponent"] < 1
    assert abs(est["vocab"] - vocab.num_rows) <= 0.10 * vocab.num_rows, (est["vocab"], vocab.num_rows)
    rows = est["per_sample"] * len(recs)
    assert abs(rows - concepts.num_rows) <= 0.10 * concepts.num_rows, (rows, concepts.num_rows)


def test_calibrated_clip_seconds_per_image_agree_with_timing_the_worker(tmp_path, monkeypatch):
    """`pipeline plan`'s per-image cost of extract-clip-tokens (the stage's worker on the first
    records, best of two) against the same worker timed here on a unit of those records."""
    import time

    from pipeline.config import load_manifest
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.sizing import calibrate as C
    from pipeline.stages import extract_clip_tokens as st
    from pipeline.stages._image_units import image_units

    monkeypatch.setattr(C, "cold_load", lambda code: 0.0)  # a child process's imports: not what is checked here
    m = load_manifest(REPO / "manifests" / "tiny.yaml", overrides=[f"output={tmp_path}"])
    cfg = m.stages.extract_clip_tokens
    records = C.first_records(m, tmp_path, 48)
    cost = C.clip_tokens(tmp_path / "cache", "tiny-random", cfg, records)
    assert cost["items"] == 48 and cost["item"] == "image"
    assert C.clip_tokens(tmp_path / "cache", "tiny-random", cfg, records) == cost  # cached

    recs = C._unit_records(records, 48)
    worker = st.ClipTokenWorker("tiny-random", "cpu", 1, cfg.batch_size, cfg.text_batch_size, cfg.max_text_tokens,
                                cfg.project_tokens, cfg.token_precision)
    times = []
    for k in range(3):
        writer = ArtifactWriter(tmp_path / f"direct{k}", "clip_tokens", st.NAME, {})
        (name, unit_input, payload), = image_units(recs, len(recs))
        t0 = time.perf_counter()
        worker(dict(payload, artifact_dir=str(writer.dir), stage=st.NAME, unit=name, fingerprint=writer.unit_fingerprint(name, unit_input)))
        times.append((time.perf_counter() - t0) / len(recs))
    direct = sorted(times)[1]
    assert 0.5 <= cost["per_item_s"] / direct <= 2.0, (cost["per_item_s"], times)
