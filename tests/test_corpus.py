"""The encoders' generated pretraining corpus (manifest ``corpus:``, ``pipeline run ingest --corpus``): its own
folder and samples artifact, another generator seed and other image ids, and never a testbed image (by image id
and by the SHA-256 of the decoded pixels), checked on the real artifacts the stages write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ENCODERS = ("clip_encoder", "mlm_encoder", "groupvit_encoder")


def small_pixels(tmp_path: Path, n: int = 40) -> Path:
    m = yaml.safe_load((REPO / "manifests" / "pixels-gt.yaml").read_text())
    m["output"] = str(tmp_path / "pixels")
    m["ray"] = {"address": None, "num_cpus": 2, "object_store_memory": 134217728}
    m["dataset"]["synthetic"]["n_images"] = n
    m["corpus"]["n_images"] = n
    m["eval"] = {"benchmarks": []}
    path = tmp_path / "pixels-small.yaml"
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    return path


def test_pixels_encoders_read_the_corpus_not_the_testbed(tmp_path):
    from pipeline.config import corpus_manifest, load_manifest

    m = load_manifest(REPO / "manifests" / "pixels-gt.yaml", [f"output={tmp_path}/p"])
    assert m.corpus is not None and m.corpus.seed != m.dataset.synthetic.seed
    for key in ENCODERS:
        assert getattr(m.train, key).samples_artifact == "corpus/samples", key
    c = corpus_manifest(m)
    assert c.output == f"{tmp_path}/p/corpus" and c.dataset.synthetic.seed == m.corpus.seed
    assert c.dataset.synthetic.first_id > m.dataset.synthetic.n_images  # the ids cannot meet
    assert c.models.clip == m.models.clip  # the models still point at the run's encoders


def test_corpus_with_the_testbed_seed_is_refused_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "ingest", "--corpus", "-m", "manifests/pixels-gt.yaml",
                        "--set", f"output={tmp_path}/p", "--set", "corpus.seed=0"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == ("error: corpus.seed: 0 is dataset.synthetic.seed: the corpus would "
                                                  "repeat the testbed's scenes; give it another seed")
    assert not (tmp_path / "p" / "corpus").exists()


def test_first_id_moves_the_ids_not_the_scenes(tmp_path):
    import json

    from pipeline.synthetic.generate import generate

    a = generate(tmp_path / "a", n_images=3, seed=1)
    b = generate(tmp_path / "b", n_images=3, seed=1, first_id=500)
    ids_a = [im["id"] for im in json.loads(a["captions"].read_text())["images"]]
    ids_b = [im["id"] for im in json.loads(b["captions"].read_text())["images"]]
    assert ids_a == [1, 2, 3] and ids_b == [500, 501, 502]
    for i, j in zip(ids_a, ids_b):
        assert (a["images"] / f"{i:012d}.jpg").read_bytes() == (b["images"] / f"{j:012d}.jpg").read_bytes()


def test_the_corpus_shares_no_image_with_the_testbed(tmp_path, ray_session):
    from pipeline.config import corpus_manifest, load_manifest
    from pipeline.stage import RunContext, run_stage
    from train.encoders import images_in_common, load_corpus

    m = load_manifest(small_pixels(tmp_path), [])
    run_stage("ingest", RunContext(m))
    run_stage("ingest", RunContext(corpus_manifest(m)))
    out = Path(m.output)
    assert (out / "corpus" / "samples" / "_manifest.json").is_file()
    assert (out / "corpus" / "source" / "synthetic" / "images").is_dir()  # its own folder
    common = images_in_common(m, "samples", "corpus/samples")
    assert common["n"] == [40, 40]
    assert common["ids"] == [] and common["pixels"] == [], common
    # the check can fail: an artifact against itself shares every image, by id and by pixels
    same = images_in_common(m, "corpus/samples", "corpus/samples")
    assert len(same["ids"]) == len(same["pixels"]) == 40
    # what the encoder jobs load under the pixels manifest is the corpus, with its own held-out split
    corpus = load_corpus(m, getattr(m.train, "clip_encoder").samples_artifact, "clip-encoder")
    assert all(Path(p).parent.parent.parent.parent.name == "corpus" for p in corpus.images)
    assert set(corpus.splits) == {"train", "val", "test"}


def test_an_encoder_without_the_corpus_says_which_command_makes_it(tmp_path):
    from pipeline.config import load_manifest
    from train.encoders import load_corpus

    m = load_manifest(REPO / "manifests" / "pixels-gt.yaml", [f"output={tmp_path}/p"])
    with pytest.raises(FileNotFoundError) as e:
        load_corpus(m, "corpus/samples", "clip-encoder")
    assert str(e.value) == (f"clip-encoder: samples artifact {tmp_path}/p/corpus/samples is missing (no _manifest.json): "
                            "run `pipeline run ingest --corpus` (the manifest's pretraining corpus) first")


def test_corpus_shape_signal_reads_the_scenes_it_describes():
    """benchmarks/corpus_shape_signal.py (the diagnosis in docs/jobs/encoders.md): every shape and colour word a caption
    names is one of its scene's objects', the words single out an image more often together than either alone, and an
    object spans the same patches at 128 px / 16 px patches as at 64 / 8, twice as many at 128 / 8."""
    from benchmarks.corpus_shape_signal import shape_words, signal

    assert shape_words("Two red circles and a star, a circle.") == {"circle", "star"}
    s = signal(n_images=60, batch=16, batches=10)
    assert s["captions"] == 300 and s["captions_true"] == 1.0
    assert 0.5 < s["name_shape"] <= 1 and 0.5 < s["name_colour"] <= 1
    assert s["unique_by_both"] >= max(s["unique_by_shape"], s["unique_by_colour"])
    d = s["diameter_patches"]
    assert d["128/16"][0] == pytest.approx(d["64/8"][0]) and d["128/8"][0] == pytest.approx(2 * d["64/8"][0])


def test_twins_differ_only_in_their_shapes(tmp_path):
    """``corpus.twins`` 2 (issue 45): images 2g and 2g+1 share background, colours, sizes and textures, object by
    object, every shape differs, the pair is in one split; member 0 is the scene a corpus without twins draws for
    index g, and ``twins`` is recorded in _params.json (a dataset generated before the option is unchanged)."""
    import json

    from pipeline.synthetic.generate import generate

    tw = generate(tmp_path / "tw", n_images=40, seed=1, twins=2, heldout=0.2)  # groups 16-19 held out
    one = generate(tmp_path / "one", n_images=20, seed=1, heldout=0.2)
    assert json.loads(tw["params"].read_text())["params"]["twins"] == 2
    assert "twins" not in json.loads(one["params"].read_text())["params"]

    def objects(paths):
        inst = json.loads(paths["instances"].read_text())
        cat = {c["id"]: c["name"] for c in inst["categories"]}
        out = {}
        for a in sorted(inst["annotations"], key=lambda a: a["id"]):
            at = a["attributes"]
            out.setdefault(a["image_id"], []).append((cat[a["category_id"]], at["color"], at["size"], at["texture"]))
        return out

    obj_tw, obj_one = objects(tw), objects(one)
    split = {im["id"]: im["split"] for im in json.loads(tw["captions"].read_text())["images"]}
    same_count = 0
    for g in range(20):
        a, b = obj_tw[2 * g + 1], obj_tw[2 * g + 2]
        assert a == obj_one[g + 1]  # member 0: the scene of index g without twins
        assert split[2 * g + 1] == split[2 * g + 2]
        if [o[1:] for o in a] == [o[1:] for o in b]:  # colour, size, texture, object by object
            same_count += 1
            assert all(x[0] != y[0] for x, y in zip(a, b))  # every shape another
    assert same_count >= 16  # a new outline may not fit where the old one did: the draws after it move on
    assert set(split.values()) == {"train", "val", "test"}
