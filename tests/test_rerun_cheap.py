"""Incremental reruns are cheap: when every shard of every stage is complete, a rerun loads no
model, constructs no stage worker, starts no actor and does not start Ray; and the provenance
cache that makes this possible is invalidated by a change of the weights it describes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.stage import RunContext, dependency_order, registry, run_stage
from tests.conftest import make_manifest

SMALL = [
    "dataset.synthetic.n_images=6",
    "dataset.synthetic.captions_per_image=2",
    "stages.ingest.shard_size=4",
    "stages.mine_concepts.shard_size=4",
    "stages.extract_visual_tokens.shard_size=4",
    "stages.negative_captions.shard_size=4",
    "stages.extract_clip_tokens.shard_size=4",
    "stages.extract_image_groups.shard_size=4",
    "stages.extract_regions.shard_size=4",
    "stages.build_index.k=4",
    "stages.negative_captions.torch_threads=1",
    "stages.mine_concepts.torch_threads=1",
]


def _in_process(monkeypatch, constructed: list):
    """map_units without Ray: actors are the worker class constructed in this process (counted)."""
    cache: dict = {}

    def local_map(units, fn, *, ray_cfg=None, actor=False, constructor_kwargs=None, **kw):
        if actor:
            key = (fn.__qualname__, json.dumps(constructor_kwargs, sort_keys=True, default=str))
            if key not in cache:
                constructed.append(fn.__qualname__)
                cache[key] = fn(**(constructor_kwargs or {}))
            fn = cache[key]
        for u in units:
            yield json.loads(json.dumps(fn(json.loads(json.dumps(u)))))

    import pipeline.runtime
    import pipeline.stage

    monkeypatch.setattr(pipeline.stage, "map_units", local_map)
    monkeypatch.setattr(pipeline.runtime, "map_units", local_map)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Every enabled demo stage run once (small), in process."""
    import torch

    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    constructed: list = []
    _in_process(mp, constructed)
    m = make_manifest(tmp_path_factory.mktemp("rerun"), SMALL)
    reg = registry()
    names = dependency_order([s for s in reg if getattr(m.stages, reg[s].key).enabled])
    for name in names:
        run_stage(name, RunContext(m))
    mp.undo()
    assert constructed, "the first run constructs workers"
    return m, names


def _forbid(monkeypatch, what: str):
    def refuse(*a, **k):
        raise AssertionError(f"{what} called on a rerun with nothing to do")

    return refuse


def test_rerun_loads_no_model_and_starts_nothing(finished, monkeypatch):
    import torch

    import pipeline.models.clip
    import pipeline.models.detector
    import pipeline.models.groupvit
    import pipeline.models.mlm
    import pipeline.models.relations
    import pipeline.models.sam
    import pipeline.models.text_encoder
    import pipeline.runtime
    import pipeline.stage

    m, names = finished
    for mod, attr in [
        (pipeline.runtime, "ensure_ray"), (pipeline.stage, "ensure_ray"),
        (pipeline.runtime, "map_units"), (pipeline.stage, "map_units"),
        (pipeline.models.clip, "load_clip"), (pipeline.models.groupvit, "load_groupvit"),
        (pipeline.models.detector, "load_detector"), (pipeline.models.mlm, "load_mlm"),
        (pipeline.models.mlm, "load_word_encoder"), (pipeline.models.text_encoder, "TextEncoder"),
        (pipeline.models.sam, "SamModel"), (pipeline.models.relations, "PredicateEncoder"),
    ]:
        monkeypatch.setattr(mod, attr, _forbid(monkeypatch, f"{mod.__name__}.{attr}"))
    built = []
    orig = torch.nn.Module.__init__

    def counting_init(self, *a, **k):
        built.append(type(self).__name__)
        orig(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "__init__", counting_init)
    before = {n: json.loads((Path(m.output) / registry()[n].writes[0] / "_manifest.json").read_text())["fingerprint"] for n in names}
    for name in names:
        run_stage(name, RunContext(m))
    assert built == [], f"torch modules built on a rerun: {sorted(set(built))[:5]}"
    after = {n: json.loads((Path(m.output) / registry()[n].writes[0] / "_manifest.json").read_text())["fingerprint"] for n in names}
    assert after == before


def test_provenance_cache_follows_the_weights(tmp_path):
    from pipeline.models.provenance import cached_info

    ckpt = tmp_path / "w.bin"
    ckpt.write_bytes(b"one")
    calls = []

    def compute():
        calls.append(1)
        return {"spec": str(ckpt), "n": len(calls)}

    out = tmp_path / "out"
    assert cached_info(out, "det", {"detector": f"torchvision:fasterrcnn:{ckpt}"}, compute)["n"] == 1
    assert cached_info(out, "det", {"detector": f"torchvision:fasterrcnn:{ckpt}"}, compute)["n"] == 1  # cached
    assert cached_info(out, "det", {"detector": f"torchvision:fasterrcnn:{ckpt}"}, compute, max_boxes=3)["n"] == 2  # options
    ckpt.write_bytes(b"other weights")
    os.utime(ckpt, ns=(1, 1))
    assert cached_info(out, "det", {"detector": f"torchvision:fasterrcnn:{ckpt}"}, compute)["n"] == 3  # new weights
    # unidentifiable weights (an unknown hub id, a missing file): computed every time, never cached
    assert cached_info(out, "det", {"detector": "no-such/model-id"}, compute)["n"] == 4
    assert cached_info(out, "det", {"detector": "no-such/model-id"}, compute)["n"] == 5
    # random presets are cached by name (their weights are a function of the code and versions)
    assert cached_info(out, "clip", {"clip": "tiny-random"}, compute)["n"] == 6
    assert cached_info(out, "clip", {"clip": "tiny-random"}, compute)["n"] == 6
