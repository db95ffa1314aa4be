"""The Job base: what every training job shares, apart from the loop that runs it.

A job (``train/jobs/<job>/job.py``) subclasses :class:`Job` and implements the lifecycle the loop
(``train/loop.py``) calls: ``build_model``, ``batches_per_epoch``, ``batches``, ``loss``, ``evaluate``,
and the evaluation harness's scoring interface (``train/eval/interface.py``). The helpers below are
the pieces every job needs and that exist once:

- :func:`resolve_artifact` / :func:`open_artifact`: an artifact path under the manifest's output
  (absolute paths and object-storage URLs pass through), opened with one error naming the stage
  that writes it;
- :class:`Splits`: the train/val/test rule (the samples artifact's ``split`` column; without one a
  stable hash split, ``sample_id % 20``: 18 -> val, 19 -> test, as the generated dataset does);
- :func:`rank_batches` / :meth:`Job.steps_per_epoch`: a data-parallel rank's share of an epoch
  (``train run --workers N``, train/distributed.py).

Data parallelism: a job trained by N workers is built with the per-worker batch size
(``batch_size // N``) and ``rank`` / ``world_size`` set; its epoch, at that batch size, has ``n``
batches, and global step ``k`` on rank ``r`` trains on the epoch's batch ``k * N + r``. So the N
ranks of a step together see exactly the samples of the single-process batch ``k`` of the full batch
size, every rank reads only its own batches, and ``batches_per_epoch`` (steps, the same on every rank)
is ``n // N``. ``batches(epoch, start)``'s ``start`` stays a step index.

A training split smaller than one batch (the demo): one process trains on the whole split as one
batch; N workers do the same, the split's ``n`` samples as one global batch of ``n - n % N`` (``n // N``
per rank), :meth:`Job.fit_batch`, the one rule every job's batch size goes through.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# artifact -> the stage that writes it (for "run this first" errors)
WRITER = {
    "samples": "ingest", "concepts": "mine-concepts", "negatives": "negative-captions",
    "visual_tokens": "extract-visual-tokens", "clip_tokens": "extract-clip-tokens",
    "image_groups": "extract-image-groups", "regions": "extract-regions", "index": "build-index",
    "concept_tokens": "encode-concepts",
}


def resolve_artifact(manifest, rel: str) -> Path | str:
    """``rel`` under the manifest's output unless absolute (an object-storage URL stays a str)."""
    from pipeline.io.storage import resolve_under

    return resolve_under(manifest.output, rel)


def open_artifact(manifest, rel: str, expected: str | None = None, job: str = ""):
    """The artifact at ``rel`` (see :func:`resolve_artifact`); a missing one raises
    FileNotFoundError naming the stage to run, one of another kind ValueError."""
    from pipeline.io.artifacts import Artifact

    path = resolve_artifact(manifest, rel)
    who = f"{job}: " if job else ""
    try:
        art = Artifact(path)
    except FileNotFoundError:
        stage = WRITER.get(expected or "", "the stage that writes it")
        from pipeline.config import CORPUS_DIR

        if Path(rel).parts[:1] == (CORPUS_DIR,):  # an artifact of the pretraining corpus: the stage run with --corpus
            stage = f"{stage} --corpus` (the manifest's pretraining corpus)"
        else:
            stage += "`"
        raise FileNotFoundError(f"{who}{expected or rel} artifact {path} is missing (no _manifest.json): "
                                f"run `pipeline run {stage} first") from None
    if expected is not None and art.name != expected:
        raise ValueError(f"{who}{path} holds a {art.name!r} artifact, expected {expected!r}")
    return art


def hash_split(sample_ids) -> np.ndarray:
    """The stable split of samples without a recorded one: sample_id % 20: 18 -> val, 19 -> test."""
    r = np.asarray(sample_ids, dtype=np.int64) % 20
    return np.where(r == 18, "val", np.where(r == 19, "test", "train")).astype(object)


