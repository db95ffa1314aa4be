"""A dataset's size, counted by its reader without opening an image, and a sample of its records.

``ingest`` keeps a record whose image decodes and a caption that is not blank. The count here sees
the captions (a blank one is not counted) but opens no image, so for a real dataset the image count
is the reader's records *before* the image checks (an upper bound by the number of unreadable
images); the generated dataset lists the images it broke on purpose (``_params.json``), so its
counts are exact. ``images=`` (``pipeline plan --images N``) sizes a dataset that is not on this
machine from the given count and the stated caption statistics instead (``source: given``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_RECORDS = 256  # records kept for per-image shapes (captions, lengths, instances, relations)
TEXT_RECORDS = 40_000  # records whose captions are kept: the concept miner's vocabulary is extrapolated from them
# (the 200k rehearsal: from 5,000 records it came out +61%, from 40,000 +6%; docs/scaling.md)
TEXT_SAMPLE_GENERATED = 5000  # images generated for the per-image shapes of a generated dataset too large to generate
GENERATE_MAX = 5000  # a generated dataset up to this size is generated (as ingest would) and read back


@dataclass
class SampleRecord:
    """What sizing needs of one record: its kept captions and its annotations' counts."""

    captions: list[str]
    instances: int = 0
    relations: int = 0
    predicates: tuple[str, ...] = ()  # its relations' predicate names
    phrases: int = 0
    mask_bytes: int = 0  # summed COCO RLE string lengths of its instance masks
    path_chars: int = 0


@dataclass
class DatasetSize:
    images: int
    captions: int
    source: str  # "counted by the <kind> reader" | "generator parameters" | "given"
    exact: bool  # False: records before the image checks, or given
    sample: list[SampleRecord] = field(default_factory=list)
    note: str = ""
    text_sample: list[SampleRecord] = field(default_factory=list)  # captions only, up to TEXT_RECORDS records

    @property
    def captions_per_image(self) -> float:
        return self.captions / self.images if self.images else 0.0


def _sample(rec) -> SampleRecord:
    caps = [c for c in rec.captions if c and c.strip()]
    preds = tuple(r.predicate for r in rec.relations)
    masks = sum(len(str((i.mask_rle or {}).get("counts", ""))) for i in rec.instances)
    return SampleRecord(caps, len(rec.instances), len(rec.relations), preds, len(rec.phrases), masks,
                        len(str(rec.image or "")))


def _count(records, kind: str, skip_images: set[str] = frozenset(), skip_captions: int = 0) -> DatasetSize:
    images = captions = 0
    sample: list[SampleRecord] = []
    texts: list[SampleRecord] = []
    for rec in records:
        if rec.image and Path(str(rec.image)).name in skip_images:
            continue
        if any(i is None for i, _ in rec.problems):  # the reader already rejects the whole record
            continue
        s = _sample(rec)
        images += 1
        captions += len(s.captions)
        if len(sample) < SAMPLE_RECORDS:
            sample.append(s)
        if len(texts) < TEXT_RECORDS:
            texts.append(SampleRecord(s.captions))
    return DatasetSize(images, captions, f"counted by the {kind} reader", exact=False, sample=sample, text_sample=texts)


def plan_dataset(manifest, output: Path):
    """The dataset `pipeline plan` reads records of: the manifest's, except a generated dataset too
    large to generate for a plan, for which a generated sample of :data:`TEXT_SAMPLE_GENERATED`
    images of the same parameters (cached under ``<output>/_cache/plan/``)."""
    ds = manifest.dataset
    if ds.kind != "synthetic" or ds.synthetic.n_images <= GENERATE_MAX:
        return ds
    sample_ds = ds.model_copy(deep=True)
    sample_ds.synthetic.n_images = TEXT_SAMPLE_GENERATED
    sample_ds.synthetic.corrupt_images = sample_ds.synthetic.empty_captions = 0
    sample_ds.synthetic.root = str(output / "_cache" / "plan" / "synthetic-sample")
    return sample_ds


