"""What the frozen-encoder jobs share (``clip-encoder``, ``mlm-encoder``): the ``samples`` artifact
read into memory, and the hub-layout export.

The encoders the pipeline's stages load (``models.clip``, ``models.mlm``, ...) are trained here from
pixels and words of the *training* split only (:func:`load_corpus` returns the splits; the jobs train
on ``train_splits`` and measure themselves on ``eval_splits``). Each exports what a published
checkpoint holds, with ``save_pretrained`` (``config.json``, ``model.safetensors``, tokenizer and
processor files), into ``<output>/encoders/<name>/`` (:func:`export_dir`), so a manifest points a model
slot at the folder (``clip: "{output}/encoders/clip"``) and the stages load it through their ordinary
adapters, as any Hugging Face checkpoint, with no project code in the loop.

:func:`export_folder` writes the folder beside its destination and renames it into place, so a crash
never leaves a half-written checkpoint where a manifest points.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Corpus:
    """The samples artifact in memory: per sample its id, split and absolute image reference; the
    captions (id, sample, text); the ground-truth instances' colours and shapes per sample where the
    artifact has an ``instances`` table (the generated dataset: used to label zero-shot probes)."""

    sample_ids: np.ndarray                    # int64 [S]
    splits: np.ndarray                        # object [S]
    images: list[str | None]                  # [S] absolute refs
    caption_ids: np.ndarray                   # int64 [C]
    caption_sample: np.ndarray                # int64 [C] sample_id of each caption
    texts: list[str]                          # [C]
    colors: dict[int, set] = field(default_factory=dict)   # sample_id -> colours of its objects
    shapes: dict[int, set] = field(default_factory=dict)   # sample_id -> shapes of its objects
    masks: dict[int, list] = field(default_factory=dict)   # sample_id -> [COCO RLE of each instance]

    def ids_in(self, splits) -> np.ndarray:
        return self.sample_ids[np.isin(self.splits, list(splits))]

    def captions_of(self, sample_ids) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(caption ids, their sample ids, texts) of the captions of ``sample_ids``, in caption order."""
        keep = np.isin(self.caption_sample, np.asarray(sample_ids, np.int64))
        idx = np.nonzero(keep)[0]
        return self.caption_ids[idx], self.caption_sample[idx], [self.texts[i] for i in idx]


def load_corpus(manifest, rel: str = "samples", job: str = "") -> Corpus:
    """The samples artifact at ``rel`` (under the manifest's output) read into a :class:`Corpus`."""
    from pipeline.loaders.samples import image_resolver
    from train.job import Splits, open_artifact, resolve_artifact

    from pipeline.config import CORPUS_DIR

    try:
        art = open_artifact(manifest, rel, "samples", job)
    except FileNotFoundError as e:
        if Path(rel).parts[:1] != (CORPUS_DIR,):
            raise
        raise FileNotFoundError(str(e).replace("`pipeline run ingest`", "`pipeline run ingest --corpus` (the manifest's "
                                                "pretraining corpus)")) from None
    t = art.read("samples", ["sample_id", "image", "split"])
    sids = np.asarray(t["sample_id"].to_numpy(), np.int64)
    resolve = image_resolver(resolve_artifact(manifest, rel), manifest)
    images = [resolve(r) for r in t["image"].to_pylist()]
    splits = Splits(art).of_many(sids)
    c = art.read("captions", ["caption_id", "sample_id", "text"])
    corpus = Corpus(sids, splits, images, np.asarray(c["caption_id"].to_numpy(), np.int64),
                    np.asarray(c["sample_id"].to_numpy(), np.int64), [str(x or "") for x in c["text"].to_pylist()])
    if "instances" in art.tables():
        it = art.read("instances", ["sample_id", "category", "attributes", "mask_rle"])
        for sid, cat, attrs, rle in zip(it["sample_id"].to_pylist(), it["category"].to_pylist(),
                                        it["attributes"].to_pylist(), it["mask_rle"].to_pylist()):
            a = json.loads(attrs) if attrs else {}
            if a.get("color"):
                corpus.colors.setdefault(int(sid), set()).add(a["color"])
            if cat:
                corpus.shapes.setdefault(int(sid), set()).add(cat)
            if rle:
                corpus.masks.setdefault(int(sid), []).append(json.loads(rle) if isinstance(rle, str) and rle.startswith("{") else rle)
    if not len(corpus.ids_in(["train"])) and not len(sids):
        raise ValueError(f"{job}: the samples artifact has no samples")
    return corpus


