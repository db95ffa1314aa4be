"""concept-ot's training data: the ``clip_tokens`` sample table (ids, shard positions, captions,
splits, the ``train_subset`` draw) and the batches of Alg. 2 (one random caption per image, or one
pass over the (image, caption) pairs per epoch with ``epoch_unit: captions``; with
``hard_negatives: index`` each batch is seeds plus their index neighbours)."""

from __future__ import annotations

import functools
import random
import sys

import numpy as np

from pipeline.loaders.clip_tokens import collate as ct_collate
from pipeline.io.shards import ShardStream
from pipeline.loaders.clip_tokens import read_sample, read_shard, sample_index
from train.jobs.concept_ot.index_negatives import (IndexMissing, IndexNeighbours, IndexNeighbourStream, SampleTable,
                                                   require_index)


class _CaptionPass:
    """Stands in for the collate's rng in pass ``k`` of an epoch over caption pairs
    (``epoch_unit: captions``): the batch's i-th sample takes caption ``perm[k % c]`` of a
    permutation of its c captions seeded by (seed, epoch, sample_id), so with c == passes every
    (image, caption) pair is used exactly once per epoch. ``collate`` asks ``randrange(c)`` once
    per sample, in sample order."""

    def __init__(self, samples, seed: int, epoch: int, k: int):
        self._sids = iter([int(s["sample_id"]) for s in samples])
        self.seed, self.epoch, self.k = int(seed), int(epoch), int(k)

    def randrange(self, c: int) -> int:
        sid = next(self._sids)
        perm = list(range(c))
        random.Random((self.seed * 1_000_003 + self.epoch) * 1_000_033 + sid).shuffle(perm)
        return perm[self.k % c]


def _collate_random(samples, rng: random.Random, attach=None, caption_pass=None):
    """One random caption per image (a module-level function: DataLoader workers pickle it);
    ``caption_pass`` = (seed, epoch, k): the caption of pass k of an epoch over caption pairs."""
    if caption_pass is not None:
        rng = _CaptionPass(samples, *caption_pass)
    b = ct_collate(samples, "random", rng)
    return attach(b) if attach is not None else b


IMAGE_FIELDS = ("patch_tokens", "image_embed")


def _shuffled_pairs(read, partner: dict, lazy: bool, *args, **kw):
    """``control: shuffled``: ``read`` (a shard's samples, or one sample) with every training
    sample's image fields replaced by those of its partner (``partner``: sample_id -> (shard path,
    position) of the image whose features it takes), so each training caption is paired with
    another training image's features for the whole run (a module-level function: picklable)."""
    got = read(*args, **kw)
    swap = functools.partial(_swap_image, partner=partner, lazy=lazy)
    return swap(got) if isinstance(got, dict) else map(swap, got)


def _swap_image(s: dict, partner: dict, lazy: bool) -> dict:
    src = partner.get(int(s["sample_id"]))
    if src is None:
        return s
    other = read_sample(src[0], src[1], fields=IMAGE_FIELDS, lazy=lazy)
    return {**s, **{f: other[f] for f in IMAGE_FIELDS if f in s}}


def _index_there(index_dir) -> bool:
    try:
        require_index(index_dir)
        return True
    except IndexMissing:
        return False


