"""``scene-oracle``: the testbed's frozen encoder, a measuring instrument for the generated dataset.

The built-in ``tiny-random`` models carry no meaning, so nothing the stages write from them lets a
trainer learn anything. On the *generated* scene dataset (``dataset.kind: synthetic``) the scenes'
ground truth is known, and ``scene-oracle`` may stand for any frozen encoder of a stage
(``models.clip``, ``models.groupvit``, ``models.sam``, ``models.detector``,
``models.word_encoder``): it computes the features such an encoder would ideally give, from the
samples artifact's ``instances`` table (box, shape, colour, size) and from the caption's words.
It is registered beside the Hugging Face adapters and runs through the same stages, artifacts,
loaders, jobs and harness as a real checkpoint; only the encoder is an instrument. Every stage that
uses it records ``testbed_instrument: true`` in ``_manifest.json`` and logs it, and every stage
refuses it on any other dataset kind (:func:`require_generated`).

What the features carry (one embedding table per side, seeded; the same object or word always
maps to the same vector, a sample's noise is drawn from ``[seed, sample_id]``):

* an object: ``Ev[colour] + Ev[shape]`` (+ noise). Patch tokens on a ``grid x grid`` layout hold the
  objects covering each cell; a region / mask / group feature is the object's own vector.
* a word: ``Et[word]`` (a synonym of the ``large`` caption vocabulary reads as its concept's word,
  :mod:`pipeline.synthetic.lexicon`); a colour word adds ``bind * Ctx[next shape]`` and a shape word
  ``bind * Ctx[previous colour]``, so attribute *binding* lives at the token level, as in a
  contextual text encoder; any word outside the scenes' vocabulary gets a fixed vector of its own.
* pooled embeddings: a weak copy of the bag of (colour, shape) words or objects, plus noise; the text
  noise is a function of the whole text, so a caption and its word-order swap get unrelated noise.

So a trained local scorer can find objects, attributes and their binding (SugarCrepe replace/swap
of attributes, ARO VG-Attribution, VL-CheckList Att/Obj), while word order (ARO VG-Relation, COCO
order, Winoground) is in no feature and must stay at chance. The job documentation says so per
benchmark (docs/testbed.md).
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

SPEC = "scene-oracle"
NOTE = "scene-oracle: features computed from the generated scenes' ground truth (a testbed instrument, not a model)"


def is_oracle(spec) -> bool:
    return isinstance(spec, str) and spec.strip().lower() == SPEC


def oracle_roles(models) -> list[str]:
    """The ``models.<role>`` of a manifest (its ``models`` section) that are the scene-oracle."""
    return [role for role, spec in (models.model_dump() if hasattr(models, "model_dump") else dict(models)).items()
            if is_oracle(spec)]


def provenance_line(roles: list[str], indent: str = "") -> str:
    """What a run's summary prints when its features come from the instrument, not from pixels
    (wrapped at 100 columns)."""
    import textwrap

    text = (f"features: scene-oracle for {', '.join(roles)}: computed from the generated scenes' ground truth, "
            "not from pixels (a testbed instrument, not a trained encoder: docs/testbed.md)")
    return textwrap.fill(text, 100, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False)


def require_generated(manifest, role: str) -> None:
    """One line, raised before any work, when ``scene-oracle`` is asked for outside the generated
    dataset: the kind the ``samples`` artifact was ingested from (its ``_manifest.json``
    ``dataset_kind``, what the stage reads), else, before ingest, the manifest's ``dataset.kind``."""
    from pipeline.errors import StageError

    kind, where = _ingested_kind(manifest)
    if where is None:
        kind = getattr(getattr(manifest, "dataset", None), "kind", None)
    if kind != "synthetic":
        said = f"the samples artifact ({where}) was ingested from dataset.kind {kind!r}" if where else \
            f"this manifest's dataset.kind is {kind!r}"
        raise StageError(
            f"models.{role}: scene-oracle is a testbed instrument for the generated dataset (dataset.kind: synthetic); "
            f"{said}: give a real checkpoint"
        )


