"""Checkpoints are tensors + plain data, loaded with weights_only=True (issue 18): a checkpoint
carrying a pickled object is refused with a one-line error naming the file, never executed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pipeline.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint_file

RAN = []


class Payload:
    """An arbitrary object: unpickling it with weights_only=False would call __reduce__'s callable."""

    def __reduce__(self):
        return (RAN.append, ("code ran",))


def test_pickled_object_is_refused_and_not_run(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "config": {}, "extra": Payload()}, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {path}: refused: it holds pickled Python objects") and "\n" not in msg
    assert RAN == []
    from pipeline.models.relations import load_relation_checkpoint

    with pytest.raises(CheckpointError, match="refused"):
        load_relation_checkpoint(path)
    from train.loop import load_checkpoint as train_load

    with pytest.raises(CheckpointError, match="refused"):
        train_load(path)
    assert RAN == []


def test_training_checkpoint_with_rng_state_round_trips_weights_only(tmp_path):
    from train.loop import _rng_state, _set_rng_state, save_checkpoint

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    st = _rng_state()
    a = (random.random(), np.random.random(), torch.rand(1).item())
    save_checkpoint(tmp_path / "last.pt", {"model": {"w": torch.ones(3)}, "rng": st, "best": {"acc": np.float64(0.5)}, "step": np.int64(7)})
    ck = load_checkpoint(tmp_path / "last.pt")  # weights_only=True
    assert ck["best"]["acc"] == 0.5 and ck["step"] == 7 and isinstance(ck["step"], int)
    _set_rng_state(ck["rng"])
    assert (random.random(), np.random.random(), torch.rand(1).item()) == a


def test_relation_head_export_loads_weights_only(tmp_path):
    from pipeline.models.relations import build_relation_head, load_relation_checkpoint

    cfg = dict(in_dim=8, width=16, layers=1, heads=2, cls_dim=4, n_predicates=3)
    model = build_relation_head(**cfg)
    save_checkpoint_file(tmp_path / "relation_head.pt", {
        "state_dict": {k: v.detach() for k, v in model.state_dict().items()}, "config": cfg,
        "predicates": ["on", "in", "near"], "metrics": {"r@50": np.float32(12.5)}, "provenance": {"x": None},
    })
    m2, ck = load_relation_checkpoint(tmp_path / "relation_head.pt")
    assert ck["metrics"]["r@50"] == 12.5 and ck["predicates"] == ["on", "in", "near"]
    for k, v in model.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v)
    with pytest.raises(CheckpointError, match="file not found"):
        load_checkpoint(tmp_path / "nope.pt")
