"""Match a benchmark's image keys to the ``samples`` artifact (``sample_id``).

A benchmark names its images in its own way: a file name (SugarCrepe ``000000391895.jpg``), a path
(Karpathy ``val2014/COCO_val2014_000000391895.jpg``, VL-CheckList ``vg/VG_100K/2345.jpg``), a
stem (Winoground ``ex_0_img_0``) or an id (``391895``). :class:`ImageMatcher` indexes every sample
once (dicts built from the table's columns, no per-query scans) under these keys, and looks a
benchmark key up in this order, the first hit wins:

1. ``map``: the explicit mapping (``eval.benchmarks[].image_map``, CSV or JSON) from benchmark key
   (as written, or its file name) to a samples ``source_id`` or image file name; the target is
   then resolved through rules 2-5.
2. ``source_id``: the key equals a sample's ``source_id``.
3. ``file_name``: the key's last path component equals the sample image's file name (the part after
   ``::`` for images inside tar files).
4. ``stem``: the same without the extension.
5. ``numeric_id``: both sides carry the same numeric image id, recognised only where the id is the
   whole identifier, so that ``ex_0_img_1`` never matches image 1: an all-digit stem or
   ``source_id`` (COCO ``000000391895`` -> 391895, Flickr30k ``1000092795``, Visual Genome
   ``2345``) or a COCO-style ``<PREFIX>_<split><year>_<digits>`` stem (``COCO_val2014_000000391895``).
   So Karpathy ``COCO_val2014_000000391895.jpg``, SugarCrepe ``000000391895.jpg`` and
   source id ``391895`` are the same image.

A key that two different samples share at one level is ambiguous there: it matches nothing at that
level (counted in the summary as ``ambiguous``) and the lookup goes on to the next level.

Datasets. Many datasets number their images, so a number alone says little: VL-CheckList's
``vg/VG_100K/391895.jpg``, VALSE's ``VisualDialog_val2018_000000391895.jpg`` and COCO's
``COCO_val2014_000000391895.jpg`` are three different images. :func:`dataset_of` reads the dataset a
name says it is from (the ``<PREFIX>_<split><year>_`` stem: COCO, VisDial, HICO; else the nearest
folder that names one: ``val2014`` COCO, ``VG_100K`` / ``vg`` Visual Genome, ``swig`` SWiG, ``hake``
HAKE, ``flickr30k-images`` Flickr30k, ...), else COCO for a zero-padded 12-digit stem (COCO 2017's
naming, SugarCrepe's ``000000391895.jpg``, which the generated dataset shares: its samples take such
keys too); a bare id or other name (``391895``, ``2358789.jpg``) names none and matches any sample. Each sample's dataset is the one its image path names, else the run's
(``dataset_kind`` in the samples artifact's ``_manifest.json``: coco, flickr30k_entities, synthetic,
karpathy by its captions file; or ``ImageMatcher(..., dataset=...)``), else COCO for a
zero-padded 12-digit stem (COCO 2017's naming, which the generated dataset shares under its own
kind). A key that names a dataset matches only samples of that dataset at rule 5 (and never a
sample of another named dataset at rules 2-4); when the run holds no image of that dataset at all
the key is foreign (:meth:`ImageMatcher.skip_reason`: ``foreign_dataset: Visual Genome``). Rule 1
(``image_map``) always wins.

:func:`boxes_outside` finds the items whose box lies wholly outside its matched image.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

RULES = ("map", "source_id", "file_name", "stem", "numeric_id")
_AMBIGUOUS = -2
_COCO_STEM = re.compile(r"^([A-Za-z]+)_[A-Za-z]+\d{4}_(\d+)$")
_COCO2017_STEM = re.compile(r"^\d{12}$")
NOT_IN_SAMPLES = "skipped_no_image: not in samples"

# the dataset a <PREFIX>_<split><year>_<digits> stem's prefix names (other prefixes name themselves)
PREFIX_DATASETS = {"coco": "COCO", "visualdialog": "VisDial", "hico": "HICO"}
# the dataset a folder in an image path names (lower case); the nearest such folder wins
FOLDER_DATASETS = {
    **dict.fromkeys(("coco", "mscoco", "coco2014", "coco2017", "train2014", "val2014", "test2014", "train2017",
                     "val2017", "test2017", "unlabeled2017", "vcoco"), "COCO"),
    **dict.fromkeys(("vg", "vg_100k", "vg_100k_2", "visual_genome", "visualgenome"), "Visual Genome"),
    **dict.fromkeys(("flickr30k", "flickr30k-images", "flickr30k_images", "flickr30k_entities"), "Flickr30k"),
    **dict.fromkeys(("swig", "imsitu"), "SWiG"),
    **dict.fromkeys(("hake", "hake_images_20190730", "hake_images_20200614", "hcvrd"), "HAKE"),
    "hico_20160224_det": "HICO",
    "openimages": "Open Images", "visdial": "VisDial", "visual7w": "Visual7W",
}
# the dataset a run's samples are from, by the ingest stage's dataset.kind
KIND_DATASETS = {"coco": "COCO", "flickr30k_entities": "Flickr30k", "synthetic": "synthetic"}


def _name(key: str) -> str:
    key = key.split("::", 1)[-1]
    return key.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _folders(key: str) -> list[str]:
    return str(key).strip().split("::", 1)[-1].replace("\\", "/").strip("/").split("/")[:-1]


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name[1:] else name


def numeric_id(key: str) -> int | None:
    """The numeric image id a key stands for, or None (see the module doc, rule 5)."""
    stem = _stem(_name(str(key).strip()))
    if stem.isdigit():
        return int(stem)
    m = _COCO_STEM.match(stem)
    return int(m.group(2)) if m else None


def _dataset_from(folders: Iterable[str], prefix: str | None) -> str | None:
    if prefix:
        return PREFIX_DATASETS.get(prefix.lower(), prefix)
    for f in reversed(list(folders)):
        ds = FOLDER_DATASETS.get(f.lower())
        if ds:
            return ds
    return None


def dataset_of(key: str) -> str | None:
    """The dataset an image key's name says it is from, or None (a bare id or name); see the module doc."""
    stem = _stem(_name(str(key).strip()))
    m = _COCO_STEM.match(stem)
    return _dataset_from(_folders(key), m.group(1) if m else None) or ("COCO" if _COCO2017_STEM.match(stem) else None)


