"""train.job.Splits on a real `samples` artifact: the recorded split column, the hash rule where a
sample has none (or is not in the table)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def test_splits_of_a_samples_artifact(tmp_path):
    from pipeline.io.artifacts import Artifact, ArtifactWriter
    from train.job import Splits, hash_split

    w = ArtifactWriter(tmp_path, "samples", "ingest", {"fake": True})
    uw = w.unit_writer("00000", "fp")
    uw.write_table("samples", pa.table({"sample_id": pa.array([5, 1, 38, 2], pa.int64()), "source_id": ["a", "b", "c", "d"],
                                        "split": ["test", "val", None, "train"]}))
    uw.commit({"rows": 4})
    w.finalize(["00000"])
    sp = Splits(Artifact(tmp_path / "samples"))
    assert list(sp.ids) == [1, 2, 5, 38]
    # 38 % 20 == 18 (no recorded split: hash rule), 19 is not in the table (hash rule: test)
    assert sp.of_many([5, 1, 38, 2, 19]).tolist() == ["test", "val", "val", "train", "test"]
    assert sp(5) == "test" and sp.mask([5, 1, 2], ["val", "test"]).tolist() == [True, True, False]
    assert Splits(None).of_many([18, 19, 3]).tolist() == hash_split([18, 19, 3]).tolist() == ["val", "test", "train"]
    assert np.array_equal(sp.mask([], ["train"]), np.zeros(0, bool))
