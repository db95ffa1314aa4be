"""train.loop model selection: checkpoints/best.pt holds the model of the evaluation with the best
``best_metric`` (max or min), survives an interruption and resume, and is absent when off."""

from __future__ import annotations

import json

import pytest
import torch

from train.config import TrainerConfig
from train.job import Job
from train.loop import load_checkpoint, train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):  # the figure is not what is tested here, and costs most of the time
    import train.loop

    monkeypatch.setattr(train.loop, "plot_metrics", lambda *a, **k: None)


class _Toy(Job):
    """One scalar parameter w; evaluate() reports a scripted score per evaluation (by step)."""

    SCORES = {2: 0.6, 4: 0.9, 6: 0.3, 8: 0.7}

    def build_model(self):
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(torch.zeros(()))
        return m

    def batches_per_epoch(self):
        return 4

    def batches(self, epoch, start):
        return [{"x": torch.ones(1)} for _ in range(start, 4)]

    def loss(self, model, batch):
        return (model.w - 1.0) ** 2 * batch["x"].sum(), {}

    def evaluate(self, model, out_dir):
        step = int(self._step(model))
        return {"score": self.SCORES.get(step, 0.0), "w": float(model.w)}

    def _step(self, model):
        # the toy moves w by a fixed amount per step: recover the step from the metrics file instead
        p = self.run_dir / "metrics.jsonl"
        rows = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
        return max([r["step"] for r in rows if r["kind"] == "train"], default=0)


def _cfg(**kw):
    base = dict(epochs=2, batch_size=2, lr=0.1, weight_decay=0.0, warmup_frac=0.0, min_lr_frac=1.0, grad_clip=None,
                amp="off", eval_every=2, log_every=1, ckpt_every=100, threads=1)
    if "benchmarks_at_end" in TrainerConfig.model_fields:  # the toy has no manifest to score benchmarks of
        base["benchmarks_at_end"] = False
    return TrainerConfig(**{**base, **kw})


@pytest.mark.parametrize("mode,expect", [("max", 4), ("min", 6)])
def test_best_checkpoint_is_the_best_evaluation(tmp_path, mode, expect):
    job = _Toy(_cfg(best_metric="score", best_mode=mode), None, tmp_path / mode, torch.device("cpu"))
    train(job, resume=False, progress=False)
    best = load_checkpoint(tmp_path / mode / "checkpoints" / "best.pt")
    # evaluations at steps 2 (0.6), 4 (0.9), 6 (0.3) and the final one at 8 (0.7): max -> step 4, min -> step 6
    assert best["step"] == expect and best["best"]["value"] == _Toy.SCORES[expect]
    rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    assert abs(float(best["model"]["w"]) - evals[expect]["w"]) < 1e-7  # the weights of that evaluation
    assert [r["step"] for r in rows if r["kind"] == "best"] == ([2, 4] if mode == "max" else [2, 6])


def test_best_survives_resume_and_off_by_default(tmp_path):
    job = _Toy(_cfg(best_metric="score"), None, tmp_path / "r", torch.device("cpu"))
    train(job, resume=False, progress=False, stop_after=5)  # evaluations at 2 (0.6) and 4 (0.9)
    assert load_checkpoint(tmp_path / "r" / "checkpoints" / "last.pt")["best"]["value"] == 0.9
    job = _Toy(_cfg(best_metric="score"), None, tmp_path / "r", torch.device("cpu"))
    train(job, resume=True, progress=False)  # 6 (0.3) and 8 (0.7) must not replace it
    assert load_checkpoint(tmp_path / "r" / "checkpoints" / "best.pt")["step"] == 4
    job = _Toy(_cfg(), None, tmp_path / "off", torch.device("cpu"))
    train(job, resume=False, progress=False)
    assert not (tmp_path / "off" / "checkpoints" / "best.pt").exists()


def test_a_finished_run_says_why_it_trains_nothing(tmp_path, capsys):
    job = _Toy(_cfg(), None, tmp_path / "f", torch.device("cpu"))
    train(job, resume=False, progress=False)
    capsys.readouterr()
    job = _Toy(_cfg(eval_every=1), None, tmp_path / "f", torch.device("cpu"))  # evaluation settings changed
    train(job, resume=True, progress=False)
    err = capsys.readouterr().err
    assert "already trained 8 of 8 steps: nothing to train" in err and "--fresh" in err, err
    rows = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r["kind"] == "train") == 8  # nothing trained twice
    # the final model evaluated again: its line replaces the earlier run's, so each (kind, step) is once (issue 40)
    assert [r["step"] for r in rows if r["kind"] == "eval"][-2:] == [6, 8]
    assert "dropped 1 line(s): 1 at or past the checkpoint's step 8 (step 8)" in err