def _takers(key: str) -> tuple[str | None, tuple[str, ...]]:
    """(the dataset ``key`` names, the datasets whose samples may take it): a bare 12-digit name
    (SugarCrepe's ``000000391895.jpg``) is COCO 2017's naming, which the generated dataset shares."""
    ds = dataset_of(key)
    if ds == "COCO" and _COCO2017_STEM.match(_stem(_name(key))) and _dataset_from(_folders(key), None) is None:
        return ds, ("COCO", "synthetic")
    return ds, (ds,) if ds else ()


def run_dataset(manifest: dict) -> str | None:
    """The dataset a samples artifact holds, from what ingest recorded (None: not known)."""
    kind = manifest.get("dataset_kind")
    if kind == "karpathy":
        captions = str(((manifest.get("parameters") or {}).get("dataset") or {}).get("captions") or "").lower()
        return "COCO" if "coco" in captions else "Flickr30k" if "flickr30k" in captions else None
    return KIND_DATASETS.get(kind)


@dataclass
class MatchSummary:
    """How a benchmark's image keys matched: ``total`` keys (distinct), ``matched`` of them, by
    rule, how many were ambiguous somewhere, and a few unmatched examples for the error message."""

    total: int
    matched: int
    by_rule: dict[str, int] = field(default_factory=dict)
    ambiguous: int = 0
    unmatched_examples: list[str] = field(default_factory=list)
    map_unresolved: int = 0
    foreign: dict[str, int] = field(default_factory=dict)  # keys of a dataset the run holds none of, by dataset

    def line(self) -> str:
        rules = ", ".join(f"{k} {v}" for k, v in self.by_rule.items() if v) or "none"
        s = f"{self.matched:,} of {self.total:,} images matched ({rules})"
        if self.ambiguous:
            s += f"; {self.ambiguous:,} keys ambiguous at some level"
        if self.map_unresolved:
            s += f"; {self.map_unresolved:,} image_map targets not in samples"
        if self.foreign:
            s += "; foreign (the run holds none of their dataset): " + ", ".join(f"{k} {v:,}" for k, v in self.foreign.items())
        if self.unmatched_examples and self.matched < self.total:
            s += "; unmatched e.g. " + ", ".join(repr(x) for x in self.unmatched_examples[:3])
        return s