def _ingested_kind(manifest) -> tuple[str | None, str | None]:
    """(``dataset_kind`` of the output's samples artifact, its _manifest.json's path); (None, None)
    when there is no finished samples artifact or it does not record one."""
    from pipeline.io import storage
    from pipeline.io.artifacts import Artifact

    output = getattr(manifest, "output", None)
    if not output:
        return None, None
    try:
        art = Artifact(storage.join(storage.normalize(output), "samples"))
        kind = art.manifest.get("dataset_kind")
    except (OSError, ValueError, AttributeError):  # missing (ArtifactMissing is an OSError), unreadable
        return None, None
    return (kind, storage.join(art.location, "_manifest.json")) if kind else (None, None)


def record(role: str, **extra) -> dict:
    """The provenance record of a stage's oracle model (``_manifest.json`` ``models``)."""
    from pipeline.models.provenance import model_record

    log.warning("TESTBED INSTRUMENT: models.%s is %s", role, NOTE)
    return model_record(role, SPEC, random_weights=False, weights_sha256=None, testbed_instrument=True, note=NOTE, **extra)


def _words(text: str) -> list[str]:
    """The lower-cased words of a text, each synonym of the generated captions' ``large`` vocabulary
    ("crimson", "disc", "tiny", "spotted") read as its concept's canonical word
    (:data:`pipeline.synthetic.lexicon.CONCEPT_OF`; the canonical words map to themselves)."""
    from pipeline.synthetic.lexicon import concept

    out = []
    for w in text.split():
        w = w.strip(".,:;!?\"'()").lower()
        if w:
            out.append(concept(w))
    return out


@dataclass
class SceneObject:
    shape: str
    color: str
    size: str
    box: tuple  # x0, y0, x1, y1 in pixels


def objects_of(instances: list[dict]) -> list[SceneObject]:
    """The scene objects of a sample from its ``instances`` rows (category = shape; attributes JSON)."""
    out = []
    for inst in instances:
        attrs = inst.get("attributes") or {}
        if isinstance(attrs, str):
            attrs = json.loads(attrs) if attrs.strip() else {}
        out.append(SceneObject(str(inst["category"]), str(attrs.get("color", "")), str(attrs.get("size", "")),
                               tuple(float(v) for v in inst["box"])))
    return out