class Splits:
    """sample_id -> split: the samples artifact's ``split`` column where it has one, else :func:`hash_split`.

    Built once from the ``samples`` table (two columns, sorted ids, vectorised lookups)."""

    def __init__(self, samples_artifact=None):
        self.ids = np.zeros(0, np.int64)
        self.split = np.zeros(0, object)
        if samples_artifact is not None and "samples" in samples_artifact.tables():
            t = samples_artifact.read("samples", ["sample_id", "split"])
            ids = np.asarray(t["sample_id"].to_numpy(), np.int64)
            sp = np.asarray(t["split"].to_pylist(), object)
            order = np.argsort(ids, kind="stable")
            self.ids, self.split = ids[order], sp[order]

    @classmethod
    def of_manifest(cls, manifest, rel: str = "samples") -> "Splits":
        """From the manifest's samples artifact; the hash rule alone where it is missing."""
        from pipeline.io.artifacts import Artifact, ArtifactMissing

        try:
            return cls(Artifact(resolve_artifact(manifest, rel)))
        except (ArtifactMissing, KeyError):
            return cls(None)

    def recorded(self, sample_ids) -> np.ndarray:
        """object array of the samples artifact's split per id, None where it records none."""
        q = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        out = np.full(q.shape, None, dtype=object)
        if len(self.ids):
            r = np.clip(np.searchsorted(self.ids, q), 0, len(self.ids) - 1)
            got = self.split[r]
            keep = (self.ids[r] == q) & np.array([bool(x) for x in got], dtype=bool)
            out[keep] = got[keep]
        return out

    def of_many(self, sample_ids) -> np.ndarray:
        """object array of split names, one per id."""
        q = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        out = hash_split(q)
        rec = self.recorded(q)
        keep = rec != None  # noqa: E711 (element-wise)
        out[keep] = rec[keep]
        return out

    def __call__(self, sample_id: int) -> str:
        return str(self.of_many([sample_id])[0])

    def mask(self, sample_ids, splits) -> np.ndarray:
        """bool [len(sample_ids)]: True where the sample's split is one of ``splits``."""
        return np.isin(self.of_many(sample_ids), list(splits))


def batch_record(job: "Job") -> dict:
    """``{"batch_per_step": {"global", "per_worker", "workers"}}``: the batch that trains each step,
    for the run's config.json beside its options (the configured ``batch_size`` is the run's
    option; a split smaller than one batch trains on less, :meth:`Job.fit_batch`). {} for a job
    whose batch does not go through ``fit_batch``."""
    if job.train_batch is None:
        try:
            job.batches_per_epoch()  # a job chooses its batch (once, cached) when it counts its batches
        except Exception:  # noqa: BLE001 - the loop raises it where it always has
            return {}
    if job.train_batch is None:
        return {}
    n = max(1, job.world_size)
    return {"batch_per_step": {"global": job.train_batch * n, "per_worker": job.train_batch, "workers": n}}