def _samples_columns(samples) -> tuple[list[int], list[str | None], list[str | None], str | None]:
    """(sample_id, source_id, image) columns and the run's dataset (:func:`run_dataset`) from an
    Artifact, an artifact folder, or a table (polars / pyarrow / pandas / dict of lists; dataset None)."""
    from pipeline.io.artifacts import Artifact

    if isinstance(samples, (str, Path)):
        samples = Artifact(samples)
    dataset = None
    if isinstance(samples, Artifact):
        if "samples" not in samples.tables():
            raise ValueError(f"{samples.dir}: artifact has no 'samples' table (expected the ingest stage's samples artifact)")
        tab = samples.read("samples", columns=["sample_id", "source_id", "image"])
        cols = tab.to_pydict()
        dataset = run_dataset(samples.manifest)
    elif isinstance(samples, dict):
        cols = samples
    elif hasattr(samples, "to_pydict"):  # pyarrow
        cols = samples.to_pydict()
    elif hasattr(samples, "to_dict"):  # polars (as_series=False) / pandas
        try:
            cols = samples.to_dict(as_series=False)
        except TypeError:
            cols = {k: list(v.values()) for k, v in samples.to_dict().items()}
    else:
        raise TypeError(f"ImageMatcher: cannot read samples from {type(samples).__name__}")
    sid = [int(x) for x in cols["sample_id"]]
    n = len(sid)
    src = list(cols.get("source_id") or [None] * n)
    img = list(cols.get("image") or [None] * n)
    return sid, src, img, dataset


def _unique_keys(frame, by: list[str]) -> dict:
    """{key (or tuple of the ``by`` columns): sample id, or _AMBIGUOUS where two samples share it}."""
    import polars as pl

    g = frame.group_by(by).agg(pl.col("sid").first(), pl.col("sid").n_unique().alias("n"))
    vals = g.select(pl.when(pl.col("n") > 1).then(pl.lit(_AMBIGUOUS, pl.Int64)).otherwise(pl.col("sid"))).to_series()
    keys = g["key"].to_list() if by == ["key"] else list(g.select(by).iter_rows())
    return dict(zip(keys, vals.to_list()))


