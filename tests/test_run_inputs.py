"""A run folder is tied to the artifacts it was trained on: every checkpoint records the fingerprint of each
artifact the job's ``*artifact`` options name (train.job.Job.input_fingerprints), and a resume, or the re-evaluation
of a finished run, on an artifact a stage has since rewritten is refused in one line naming the option and the way
out (train/run_folder.py). Before this a finished run re-evaluated its old model on the new artifact without a word
(issue 46: relation-encoder scored 38.0 on CLIP-pooled tokens with the weights trained on SAM's)."""

from __future__ import annotations

import pytest
import torch

from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest

SETS = ["dataset.synthetic.n_images=24", "dataset.synthetic.corrupt_images=0", "train.relation_head.epochs=1",
        "train.relation_head.width=16", "train.relation_head.heads=2", "train.relation_head.cls_dim=4",
        "train.relation_head.recall_k=[5]", "train.relation_head.boxes_only_steps=0"]


def test_a_run_is_not_resumed_on_a_rewritten_artifact(tmp_path, ray_session):
    from pipeline.io.artifacts import Artifact
    from pipeline.io.checkpoint import load_checkpoint, save_checkpoint_file
    from train.jobs.relation_head import make_job
    from train.loop import train
    from train.run_folder import RunMismatch

    m = make_manifest(tmp_path, SETS)
    run_stage("ingest", RunContext(m))
    run_stage("extract-visual-tokens", RunContext(m))
    run = tmp_path / "rh"
    job = make_job(m.train.relation_head, m, run, torch.device("cpu"))
    train(job, resume=False, progress=False)
    last = run / "checkpoints" / "last.pt"
    inputs = load_checkpoint(last)["inputs"]
    assert inputs == {"artifact": Artifact(f"{m.output}/visual_tokens").manifest["fingerprint"],
                      "samples_artifact": Artifact(f"{m.output}/samples").manifest["fingerprint"]}
    # the same artifacts: the finished run resumes (and only re-evaluates)
    train(make_job(m.train.relation_head, m, run, torch.device("cpu")), resume=True, progress=False)
    # a stage option changes the tokens: the artifact is rewritten with another fingerprint
    m2 = make_manifest(tmp_path, SETS + ["stages.extract_visual_tokens.seed=1"])
    run_stage("extract-visual-tokens", RunContext(m2))
    new = Artifact(f"{m2.output}/visual_tokens").manifest["fingerprint"]
    assert new != inputs["artifact"]
    with pytest.raises(RunMismatch, match=r"rewritten since \(artifact 'visual_tokens' fingerprint "
                       rf"{inputs['artifact'][:12]} -> {new[:12]}\): pass .*--fresh"):
        train(make_job(m2.train.relation_head, m2, run, torch.device("cpu")), resume=True, progress=False)
    # --fresh (resume=False) trains on the new artifact and records it
    train(make_job(m2.train.relation_head, m2, run, torch.device("cpu")), resume=False, progress=False)
    assert load_checkpoint(last)["inputs"]["artifact"] == new
    # a checkpoint from before the record (no "inputs"): resumed, not checked
    ck = load_checkpoint(last)
    del ck["inputs"]
    save_checkpoint_file(last, ck)
    train(make_job(m.train.relation_head, m, run, torch.device("cpu")), resume=True, progress=False)