def count_dataset(manifest, output: Path) -> DatasetSize:
    """Count the manifest's dataset by its reader (see the module docstring)."""
    from pipeline.readers import read_dataset, synthetic_root

    ds = manifest.dataset
    if ds.kind != "synthetic":
        size = _count(read_dataset(ds, output, defer_masks=True), ds.kind)
        size.note = "images before ingest's image checks (unreadable images are rejected there)"
        return size
    s = ds.synthetic
    if s.n_images <= GENERATE_MAX:  # generated as ingest would (cached by its parameters), then read back
        records = read_dataset(ds, output, defer_masks=True)
        params = json.loads((synthetic_root(ds, output) / "_params.json").read_text())
        broken = {Path(p).name for p in params.get("corrupt_images", [])}
        size = _count(records, "synthetic (COCO)", broken)
        size.exact = True
        size.source = "counted by the synthetic (COCO) reader"
        return size
    # Too large to generate for a plan: a generated sample gives the per-image shapes, the
    # generator's parameters the counts (blank captions can fall on broken images: +- that many).
    from pipeline.synthetic.generate import captions_of

    sample_ds = plan_dataset(manifest, output)
    sampled = _count(read_dataset(sample_ds, output, defer_masks=True), "synthetic")
    images = s.n_images - s.corrupt_images
    n_text = min(s.n_images, TEXT_RECORDS)  # the text alone, as the generator writes it (no image rendered to disk)
    texts = [SampleRecord(c) for c in captions_of(n_text, s.seed, s.image_size, s.captions_per_image, s.min_objects,
                                                  s.max_objects, s.vocabulary, s.twins)]
    return DatasetSize(images, images * s.captions_per_image - s.empty_captions, "generator parameters",
                       exact=s.empty_captions == 0, sample=sampled.sample, text_sample=texts,
                       note=f"per-image shapes from a generated sample of {TEXT_SAMPLE_GENERATED} images, "
                            f"captions of its first {n_text:,}")


def read_captions(path: str | Path) -> list[str]:
    """Captions of a text file (one per line) or a JSON file: a list or a dict of items holding
    ``caption`` (SugarCrepe's layout; its positives are COCO val2017 captions) or of strings."""
    p = Path(path)
    if p.suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        items = data.values() if isinstance(data, dict) else data
        out = [x["caption"] if isinstance(x, dict) else x for x in items]
    else:
        out = p.read_text(encoding="utf-8").splitlines()
    out = [c.strip() for c in out if isinstance(c, str) and c.strip()]
    if not out:
        raise ValueError(f"{path}: no captions found")
    return out


def given_size(images: int, captions_per_image: float, captions: list[str], words_per_caption: float | None = None,
               instances: float = 0.0) -> DatasetSize:
    """A dataset not on this machine: ``images``, its captions per image and sample ``captions`` of the
    same kind (their tokens, nouns and n-grams stand for the dataset's). ``words_per_caption``: join
    consecutive sample captions and cut them to that many words (longer alt-texts, CC12M)."""
    if words_per_caption:
        target = max(1, round(words_per_caption))
        pool = " ".join(c.rstrip(". ") + "," for c in captions).split()
        captions = [" ".join(pool[i:i + target]).rstrip(",") + "." for i in range(0, len(pool) - target + 1, target)]
    per = max(1, round(captions_per_image))
    texts = [SampleRecord(captions[i:i + per]) for i in range(0, min(len(captions), TEXT_RECORDS * per) - per + 1, per)]
    recs = [SampleRecord(r.captions, instances=round(instances)) for r in texts[:SAMPLE_RECORDS]]
    words = sum(len(c.split()) for r in recs for c in r.captions) / max(1, sum(len(r.captions) for r in recs))
    return DatasetSize(images, round(images * captions_per_image), "given", exact=False, sample=recs, text_sample=texts,
                       note=f"{captions_per_image:g} captions/image; per-caption shapes from {len(recs) * per} sample "
                            f"captions, {words:.1f} words each on average")