def read_image_map(path: str | Path) -> dict[str, str]:
    """``{benchmark key: samples source_id or file name}`` from a CSV (two columns; a header row
    is allowed) or a JSON file (an object, or a list of [key, value] pairs / {"key", "value"})."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"image_map {p}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"image_map {p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None
    from train.eval.benchmarks._common import not_lfs_pointer

    not_lfs_pointer(p, "image_map", text[:256].encode())
    out: dict[str, str] = {}
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"image_map {p}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            items: Iterable = data.items()
        elif isinstance(data, list):
            items = []
            for n, r in enumerate(data):
                if isinstance(r, (list, tuple)) and len(r) == 2:
                    items.append((r[0], r[1]))
                elif isinstance(r, dict) and "key" in r and "value" in r:
                    items.append((r["key"], r["value"]))
                else:
                    raise ValueError(f"image_map {p}: entry {n} is neither [key, value] nor {{'key', 'value'}}")
        else:
            raise ValueError(f"image_map {p}: expected an object or a list")
        for k, v in items:
            out[str(k).strip()] = str(v).strip()
        return out
    rows = list(csv.reader(text.splitlines()))
    for n, r in enumerate(rows):
        if not r or all(not c.strip() for c in r):
            continue
        if len(r) < 2:
            raise ValueError(f"image_map {p}: row {n + 1} has {len(r)} column(s), expected 2 (benchmark key, source id or file name)")
        k, v = r[0].strip(), r[1].strip()
        if n == 0 and k.lower() in {"key", "image", "benchmark", "benchmark_image", "image_key"}:
            continue  # header
        out[k] = v
    return out


class ImageMatcher:
    """``ImageMatcher(samples, image_map=None)``: ``samples`` is the samples artifact (an
    :class:`~pipeline.io.artifacts.Artifact` or its folder) or a table with ``sample_id``,
    ``source_id`` and ``image`` columns; ``image_map`` a CSV/JSON path or a dict; ``dataset`` the
    run's dataset (e.g. ``"COCO"``; default: the artifact's ``dataset_kind``, see the module doc).

    ``match(key) -> sample_id | None``; ``match_many(keys) -> int64 array`` (-1 = no match);
    ``skip_reason(key)`` why a key matches nothing; ``summary(keys) -> MatchSummary`` (``.line()``
    is the one-line report)."""

    def __init__(self, samples: Any, image_map: str | Path | dict | None = None, dataset: str | None = None):
        sid, src, img, run_ds = _samples_columns(samples)
        self.n_samples = len(sid)
        self.dataset = dataset or run_ds
        self._levels: dict[str, dict[Any, int]] = {r: {} for r in RULES[1:]}
        self._family: dict[int, str] = {}  # sample_id -> its dataset, where known
        self._by_dataset: dict[tuple[str, int], int] = {}  # (dataset, numeric id) -> sample_id
        self._build(sid, src, img)
        if image_map is None:
            self.image_map: dict[str, str] = {}
        elif isinstance(image_map, dict):
            self.image_map = {str(k): str(v) for k, v in image_map.items()}
        else:
            self.image_map = read_image_map(image_map)

    def _build(self, sid: list[int], src: list, img: list) -> None:
        """One dict per level from the columns (polars string ops; a key shared by two samples is
        marked ambiguous)."""
        import polars as pl

        df = pl.DataFrame({"sid": pl.Series(sid, dtype=pl.Int64),
                           "src": pl.Series([None if x is None else str(x) for x in src], dtype=pl.Utf8),
                           "img": pl.Series([None if x is None else str(x) for x in img], dtype=pl.Utf8)})
        name = (pl.col("img").str.split("::").list.last().str.replace_all("\\\\", "/").str.strip_chars_end("/")
                .str.split("/").list.last())
        df = df.with_columns(name.alias("name")).with_columns(
            pl.when(pl.col("name").str.slice(1).str.contains(".", literal=True))
            .then(pl.col("name").str.replace(r"\.[^.]*$", "")).otherwise(pl.col("name")).alias("stem"))
        coco = pl.col("stem").str.extract(r"^[A-Za-z]+_[A-Za-z]+\d{4}_(\d+)$", 1)
        digits = pl.when(pl.col("stem").str.contains(r"^\d+$")).then(pl.col("stem")).otherwise(coco)
        src_num = pl.when(pl.col("src").str.contains(r"^\d+$")).then(pl.col("src"))
        df = df.with_columns(digits.str.to_integer(strict=False).alias("num_img"),
                             src_num.str.to_integer(strict=False).alias("num_src"))
        # each sample's dataset: the one its image path names (decided once per folder and stem prefix), else the run's
        folder = pl.col("img").str.split("::").list.last().str.replace_all("\\\\", "/").str.replace(r"/?[^/]*$", "")
        df = df.with_columns(folder.alias("folder"), pl.col("stem").str.extract(_COCO_STEM.pattern, 1).alias("prefix"),
                             pl.col("stem").str.contains(r"^\d{12}$").alias("coco12"))
        on = ["folder", "prefix", "coco12"]
        combos = df.select(on).unique()
        # a zero-padded 12-digit stem is COCO 2017's naming: the run's dataset when nothing else says
        names = [_dataset_from((f or "").split("/"), p) or self.dataset or ("COCO" if c else None)
                 for f, p, c in combos.iter_rows()]
        df = df.join(combos.with_columns(pl.Series("ds", names, dtype=pl.Utf8)), on=on, how="left", nulls_equal=True)
        known = df.filter(pl.col("ds").is_not_null())
        self._family = dict(zip(known["sid"].to_list(), known["ds"].to_list()))
        self.datasets = set(names) if len(df) else set()
        num = pl.concat([df.select(pl.col("num_src").alias("key"), "sid", "ds"), df.select(pl.col("num_img").alias("key"), "sid", "ds")])
        for level, frame in (("source_id", df.select(pl.col("src").alias("key"), "sid")),
                             ("file_name", df.select(pl.col("name").alias("key"), "sid")),
                             ("stem", df.select(pl.col("stem").alias("key"), "sid")), ("numeric_id", num.drop("ds"))):
            self._levels[level] = _unique_keys(frame.drop_nulls("key").filter(pl.col("key").cast(pl.Utf8) != ""), ["key"])
        self._by_dataset = _unique_keys(num.drop_nulls(["key", "ds"]), ["ds", "key"])

    def _lookup(self, key: str) -> tuple[int, str, bool]:
        """(sample_id or -1, rule, ambiguous seen). A key that names a dataset takes no sample of
        another named dataset, and a number only from a sample of its own dataset."""
        amb = False
        name = _name(key)
        stem = _stem(name)
        nid = numeric_id(key)
        ds, takers = _takers(key)
        for level, k in (("source_id", key), ("source_id", name) if name != key else (None, None),
                         ("file_name", name), ("stem", stem), ("numeric_id", nid)):
            if level is None or k is None:
                continue
            if level == "numeric_id" and ds is not None:
                s = next((self._by_dataset[d, k] for d in takers if (d, k) in self._by_dataset), None)
            else:
                s = self._levels[level].get(k)
            if s is None:
                continue
            if s == _AMBIGUOUS:
                amb = True
                continue
            if ds is not None and self._family.get(s, ds) not in takers:
                continue
            return s, level, amb
        return -1, "", amb

    def foreign_dataset(self, key) -> str | None:
        """The dataset ``key`` names when the run holds no image of it (and every sample's dataset is known)."""
        ds, takers = _takers(str(key))
        return ds if ds is not None and not self.datasets & set(takers) and None not in self.datasets else None

    def skip_reason(self, key) -> str:
        """Why an unmatched key is skipped: ``foreign_dataset: <dataset>`` or ``skipped_no_image: not in samples``."""
        ds = self.foreign_dataset(key)
        return f"foreign_dataset: {ds}" if ds else NOT_IN_SAMPLES

    def _resolve(self, key) -> tuple[int, str, bool, bool]:
        """(sample_id or -1, rule, ambiguous, image_map target unresolved)."""
        key = str(key).strip()
        if self.image_map:
            target = self.image_map.get(key, self.image_map.get(_name(key)))
            if target is not None:
                s, _, amb = self._lookup(target)
                if s >= 0:
                    return s, "map", amb, False
                return -1, "", amb, True
        s, rule, amb = self._lookup(key)
        return s, rule, amb, False

    def match(self, key) -> int | None:
        s = self._resolve(key)[0]
        return None if s < 0 else s

    def match_many(self, keys: Iterable) -> np.ndarray:
        """Sample ids for ``keys`` (int64, -1 where a key matches no sample); each distinct key is
        resolved once."""
        keys = list(keys)
        uniq = {k: self._resolve(k)[0] for k in dict.fromkeys(str(k).strip() for k in keys)}
        return np.fromiter((uniq[str(k).strip()] for k in keys), dtype=np.int64, count=len(keys))

    def summary(self, keys: Iterable) -> MatchSummary:
        by_rule: Counter = Counter()
        foreign: Counter = Counter()
        amb = unresolved = matched = 0
        unmatched: list[str] = []
        distinct = list(dict.fromkeys(str(k).strip() for k in keys))
        for k in distinct:
            s, rule, a, unres = self._resolve(k)
            amb += a
            unresolved += unres
            if s >= 0:
                matched += 1
                by_rule[rule] += 1
            elif self.foreign_dataset(k):
                foreign[self.foreign_dataset(k)] += 1
            elif len(unmatched) < 5:
                unmatched.append(k)
        return MatchSummary(total=len(distinct), matched=matched, by_rule={r: by_rule[r] for r in RULES if by_rule[r]},
                            ambiguous=amb, unmatched_examples=unmatched, map_unresolved=unresolved,
                            foreign=dict(sorted(foreign.items())))


def boxes_outside(items: list, sid_of: dict[str, int | None], samples_dir: str | Path) -> set[int]:
    """Positions of the ``items`` (:class:`train.eval.interface.Item`) with a box wholly outside its
    image (``sid_of``: image key -> sample id; width / height from the samples artifact): a job would
    score some other part of the image (concept-ot: the patch nearest to the box). The harness
    skips them."""
    boxed = {sid_of[p.image] for it in items for p in it.pairs if p.box is not None and sid_of[p.image] is not None}
    if not boxed:
        return set()
    import polars as pl

    from pipeline.io.artifacts import Artifact

    lf = Artifact(samples_dir).scan("samples")
    if not {"width", "height"} <= set(lf.collect_schema().names()):
        return set()
    t = lf.select("sample_id", "width", "height").filter(pl.col("sample_id").is_in(sorted(boxed))).collect()
    size = {s: (w, h) for s, w, h in t.iter_rows() if w and h}

    def outside(p) -> bool:
        if p.box is None or sid_of[p.image] not in size:
            return False
        (x0, y0, x1, y1), (w, h) = p.box, size[sid_of[p.image]]
        return x1 <= 0 or y1 <= 0 or x0 >= w or y0 >= h

    return {k for k, it in enumerate(items) if any(outside(p) for p in it.pairs)}