def rank_batches(n_batches: int, start: int, rank: int = 0, world_size: int = 1) -> range:
    """The epoch's batch indices (of ``n_batches``) that ``rank`` trains on from step ``start`` on:
    ``start * N + rank, (start + 1) * N + rank, ...`` for the ``n_batches // N`` steps of the epoch."""
    return range(start * world_size + rank, (n_batches // world_size) * world_size, world_size)


# (rank, world_size) of the jobs built in this process: train/distributed.py sets it in each Ray Train
# worker before the job is built, so a job knows its place from its constructor on
PLACE: tuple[int, int] = (0, 1)


class Job:
    """Base class of a training job (see the module docstring)."""

    rank: int = 0        # data-parallel rank and number of ranks (train/distributed.py sets them)
    world_size: int = 1
    train_items: int | None = None  # the training split's size, once fit_batch has seen it
    train_batch: int | None = None  # this rank's batch, once fit_batch has chosen it

    def __init__(self, cfg, manifest, run_dir: Path, device: torch.device):
        self.cfg, self.manifest, self.run_dir, self.device = cfg, manifest, Path(run_dir), device
        self.rank, self.world_size = PLACE

    def input_fingerprints(self) -> dict[str, str]:
        """{option: fingerprint} of every artifact the job's ``*artifact`` options name that exists: what the loop
        stores in each checkpoint and compares on resume, so a run folder is never resumed (or a finished run
        re-evaluated) on artifacts that a stage has since rewritten (:func:`train.run_folder.check_run_folder`)."""
        from pipeline.io.artifacts import Artifact

        out = {}
        for key in sorted(type(self.cfg).model_fields):
            rel = getattr(self.cfg, key, None)
            if not key.endswith("artifact") or not isinstance(rel, str) or not rel:
                continue
            try:
                fp = Artifact(resolve_artifact(self.manifest, rel)).manifest.get("fingerprint")
            except Exception:  # missing or unreadable (a file, a bucket): the job itself says so when it opens it
                continue
            if fp:
                out[key] = str(fp)
        return out

    def fit_batch(self, n: int, what: str = "samples") -> int:
        """This rank's batch for a training split of ``n`` items: ``cfg.batch_size`` (with N workers
        already the run's batch // N), or, when the split is smaller than one global batch, the whole
        split as one global batch split exactly over the ranks (``n // N`` each; ``n % N < N`` items
        wait for the next epoch's order, as ``drop_last`` leaves a remainder). One process: ``n``.
        A split of fewer than 2 items (fewer than N with N workers) keeps ``cfg.batch_size``, i.e. no
        batch: the loop, or the preflight of ``--workers``, says so."""
        B, N = int(self.cfg.batch_size), max(1, self.world_size)
        self.train_items, self.train_batch = int(n), B
        if max(2, N) <= n < B * N:
            self.train_batch = n // N
            if self.rank == 0:
                import sys

                each = f" ({n // N} on each of {N} workers)" if N > 1 else ""
                print(f"{getattr(self, 'NAME', type(self).__name__)}: training split has {n} {what} < batch_size "
                      f"{B * N}; using batches of {n // N * N}{each}", file=sys.stderr)
        return self.train_batch

    def rank_batches(self, n_batches: int, start: int) -> range:
        """This rank's batch indices of an epoch of ``n_batches`` from step ``start`` (:func:`rank_batches`)."""
        return rank_batches(n_batches, start, self.rank, self.world_size)

    def steps_per_epoch(self, n_batches: int) -> int:
        """Optimizer steps in an epoch of ``n_batches`` (per-worker) batches: ``n_batches // world_size``."""
        return n_batches // self.world_size

    def stream_batches(self, stream, epoch: int, start: int, steps: int) -> Iterable[Any]:
        """This rank's batches of a :class:`pipeline.io.shards.ShardStream` epoch of ``steps`` steps
        (built for one process: rank 0 of 1), from step ``start``, through ``cfg.num_workers`` loader
        workers: the stream's batches ``start * N + rank, ...`` (ShardStream's own rank split),
        cut at the epoch's last full step so every rank takes the same number of steps."""
        import itertools

        from pipeline.io.shards import loader

        stream.rank, stream.world_size = self.rank, self.world_size
        it = loader(stream.set_position(epoch, start * self.world_size), getattr(self.cfg, "num_workers", 0))
        return itertools.islice(it, max(0, steps - start))

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def batches_per_epoch(self) -> int:
        raise NotImplementedError

    def batches(self, epoch: int, start: int) -> Iterable[Any]:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, out_dir: Path) -> dict[str, float]:
        return {}

    # --- the scoring interface of the evaluation harness (train/eval/interface.py) -------------
    crop_note: str = ""

    def scorable_sample_ids(self):
        """Sample ids whose image the job's artifacts hold (see train/eval/interface.py)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the scoring interface")

    def score_pairs(self, model: torch.nn.Module, sample_ids, texts, boxes=None):
        """float64 [P] image-text compatibility (see train/eval/interface.py)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the scoring interface")

    def retrieval_scores(self, model: torch.nn.Module, sample_ids, caption_ids, texts) -> dict:
        """{protocol: [I, T] scores}; default: the full cross product through score_pairs."""
        sids = np.asarray(sample_ids, dtype=np.int64)
        I, T = len(sids), len(texts)
        ii = np.repeat(np.arange(I), T)
        tt = np.tile(np.arange(T), I)
        s = np.asarray(self.score_pairs(model, sids[ii], [texts[t] for t in tt]), dtype=np.float64)
        return {"score": s.reshape(I, T)}

    def job_metrics(self, model: torch.nn.Module, out_dir: Path) -> list:
        """The job's own evaluations as train.eval.interface.Row (grounding, phrase discovery...)."""
        return []