@dataclass
class SceneOracle:
    """The embedding tables and feature rules; every parameter is recorded in provenance."""

    d_v: int = 32
    d_t: int = 24
    proj: int = 16
    grid: int = 4
    seed: int = 0
    global_signal: float = 0.5
    noise: float = 0.6
    bind: float = 0.7
    text_noise: float = 0.3
    token_noise: float = 0.1
    vocab: dict = field(init=False, repr=False)

    def __post_init__(self):
        from pipeline.synthetic.scene import COLOR_NAMES, PLURALS, SHAPES, SIZE_NAMES

        self.colors, self.shapes = list(COLOR_NAMES), list(SHAPES)
        self.shape_of = {**{s: s for s in SHAPES}, **{p: s for s, p in PLURALS.items()}}
        words = self.colors + self.shapes + list(SIZE_NAMES) + ["<bos>", "<eos>"]
        self.vocab = {w: i for i, w in enumerate(words)}
        rng = np.random.default_rng([self.seed, 1729])
        n = len(words)
        self.Ev = (rng.normal(size=(n, self.d_v)) / np.sqrt(self.d_v)).astype(np.float32)
        self.Et = (rng.normal(size=(n, self.d_t)) / np.sqrt(self.d_t)).astype(np.float32)
        self.Ctx = (rng.normal(size=(n, self.d_t)) / np.sqrt(self.d_t)).astype(np.float32)
        self.Gv = (rng.normal(size=(n, self.proj)) / np.sqrt(self.proj)).astype(np.float32)
        self.Gt = self.Gv  # the pooled spaces are shared: the pooled score is a weak bag-of-concepts match

    def params(self) -> dict:
        return {k: getattr(self, k) for k in ("d_v", "d_t", "proj", "grid", "seed", "global_signal", "noise", "bind",
                                              "text_noise", "token_noise")}

    # --- image side -------------------------------------------------------------------------
    def sample_rng(self, sample_id: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, 7, int(sample_id)])

    def object_vector(self, o: SceneObject) -> np.ndarray:
        v = np.zeros(self.d_v, np.float32)
        for w in (o.color, self.shape_of.get(o.shape, o.shape)):
            if w in self.vocab:
                v += self.Ev[self.vocab[w]]
        return v

    def object_vectors(self, objects: list[SceneObject], rng: np.random.Generator, noise: float | None = None) -> np.ndarray:
        """[n, d_v]: each object's vector plus noise (a region's / mask's / group's feature)."""
        noise = self.noise if noise is None else noise
        out = np.zeros((len(objects), self.d_v), np.float32)
        for i, o in enumerate(objects):
            out[i] = self.object_vector(o)
        return out + noise * rng.normal(size=out.shape).astype(np.float32) / np.sqrt(self.d_v)

    def object_bag(self, objects: list[SceneObject]) -> np.ndarray:
        bag = np.zeros(self.proj, np.float32)
        for o in objects:
            for w in (o.color, self.shape_of.get(o.shape, o.shape)):
                if w in self.vocab:
                    bag += self.Gv[self.vocab[w]]
        return bag

    def cells(self, box, width: float, height: float) -> list[int]:
        """The grid cells a box covers by at least a quarter, and always the cell of its centre."""
        g = self.grid
        cw, ch = width / g, height / g
        x0, y0, x1, y1 = box
        out = set()
        for r in range(g):
            for q in range(g):
                ix = max(0.0, min(x1, (q + 1) * cw) - max(x0, q * cw))
                iy = max(0.0, min(y1, (r + 1) * ch) - max(y0, r * ch))
                if ix * iy >= 0.25 * cw * ch:
                    out.add(r * g + q)
        cx, cy = min(g - 1, max(0, int(((x0 + x1) / 2) // cw))), min(g - 1, max(0, int(((y0 + y1) / 2) // ch)))
        out.add(cy * g + cx)
        return sorted(out)

    def image(self, objects: list[SceneObject], width: float, height: float, sample_id: int):
        """(patch tokens [grid*grid, d_v], pooled image embedding [proj]) of one scene."""
        rng = self.sample_rng(sample_id)
        v = self.noise * rng.normal(size=(self.grid * self.grid, self.d_v)).astype(np.float32) / np.sqrt(self.d_v)
        for o in objects:
            vec = self.object_vector(o)
            for c in self.cells(o.box, width, height):
                v[c] += vec
        emb = self.global_signal * self.object_bag(objects) + rng.normal(size=self.proj).astype(np.float32) / np.sqrt(self.proj)
        return v, emb.astype(np.float32)

    # --- text side --------------------------------------------------------------------------
    def _other(self, w: str, dim: int) -> np.ndarray:
        return (np.random.default_rng(zlib.crc32(("w:" + w).encode())).normal(size=dim) / np.sqrt(dim)).astype(np.float32)

    def word_vector(self, words: list[str], j: int) -> np.ndarray:
        """The contextual feature [d_t] of word ``j`` of a word list (binding to its neighbours); synonyms
        read as their concept's word, as in :func:`_words`."""
        from pipeline.synthetic.lexicon import concept

        words = [concept(x) for x in words]
        w = words[j]
        s = self.shape_of.get(w)
        if w in self.vocab and w not in ("<bos>", "<eos>"):
            t = self.Et[self.vocab[w]].copy()
        elif s is not None:
            t = self.Et[self.vocab[s]].copy()
        else:
            t = self._other(w, self.d_t)
        if w in self.colors:
            nxt = [self.shape_of[x] for x in words[j + 1: j + 3] if x in self.shape_of]
            if nxt:
                t += self.bind * self.Ctx[self.vocab[nxt[0]]]
        if s is not None:
            prev = [x for x in words[max(0, j - 2): j] if x in self.colors]
            if prev:
                t += self.bind * self.Ctx[self.vocab[prev[-1]]]
        return t

    def text(self, text: str):
        """(tokens [M, d_t] with <bos> and <eos>, pooled [proj]) of any text; a function of the text."""
        rng = np.random.default_rng(zlib.crc32(text.encode()))
        ws = _words(text)
        toks = [self.Et[self.vocab["<bos>"]]]
        bag = np.zeros(self.proj, np.float32)
        for j, w in enumerate(ws):
            t = self.word_vector(ws, j)
            s = self.shape_of.get(w)
            if w in self.colors:
                bag += self.Gt[self.vocab[w]]
            if s is not None:
                bag += self.Gt[self.vocab[s]]
            toks.append(t + self.token_noise * rng.normal(size=self.d_t).astype(np.float32) / np.sqrt(self.d_t))
        toks.append(self.Et[self.vocab["<eos>"]])
        emb = self.global_signal * bag + self.text_noise * rng.normal(size=self.proj).astype(np.float32) / np.sqrt(self.proj)
        return np.stack(toks).astype(np.float32), emb.astype(np.float32)

    def span_vector(self, text: str, start: int, end: int) -> np.ndarray:
        """The contextual feature [d_t] of the character span [start, end) of ``text`` (mean over its words)."""
        head = _words(text[:start])
        span = _words(text[start:end])
        ws = head + span + _words(text[end:])
        if not span:
            return np.zeros(self.d_t, np.float32)
        return np.mean([self.word_vector(ws, len(head) + i) for i in range(len(span))], axis=0).astype(np.float32)


# --- as a CLIP (models.clip: scene-oracle) ------------------------------------------------------


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class OracleClip:
    """The oracle in CLIP's place: ``pipeline.models.clip`` dispatches to it (``load_clip``,
    ``encode_texts``, ``dims``) and ``extract-clip-tokens`` calls :meth:`encode_records` on a batch
    of records carrying their ``scene``. Tokens are one per word (BOS .. EOS, as CLIP's), with each
    word's character span as its offset; ``input_ids`` index the scenes' vocabulary (others -1)."""

    is_scene_oracle = True

    def __init__(self, oracle: SceneOracle | None = None):
        self.oracle = oracle or SceneOracle()
        o = self.oracle
        self.config = _Cfg(projection_dim=o.proj, text_config=_Cfg(hidden_size=o.d_t),
                           vision_config=_Cfg(hidden_size=o.d_v, image_size=o.grid, patch_size=1))

    def dims(self) -> dict:
        o = self.oracle
        return {"image_size": o.grid, "patch_size": 1, "n_patches": o.grid * o.grid, "vision_dim": o.d_v,
                "text_dim": o.d_t, "projection_dim": o.proj}

    def record(self) -> dict:
        return {**record("clip", oracle=self.oracle.params()), **self.dims()}

    def encode_records(self, records: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(patch tokens float16 [grid^2, d_v], pooled float16 [proj]) per record (``record["scene"]``)."""
        out = []
        for r in records:
            patches, pooled = self.oracle.image(objects_of(r.get("scene") or []), float(r.get("width") or 1),
                                                float(r.get("height") or 1), int(r["sample_id"]))
            out.append((patches.astype(np.float16), pooled.astype(np.float16)))
        return out

    def encode_texts(self, texts, max_tokens: int = 48, project_tokens: bool = False, return_offsets: bool = False) -> dict:
        """What :func:`pipeline.models.clip.encode_texts` returns, as torch tensors."""
        import re

        import torch

        if project_tokens:
            raise ValueError("models.clip: scene-oracle has no joint token space (project_tokens must be false)")
        o = self.oracle
        enc, spans = [], []
        for text in texts:
            tok, emb = o.text(text)
            words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text) if m.group().strip(".,:;!?\"'()")]
            if len(tok) > max_tokens:  # truncate, keeping the EOS, as CLIP's tokenizer does
                tok = np.concatenate([tok[: max_tokens - 1], tok[-1:]])
                words = words[: max_tokens - 2]
            enc.append((tok, emb))
            spans.append([(0, 0)] + words + [(0, 0)])
        M = max((len(t) for t, _ in enc), default=0)
        B = len(enc)
        tokens = torch.zeros(B, M, o.d_t)
        mask = torch.zeros(B, M, dtype=torch.bool)
        ids = torch.zeros(B, M, dtype=torch.long)
        offsets = torch.zeros(B, M, 2, dtype=torch.long)
        for i, ((t, _), sp) in enumerate(zip(enc, spans)):
            tokens[i, : len(t)] = torch.from_numpy(t)
            mask[i, : len(t)] = True
            offsets[i, : len(t)] = torch.tensor(sp, dtype=torch.long)
            ws = ["<bos>"] + [w for a, b in sp[1:-1] for w in _words(texts[i][a:b])] + ["<eos>"]
            ids[i, : len(t)] = torch.tensor([o.vocab.get(o.shape_of.get(w, w), -1) for w in ws], dtype=torch.long)
        out = {"text_tokens": tokens, "text_embed": torch.from_numpy(np.stack([e for _, e in enc])) if B else torch.zeros(0, o.proj),
               "text_mask": mask, "input_ids": ids}
        if return_offsets:
            out["offsets"] = offsets
        return out
