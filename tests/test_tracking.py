"""Experiment tracking (train/tracking.py): every run folder has TensorBoard event files with the
losses, the learning rate and every evaluation metric beside its chance level, read back here with
the TFRecord framing and tensorboardX's own Event protos (no TensorBoard needed); ``logger: mlflow``
(a local file store) and ``logger: wandb`` (offline) carry the same numbers, read back through
their own clients; they skip where the extra is not installed."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.ddp_toy import ToyConfig, ToyJob

pytestmark = pytest.mark.usefixtures("one_thread")


class _ScoredToy(ToyJob):
    """The toy regression with an accuracy-like metric and its chance level, as the jobs report them."""

    def evaluate(self, model, out_dir):
        res = super().evaluate(model, out_dir)
        return {**res, "val_acc": 1.0 / (1.0 + res["mse"]), "val_acc_chance": 0.25, "chance/i2t_R@1": 0.1,
                "global/i2t_R@1": 0.5}


def _run(tmp: Path, **over) -> Path:
    from train.loop import train

    run = tmp / "run"
    cfg = ToyConfig(max_steps=6, log_every=1, eval_every=3, threads=1, lr=1e-2, amp="off", benchmarks_at_end=False,
                    run_dir=str(run), batch_size=16, **over)
    train(_ScoredToy(cfg, None, run, torch.device("cpu")), resume=False, progress=False)
    return run


def read_events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every TensorBoard event file under ``folder`` (TFRecord
    framing: length, its CRC, the Event proto, its CRC)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(folder.rglob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_run_writes_tensorboard_events_with_losses_lr_and_metrics_beside_chance(tmp_path):
    run = _run(tmp_path)
    ev = read_events(run / "tensorboard")
    rows = _metrics(run)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [s for s, _ in ev["train/loss"]] == [r["step"] for r in train_rows]
    assert [v for _, v in ev["train/loss"]] == pytest.approx([r["loss"] for r in train_rows], rel=1e-6)
    assert [v for _, v in ev["train/lr"]] == pytest.approx([r["lr"] for r in train_rows], rel=1e-6)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(evals) == 2 and [s for s, _ in ev["eval/val_acc"]] == [3, 6]
    assert [v for _, v in ev["eval/val_acc"]] == pytest.approx([r["val_acc"] for r in evals], rel=1e-6)
    assert [v for _, v in ev["eval_chance/val_acc"]] == pytest.approx([0.25, 0.25])  # the metric's chance, by name
    assert [v for _, v in ev["eval_chance/global/i2t_R_1"]] == pytest.approx([0.1, 0.1])  # TensorBoard spells @ as _
    assert "eval_chance/mse" not in ev  # a metric without a chance level gets none


def test_the_final_harness_table_is_added_with_its_chance(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train.tracking import final_scalars

    (tmp_path / "eval" / "final").mkdir(parents=True)
    pq.write_table(pa.table({"benchmark": ["sugarcrepe", "aro"], "subset": ["swap_att", ""],
                             "metric": ["accuracy", "macro_accuracy"], "value": [61.0, 55.5],
                             "chance": [50.0, None]}), tmp_path / "eval" / "final" / "results.parquet")
    assert final_scalars(tmp_path) == {"final/sugarcrepe/swap_att/accuracy": 61.0,
                                       "final_chance/sugarcrepe/swap_att/accuracy": 50.0,
                                       "final/aro/macro_accuracy": 55.5}


def test_a_resumed_run_continues_its_event_files_without_repeating_steps(tmp_path):
    from train.loop import train

    run = tmp_path / "run"
    cfg = ToyConfig(max_steps=6, log_every=1, ckpt_every=2, threads=1, lr=1e-2, amp="off", benchmarks_at_end=False,
                    run_dir=str(run), batch_size=16)
    train(ToyJob(cfg, None, run, torch.device("cpu")), resume=False, progress=False, stop_after=3)
    train(ToyJob(cfg, None, run, torch.device("cpu")), resume=True, progress=False)
    losses = [r["loss"] for r in _metrics(run) if r["kind"] == "train"]
    ev = read_events(run / "tensorboard")["train/loss"]
    # step 3 was logged, then the resume from last.pt (step 2) logged it again: TensorBoard's purge_step
    # hides the first one; the raw records hold both, the last of each step is the run's
    last = {s: v for s, v in ev}
    assert sorted(last) == list(range(1, 7)) and [last[s] for s in range(1, 7)] == pytest.approx(losses, rel=1e-6)


def test_a_resume_within_the_same_second_keeps_the_first_event_file(tmp_path, monkeypatch):
    """tensorboardX names an event file by the second and the host only: two writers of one second
    (a stop and its resume) must not share a file."""
    import tensorboardX.event_file_writer as efw

    monkeypatch.setattr(efw, "time", SimpleNamespace(time=lambda: 1795772927.5))  # every file opens in one second
    test_a_resumed_run_continues_its_event_files_without_repeating_steps(tmp_path)


def test_mlflow_logger_writes_the_run_to_a_local_file_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = _run(tmp_path, logger="mlflow")
    from train.tracking import mlflow_store

    store = mlflow_store(run)
    assert store == run / "mlruns" and store.is_dir()
    client = mlflow.tracking.MlflowClient(tracking_uri=store.resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "toy"]
    (r,) = client.search_runs([exp.experiment_id])
    hist = client.get_metric_history(r.info.run_id, "train/loss")
    rows = [x for x in _metrics(run) if x["kind"] == "train"]
    assert [h.step for h in hist] == [x["step"] for x in rows]
    assert [h.value for h in hist] == pytest.approx([x["loss"] for x in rows], rel=1e-6)
    assert [h.value for h in client.get_metric_history(r.info.run_id, "eval_chance/global/i2t_R_at_1")] == [0.1, 0.1]
    assert r.data.params["lr"] == "0.01" and r.info.status == "FINISHED"


def read_wandb_history(path: Path) -> dict[int, dict]:
    """{step: {key: value}} from an offline W&B run file (``run-*.wandb``: a 7-byte header, then
    32 KiB blocks of records: CRC, length, type (full / first / middle / last), a Record proto)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, i, block, buf, out = path.read_bytes(), 7, 32768, b"", {}
    while i + 7 <= len(data):
        left = block - i % block
        _, n, kind = struct.unpack("<IHB", data[i:i + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (n == 0 and kind == 0):  # block trailer / padding
            i += left
            continue
        buf, i = buf + data[i + 7:i + 7 + n], i + 7 + n
        if kind in (1, 4):
            rec, buf = pb.Record.FromString(buf), b""
            if rec.HasField("history"):
                row = {"/".join(it.nested_key) or it.key: json.loads(it.value_json) for it in rec.history.item}
                out.setdefault(int(row["_step"]), {}).update(row)
    return out


def test_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path, logger="wandb")
    (offline,) = list((run / "wandb").glob("offline-run-*"))
    (log,) = list(offline.glob("run-*.wandb"))
    rows = [x for x in _metrics(run) if x["kind"] == "train"]
    for _ in range(60):  # W&B's service process may still be writing the file when finish() returns
        hist = read_wandb_history(log)
        if all(x["step"] in hist for x in rows):
            break
        time.sleep(0.5)
    assert [hist[x["step"]]["train/loss"] for x in rows] == pytest.approx([x["loss"] for x in rows], rel=1e-6)
    assert [hist[s]["eval_chance/val_acc"] for s in (3, 6)] == pytest.approx([0.25, 0.25])