def images_in_common(manifest, rel_a: str, rel_b: str) -> dict:
    """What two samples artifacts (``rel_a``, ``rel_b`` under the manifest's output, e.g. the testbed's ``samples`` and
    the pretraining corpus's ``corpus/samples``) share: ``ids`` the source ids (image ids) in both, ``pixels`` the
    SHA-256 of the decoded RGB pixels (as the encoders decode them) in both, and ``n`` each artifact's images."""
    import hashlib

    from pipeline.loaders.samples import image_resolver
    from pipeline.readers.images import open_image
    from train.job import open_artifact, resolve_artifact

    ids, hashes, n = [], [], []
    for rel in (rel_a, rel_b):
        t = open_artifact(manifest, rel, "samples").read("samples", ["source_id", "image"])
        resolve = image_resolver(resolve_artifact(manifest, rel), manifest)
        refs = [resolve(r) for r in t["image"].to_pylist()]
        ids.append({str(x) for x in t["source_id"].to_pylist()})
        hashes.append({hashlib.sha256(np.asarray(open_image(r)).tobytes()).hexdigest() for r in refs if r})
        n.append(len(refs))
    return {"ids": sorted(ids[0] & ids[1]), "pixels": sorted(hashes[0] & hashes[1]), "n": n}


def load_pixels(refs: list[str | None], processor) -> "torch.Tensor":  # noqa: F821
    """pixel_values [N, 3, H, W] of the images at ``refs``, decoded as the image stages decode them
    (:func:`pipeline.readers.images.open_image`: RGB) and prepared by ``processor`` (the one exported)."""
    import torch

    from pipeline.readers.images import open_image

    out = []
    for s in range(0, len(refs), 128):
        chunk = []
        for r in refs[s : s + 128]:
            if not r:
                raise ValueError("a sample without an image reference: the encoder jobs need every training image")
            chunk.append(open_image(r))
        out.append(processor(images=chunk, return_tensors="pt")["pixel_values"])
    return torch.cat(out) if out else torch.zeros(0)


def export_dir(manifest, name: str, control: str = "none", override: str | None = None) -> Path:
    """Where an encoder job exports: ``override``, else ``<output>/encoders/<name>`` (a control run:
    ``<name>-shuffled``, never the folder the manifest's stages load)."""
    from pipeline.models.required import encoder_export_dir

    return encoder_export_dir(manifest.output, name, control, override)


def export_folder(dest: Path, model, *savers, provenance: dict | None = None, write=None) -> bool:
    """``save_pretrained`` of ``model`` and each of ``savers`` (tokenizer, processor) into ``dest``, written
    in a temporary folder beside it and renamed into place (an older export is replaced whole).
    ``provenance`` goes to ``dest/training.json`` (what trained it: job, config, data, metrics) with the
    hash of the weights: a re-evaluation of the same model leaves an identical export untouched (a
    rewrite would change the files' mtimes, and with them the fingerprints of every artifact made
    from the folder). ``write(folder)``: writes the model instead of its ``save_pretrained`` (a model of
    another library: sam-segmenter's SAM folder, :func:`pipeline.models.sam_checkpoint.write_sam_folder`).
    Returns whether it wrote."""
    from pipeline.models.provenance import state_dict_hash

    dest = Path(dest)
    digest = state_dict_hash(model)
    try:
        if json.loads((dest / "training.json").read_text()).get("weights_state_sha256") == digest:
            return False
    except (OSError, ValueError, AttributeError):
        pass
    provenance = {**(provenance or {}), "weights_state_sha256": digest}
    savers = savers if write is not None else (model, *savers)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        if write is not None:
            write(tmp)
        for s in savers:
            s.save_pretrained(str(tmp))
        (tmp / "training.json").write_text(json.dumps(provenance, indent=1, default=str))
        old = None
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True

