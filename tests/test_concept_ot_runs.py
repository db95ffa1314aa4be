"""Runs that cannot be confused, and concept-ot's data options: the default run folder per
(job, variant, training options), refusal to resume another configuration's checkpoint (config.json
untouched), --fresh; per-variant epoch defaults, epochs over caption pairs, the seeded train
subset; 'no eval images' as a one-line error; manifests/coco.yaml evaluates the Karpathy test split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.testbed_reduced import copy_testbed

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["train.concept_ot.batch_size=16", "train.concept_ot.d_c=16", "train.concept_ot.rank=8",
         "train.concept_ot.eval_splits=[test]", "train.concept_ot.eval_max_images=8", "train.concept_ot.heatmaps=0",
         "train.concept_ot.sugarcrepe_dirs=[]", "train.concept_ot.max_steps=2", "train.concept_ot.threads=1"]


@pytest.fixture(scope="module")
def oracle(small_testbed, tmp_path_factory):
    """This module's copy of the small oracle testbed (tests/conftest.py: samples, clip_tokens and
    the build-index `index` of 100 generated images through the real stages; 2 captions each)."""
    return copy_testbed(small_testbed, tmp_path_factory.mktemp("cot_runs"))[0]


def _job(out, **over):
    from pipeline.config import load_manifest
    from train.jobs.concept_ot import make_job

    m = load_manifest(None, [f"output={out}", *SMALL, *[f"train.concept_ot.{k}={v}" for k, v in over.items()]])
    return make_job(m.train.concept_ot, m, out / "train" / "x", torch.device("cpu"))


def _cli(out, tmp_path, *sets, fresh=False):
    from typer.testing import CliRunner

    from train.cli import app

    man = tmp_path / "m.yaml"
    man.write_text("name: t\n")
    args = ["run", "concept-ot", "--manifest", str(man), "--no-progress", "--json", "--set", f"output={out}",
            "--set", "train.concept_ot.benchmarks_at_end=false"]  # (evaluation-only: no effect on the folder)
    for s in (*SMALL, *sets):
        args += ["--set", s]
    return CliRunner().invoke(app, args + (["--fresh"] if fresh else []))


@pytest.mark.slow
def test_run_folders_per_configuration_and_refused_resume(oracle, tmp_path):
    base = oracle / "train" / "concept-ot"
    r = _cli(oracle, tmp_path)
    assert r.exit_code == 0, r.output
    a = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    # the folder names the options that differ from the defaults, then their hash
    assert a.parent == base and a.name.startswith("conceptot-") and len(a.name.rsplit("-", 1)[1]) == 6, a.name
    # the README's variant command: its own folder, trains (no 'Unexpected key anchors')
    r = _cli(oracle, tmp_path, "train.concept_ot.variant=dense-uot")
    assert r.exit_code == 0, r.output
    b = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    assert b.parent == base and b.name.startswith("dense-uot-") and b != a
    assert json.loads((b / "config.json").read_text())["variant"] == "dense-uot"
    # same configuration again: resumes the finished run in the same folder
    r = _cli(oracle, tmp_path)
    assert r.exit_code == 0 and Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"]) == a
    # another configuration forced into a's folder: refused in one line, nothing rewritten
    before = (a / "config.json").read_text()
    r = _cli(oracle, tmp_path, "train.concept_ot.variant=filip", f"train.concept_ot.run_dir={a}")
    assert r.exit_code == 2
    err = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "variant=conceptot" in err[0] and "variant=filip" in err[0]
    assert "--fresh" in err[0] and "run_dir" in err[0] and str(a) in err[0]
    assert (a / "config.json").read_text() == before
    # --fresh starts over in it
    r = _cli(oracle, tmp_path, "train.concept_ot.variant=filip", f"train.concept_ot.run_dir={a}", fresh=True)
    assert r.exit_code == 0, r.output
    assert json.loads((a / "config.json").read_text())["variant"] == "filip"


@pytest.mark.slow
def test_index_mode_after_a_batch_run_trains_in_its_own_folder(oracle, tmp_path):
    assert (oracle / "index" / "_manifest.json").is_file()  # build-index's, from the fixture
    r = _cli(oracle, tmp_path, "train.concept_ot.variant=filip")
    assert r.exit_code == 0, r.output
    batch_dir = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    r = _cli(oracle, tmp_path, "train.concept_ot.variant=filip", "train.concept_ot.hard_negatives=index",
             "train.concept_ot.log_every=1")
    assert r.exit_code == 0, r.output
    idx_dir = Path(json.loads(r.stdout.strip().splitlines()[-1])["run_dir"])
    assert idx_dir != batch_dir
    rows = [json.loads(x) for x in (idx_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if x["kind"] == "train"] == [1, 2]  # trained, not a re-print
    assert "seed_batch_share" in rows[0]
    assert json.loads((batch_dir / "config.json").read_text())["hard_negatives"] == "batch"


def test_run_tag_and_config_differences():
    from train.config import config_differences
    from train.jobs.concept_ot import Config

    assert Config().run_tag() == "conceptot" and Config(variant="filip").run_tag() == "filip"
    assert Config(eval_max_images=3, device="cpu", threads=1).run_tag() == "conceptot"
    t = Config(hard_negatives="index").run_tag()
    assert t.startswith("conceptot-") and t == Config(hard_negatives="index").run_tag() != Config(lr=1e-3).run_tag()
    # epochs at the variant's own default is not a difference
    assert Config(variant="filip", epochs=8).run_tag() == "filip" and Config(variant="conceptot", epochs=8).run_tag() != "conceptot"
    stored = Config().model_dump(mode="json")
    assert config_differences(stored, Config(heatmaps=0)) == {}
    assert config_differences(stored, Config(rank=8)) == {"rank": (32, 8)}
    del stored["train_subset"]  # an option added since the checkpoint, at its default: no difference
    assert config_differences(stored, Config()) == {}


def test_per_variant_epoch_defaults():
    from train.jobs.concept_ot import Config

    want = {"conceptot": 3, "dense-uot": 3, "balanced-ot": 3, "filip": 8, "text-attn": 8, "global-patch": 8}
    for v, e in want.items():
        assert Config(variant=v).epochs == e
        assert Config(variant=v, epochs=1.5).epochs == 1.5


def test_epoch_over_caption_pairs(oracle):
    img = _job(oracle, max_steps="null", batch_size=8)
    cap = _job(oracle, max_steps="null", batch_size=8, epoch_unit="captions")
    n_train = len(cap.train_sample_ids())
    assert img.batches_per_epoch() == n_train // 8 and cap.batches_per_epoch() == 2 * (n_train // 8)
    batches = list(cap.batches(1, 0))
    assert len(batches) == cap.batches_per_epoch()
    pairs = [(int(s), int(c)) for b in batches for s, c in zip(b["sample_id"], b["caption_id"])]
    # every (image, caption) pair once per epoch (2 captions per image = 2 passes), up to the images
    # each pass's drop_last leaves out
    assert len(pairs) == len(set(pairs)) == 2 * (n_train // 8) * 8
    per_img = {}
    for s, c in pairs:
        per_img.setdefault(s, set()).add(c)
    assert sum(len(v) == 2 for v in per_img.values()) >= n_train - 2 * (n_train % 8)
    # resume inside the second pass: the same batches
    tail = list(cap.batches(1, len(batches) - 3))
    assert len(tail) == 3 and all(torch.equal(x["caption_id"], y["caption_id"]) for x, y in zip(tail, batches[-3:]))
    assert [b["caption_id"].tolist() for b in cap.batches(2, 0)] != [b["caption_id"].tolist() for b in batches]


def test_train_subset_is_seeded_and_deterministic(oracle):
    full = _job(oracle).train_sample_ids()
    a = _job(oracle, train_subset=20).train_sample_ids()
    assert len(a) == 20 and set(a) <= set(full)
    assert np.array_equal(a, _job(oracle, train_subset=20, seed=5).train_sample_ids())  # not the training seed
    assert not np.array_equal(a, _job(oracle, train_subset=20, train_subset_seed=1).train_sample_ids())
    j = _job(oracle, train_subset=20)
    assert j.batches_per_epoch() == 1  # 20 images, batches of 16
    seen = {int(s) for b in j.batches(0, 0) for s in b["sample_id"]}
    assert seen <= set(a.tolist())
    assert np.array_equal(_job(oracle, train_subset=10**6).train_sample_ids(), full)


def test_no_eval_images_is_a_one_line_error(oracle, tmp_path):
    r = _cli(oracle, tmp_path, "train.concept_ot.eval_splits=[restval]")  # the generated dataset has none
    assert r.exit_code == 2
    err = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "no eval images" in err[0] and "Karpathy" in err[0] and "eval_splits" in err[0]
    assert "dataset.splits: {val: 0.05, test: 0.05}" in err[0]


def test_coco_manifest_evaluates_the_karpathy_test_split():
    from pipeline.config import load_manifest

    m = load_manifest(REPO / "manifests" / "coco.yaml", [])
    assert m.dataset.kind == "karpathy" and m.dataset.split is None  # every split, restval counts as train
    c = m.train.concept_ot
    assert c.eval_splits == ["test"] and c.eval_max_images >= 5000 and c.train_splits == ["train", "restval"]
    assert c.train_subset == 20000
    bench = {b.name: b for b in m.eval.benchmarks}
    assert any(b.format in ("retrieval", "split_retrieval") and (b.split or "test") == "test" for b in bench.values())
    assert any(b.format == "sugarcrepe" for b in bench.values())


def test_run_tag_names_the_options_that_differ():
    from train.jobs.concept_ot import Config

    t = Config(lr=3e-5, batch_size=32).run_tag()
    assert t.startswith("conceptot-batch_size32-lr3e-5-") and len(t.rsplit("-", 1)[1]) == 6, t
    assert Config(hard_negatives="index").run_tag().startswith("conceptot-hard_negatives_index-")
    long = Config(lr=3e-5, batch_size=32, weight_decay=0.5, warmup_frac=0.3, min_lr_frac=0.2, seed=7).run_tag()
    words = long[len("conceptot-"):].rsplit("-", 1)[0]
    assert len(words) <= 48 and long != Config(lr=3e-5, batch_size=32, weight_decay=0.5, warmup_frac=0.3,
                                                min_lr_frac=0.2, seed=8).run_tag()


def test_run_tag_cuts_at_whole_option_words():
    """A run folder's name keeps whole option words within its 48 characters: the demo's c3 run was
    `default-batch_size16-d_model64-dropout0-epoch_unit_conce-c2b5e8`."""
    from pipeline.config import load_manifest
    from train.config import _fit_words, _option_word

    cfg = load_manifest(REPO / "manifests" / "demo.yaml", []).train.c3
    assert cfg.run_tag() == "default-batch_size16-d_model64-dropout0-c2b5e8"  # the hash: the same options
    for job in ("c3", "concept_ot", "infoground", "visual_tokens", "relation_head", "text_groups"):
        c = getattr(load_manifest(REPO / "manifests" / "demo.yaml", []).train, job)
        named = {k: getattr(c, k) for k in c.NAMED if k in type(c).model_fields}
        base = c.default_training_config(named)
        every = [_option_word(k, v) for k, v in sorted(c.training_config().items()) if k not in named and base.get(k) != v]
        words = c.run_tag()[len("-".join(map(str, named.values())) or "default") + 1:].rsplit("-", 1)[0]
        k = next(k for k in range(1, len(every) + 1) if "-".join(every[:k]) == words)  # whole words, in order
        assert len(words) <= 48 and (k == len(every) or len("-".join(every[:k + 1])) > 48), (job, words, every)
    assert _fit_words(["a" * 10, "b" * 40], 48) == "a" * 10  # the second would pass 48: left out whole
    assert _fit_words(["epoch_unit_concept_rows_and_more_words_than_fit_in_48"], 20) == "epoch_unit_concept"
    assert _fit_words(["x" * 60], 48) == "x" * 48
