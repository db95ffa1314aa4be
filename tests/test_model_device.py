"""Every model stage takes the same `device` (auto = CUDA when the actor was given a GPU) and
`precision` options: negative-captions (MLM + word encoder) and mine-concepts' text encoder
included. The option reaches the model (CPU here; the CUDA path is checked where a GPU exists)."""

from __future__ import annotations

import pytest
import torch

from pipeline.models import device as D
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest
from tests.test_negative_captions_stage import OV, write_samples

CUDA = torch.cuda.is_available()


def test_resolve_device(monkeypatch):
    assert D.resolve_device("cpu") == "cpu"
    monkeypatch.setattr(D, "_actor_has_gpu", lambda: False)
    assert D.resolve_device("auto") == "cpu"  # no GPU given to this process
    monkeypatch.setattr(D, "_actor_has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert D.resolve_device("auto") == "cuda"  # Ray gave the actor a GPU (num_gpus > 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="device 'cuda:0': CUDA is not available"):
        D.resolve_device("cuda:0")


def test_precision_rules():
    assert D.effective_precision("auto", "auto", 0) == "fp32"
    assert D.effective_precision("auto", "auto", 1) == "fp16"
    assert D.effective_precision("cuda", "auto") == "fp16"
    assert D.effective_precision("cpu", "bf16") == "bf16"
    # CPU fp32 keeps the fingerprints of runs made before the option existed
    assert D.fingerprinted({"a": 1, "device": "cpu", "precision": "auto"}, "cpu", "auto") == {"a": 1}
    assert D.fingerprinted({"a": 1, "device": "auto", "precision": "auto"}, "auto", "auto", 1) == {"a": 1, "precision": "fp16"}
    with D.autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with D.autocast("cpu", "bf16"):
        assert torch.is_autocast_enabled("cpu")


def _capture(monkeypatch):
    """map_units that records how the actor pool was asked for, then stops the stage."""
    seen = {}

    class Stop(Exception):
        pass

    def fake(units, fn, *, ray_cfg=None, actor=False, constructor_kwargs=None, num_gpus=0, **kw):
        if not actor:  # a task pool (noun vocabulary counts): nothing to see
            return iter(())
        seen.update(cls=fn, kwargs=constructor_kwargs, num_gpus=num_gpus)
        raise Stop

    import pipeline.runtime
    import pipeline.stage

    monkeypatch.setattr(pipeline.stage, "map_units", fake)
    monkeypatch.setattr(pipeline.runtime, "map_units", fake)
    return seen, Stop


def test_negative_captions_device_reaches_the_actor_pool_and_the_models(tmp_path, monkeypatch):
    seen, Stop = _capture(monkeypatch)
    m = make_manifest(tmp_path, OV + ["stages.negative_captions.device=auto", "stages.negative_captions.num_gpus=1",
                                      "stages.negative_captions.precision=auto"])
    write_samples(m.output)
    with pytest.raises(Stop):
        run_stage("negative-captions", RunContext(m))
    assert seen["num_gpus"] == 1  # the pool asks Ray for one GPU per actor ...
    assert seen["kwargs"]["device"] == "auto" and seen["kwargs"]["precision"] == "auto"  # ... and the actor picks CUDA
    # the worker puts both models where the option says
    kw = dict(seen["kwargs"], device="cpu", torch_threads=1)
    w = seen["cls"](**kw)
    assert w.device == "cpu"
    assert next(w.mlm.model.parameters()).device.type == "cpu"
    assert w.we is None or next(w.we.model.parameters()).device.type == "cpu"
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            seen["cls"](**dict(kw, device="cuda"))


def test_mine_concepts_text_encoder_device(tmp_path, monkeypatch):
    seen, Stop = _capture(monkeypatch)
    m = make_manifest(tmp_path, ["stages.mine_concepts.device=cpu", "stages.mine_concepts.hard_negatives=true",
                                 "dataset.synthetic.n_images=6", "stages.ingest.shard_size=8"])
    # ingest and mining in process; the embedding actors are where we stop
    import json

    import pipeline.runtime
    import pipeline.stage

    def local(units, fn, *, actor=False, constructor_kwargs=None, num_gpus=0, **kw):
        if actor:
            seen.update(cls=fn, kwargs=constructor_kwargs, num_gpus=num_gpus)
            raise Stop
        return (json.loads(json.dumps(fn(json.loads(json.dumps(u))))) for u in units)

    monkeypatch.setattr(pipeline.stage, "map_units", local)
    monkeypatch.setattr(pipeline.runtime, "map_units", local)
    run_stage("ingest", RunContext(m))
    with pytest.raises(Stop):
        run_stage("mine-concepts", RunContext(m))
    assert seen["kwargs"]["device"] == "cpu" and seen["num_gpus"] == 0
    w = seen["cls"](**seen["kwargs"])
    assert w.enc.device == "cpu" and next(w.enc.model.parameters()).device.type == "cpu"
    assert w.enc.encode(["a red cube"]).shape == (1, w.enc.dim)


@pytest.mark.skipif(not CUDA, reason="no GPU here")
def test_text_encoder_on_cuda_matches_cpu():
    from pipeline.models.text_encoder import TextEncoder

    texts = ["a red cube", "two blue spheres left of a cone"]
    a = TextEncoder(device="cpu").encode(texts)
    b = TextEncoder(device="cuda", precision="fp16").encode(texts)
    assert (a * b).sum(1).min() > 0.99