class ConceptOTBatches:
    """The data half of :class:`train.jobs.concept_ot.job.ConceptOTJob` (``self.cfg``, ``self.shards``,
    ``self.splits``, ``self.index_dir``, ``self._lazy`` are set by the job)."""

    def neighbours(self) -> IndexNeighbours | None:
        """The index neighbours (hard_negatives: index), or, in batch mode, when an index artifact
        is present and matches (only for the hn_index_hit metric); None otherwise."""
        if self._nb is False:
            table = SampleTable(self.shards, functools.partial(read_shard, fields=("caption_ids",), lazy=True),
                                self._keep_train) if _index_there(self.index_dir) else None
            if table is None:
                self._nb = None
            elif self.cfg.hard_negatives == "index":
                self._nb = IndexNeighbours(self.index_dir, table, self.cfg.index_top)
            else:
                try:
                    self._nb = IndexNeighbours(self.index_dir, table, self.cfg.index_top, log=lambda m: None)
                except (OSError, ValueError, KeyError):
                    self._nb = None  # batch mode: the metric is optional
        return self._nb

    # ---------------------------------------------------------------------------------- splits
    def split_of(self, sample_id: int) -> str:
        """The samples artifact's split; without one, the stable hash split (train.job.Splits)."""
        return self.splits(sample_id)

    def _table(self) -> dict:
        """Every sample of the shards, sorted by id: ``ids``, ``shard`` (index into self.shards),
        ``pos`` (position in the shard), ``ncap`` (captions), ``split``, ``train`` (a training sample:
        captions, a train split and, with ``train_subset``, in the subset), ``eval`` (captions and an
        eval split). One pass over the shards' headers; the splits in one vectorised join."""
        if self._tab is not None:
            return self._tab
        ix = sample_index(self.shards, str(self.art.dir))
        ids_a, ncap_a = ix["ids"], ix["ncap"]
        split = self.splits.of_many(ids_a)
        train = (ncap_a > 0) & np.isin(split, list(self.cfg.train_splits))
        n_train = int(train.sum())
        if self.cfg.train_subset is not None and self.cfg.train_subset < n_train:
            # a seeded draw from the sorted training ids: independent of shard order and of cfg.seed
            pick = np.random.default_rng(self.cfg.train_subset_seed).choice(n_train, self.cfg.train_subset, replace=False)
            sub = np.zeros(n_train, bool)
            sub[pick] = True
            train[np.flatnonzero(train)] = sub
        elif self.cfg.train_subset is not None:
            print(f"concept-ot: train_subset {self.cfg.train_subset} >= the {n_train} training images: using all",
                  file=sys.stderr)
        self._tab = {"ids": ids_a, "shard": ix["shard"], "pos": ix["pos"],
                     "ncap": ncap_a, "split": split, "train": train,
                     "eval": (ncap_a > 0) & np.isin(split, list(self.cfg.eval_splits))}
        return self._tab

    def _rows(self, sample_ids) -> np.ndarray:
        """Table rows of ``sample_ids``, -1 where an id is not in the shards."""
        ids = self._table()["ids"]
        q = np.asarray(sample_ids, np.int64)
        if ids.size == 0:
            return np.full(q.shape, -1, np.int64)
        i = np.minimum(np.searchsorted(ids, q), ids.size - 1)
        return np.where(ids[i] == q, i, -1)

    def train_sample_ids(self) -> np.ndarray:
        """The training images (after ``train_subset``), sorted."""
        t = self._table()
        return t["ids"][t["train"]]

    def _keep_train(self, s: dict) -> bool:
        r = int(self._rows([s["sample_id"]])[0])
        return r >= 0 and bool(self._table()["train"][r])

    def _passes(self) -> int:
        """Image passes per epoch: 1 (epoch_unit: images), or round(mean captions per training image)
        (epoch_unit: captions)."""
        if self.cfg.epoch_unit == "images":
            return 1
        t = self._table()
        n = t["ncap"][t["train"]]
        return max(1, int(round(float(n.mean())))) if n.size else 1

    def control_partners(self) -> dict | None:
        """``control: shuffled``: sample_id -> (shard, position) of the training image whose
        features that training sample reads, a permutation of the training images drawn once from
        ``[seed, 777]`` (None without the control)."""
        if self.cfg.control != "shuffled":
            return None
        if getattr(self, "_partners", None) is None:
            t = self._table()
            rows = np.flatnonzero(t["train"])
            perm = rows[np.random.default_rng([self.cfg.seed, 777]).permutation(rows.size)]
            self._partners = {int(t["ids"][r]): (self.shards[int(t["shard"][p])], int(t["pos"][p]))
                              for r, p in zip(rows, perm)}
        return self._partners

    def _stream(self, caption_pass: tuple[int, int] | None = None) -> ShardStream:
        cfg = self.cfg

        nb = self.neighbours()
        read = functools.partial(read_shard, lazy=self._lazy)
        one = functools.partial(read_sample, lazy=self._lazy)
        partners = self.control_partners()
        if partners is not None:
            read = functools.partial(_shuffled_pairs, read, partners, self._lazy)
            one = functools.partial(_shuffled_pairs, one, partners, self._lazy)
        coll = _collate_random
        if caption_pass is not None:
            coll = functools.partial(_collate_random, caption_pass=(cfg.seed, *caption_pass))
        if cfg.hard_negatives == "index":
            return IndexNeighbourStream(self.shards, read, coll, self.batch_size, neighbours=nb,
                                        m=cfg.index_neighbours,
                                        read_sample=one,
                                        shuffle=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
                                        keep=self._keep_train)
        collate = coll if nb is None else functools.partial(coll, attach=nb.attach)
        return ShardStream(self.shards, read, collate, self.batch_size,
                           shuffle=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed, drop_last=True,
                           keep=self._keep_train)

    @property
    def batch_size(self) -> int:
        """cfg.batch_size, or the whole training split when it is smaller than one batch (the
        demo's 64 images): a warning says so."""
        if getattr(self, "_bs", None) is None:
            self._bs = self.fit_batch(int(self._table()["train"].sum()))  # train.job.Job.fit_batch
        return self._bs

    def batches_per_epoch(self) -> int:
        if self._bpe is None:
            self._bpe = self.steps_per_epoch(self._stream().count_batches())  # steps per image pass
        return self._bpe * self._passes()

    def batches(self, epoch: int, start: int):
        R = self._passes()
        n = self.batches_per_epoch() // R
        if R == 1:
            return self.stream_batches(self._stream(), epoch, start, n)
        # an epoch over caption pairs: R image passes, pass k shuffled as stream epoch epoch * R + k

        def passes():
            for k in range(start // n, R):
                yield from self.stream_batches(self._stream((epoch, k)), epoch * R + k,
                                               start % n if k == start // n else 0, n)

        return passes()
