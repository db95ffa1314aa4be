"""``dataset.synthetic.vocabulary: large`` (issue 27, cause 2): the same scenes, captions and gold
phrases re-worded with synonyms and paraphrases; the scene oracle reads every synonym as its concept."""
from __future__ import annotations

import json
import re
import types

import numpy as np
import pytest

from pipeline.config import SyntheticConfig
from pipeline.models.scene_oracle import OracleClip, SceneOracle, _words
from pipeline.readers import read_dataset
from pipeline.synthetic.generate import generate
from pipeline.synthetic.scene import PLURALS
from pipeline.synthetic.lexicon import (COLOR_SYNONYMS, CONCEPT_OF, SHAPE_SYNONYMS, SIZE_SYNONYMS,
                                        TEXTURE_SYNONYMS, concept)

PARAMS = dict(n_images=40, seed=5, image_size=64, captions_per_image=5, min_objects=1, max_objects=4)
CONCEPTS = set(CONCEPT_OF.values())


def _read(root, vocabulary):
    syn = SyntheticConfig(**PARAMS, root=str(root), vocabulary=vocabulary)
    return list(read_dataset(types.SimpleNamespace(kind="synthetic", synthetic=syn, split=None), root / "unused"))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    out = {}
    for v in ("small", "large"):
        root = tmp_path_factory.mktemp(v)
        out[v] = (generate(root, **PARAMS, vocabulary=v), _read(root, v))
    return out


def _vocab(recs):
    return {w.strip(".,:").lower() for r in recs for c in r.captions for w in c.split()}


def _concepts(text):
    return sorted(w for w in _words(text) if w in CONCEPTS)


def test_large_vocabulary_same_scenes_more_words(both):
    (ps, small), (pl, large) = both["small"], both["large"]
    # scenes, instances, relations and the hard negatives are the small dataset's
    assert ps["instances"].read_bytes() == pl["instances"].read_bytes()
    for kind in ("swap_att", "replace_att", "replace_obj"):
        assert (ps["sugarcrepe"] / f"{kind}.json").read_text() == (pl["sugarcrepe"] / f"{kind}.json").read_text()
    assert json.loads(pl["params"].read_text())["params"]["vocabulary"] == "large"
    assert "vocabulary" not in json.loads(ps["params"].read_text())["params"]  # the default's params are unchanged
    vs, vl = _vocab(small), _vocab(large)
    assert len(vl) >= 3 * len(vs), (len(vs), len(vl))
    # no synonym is a word of the small grammar (the canonical plurals the oracle already read as their
    # shape aside), so the oracle's reading of small captions is unchanged
    assert not {w for w in vs if concept(w) != w and w not in PLURALS.values()}
    changed = sum(a != b for rs, rl in zip(small, large) for a, b in zip(rs.captions, rl.captions))
    assert changed >= 0.9 * PARAMS["n_images"] * PARAMS["captions_per_image"]


def test_gold_phrases_cover_the_same_objects_and_concepts(both):
    small, large = both["small"][1], both["large"][1]
    n = 0
    for rs, rl in zip(small, large):
        inst = {i.id: i for i in rl.instances}
        ps = sorted(rs.phrases, key=lambda p: (p.caption_index, p.start))
        pls = sorted(rl.phrases, key=lambda p: (p.caption_index, p.start))
        assert [(p.caption_index, p.instance_ids) for p in ps] == [(p.caption_index, p.instance_ids) for p in pls]
        for p, q in zip(ps, pls):
            cap = rl.captions[q.caption_index]
            assert cap[q.start:q.end] == q.text
            # whole words: the span starts and ends at word boundaries
            assert q.start == 0 or not cap[q.start - 1].isalnum()
            assert q.end == len(cap) or not cap[q.end].isalnum()
            # the same concepts (colour, shape, size, texture) as the small phrase, in other words
            assert _concepts(q.text) == _concepts(p.text), (p.text, q.text)
            objs = [inst[i] for i in q.instance_ids]
            for w in _concepts(q.text):
                if w in SHAPE_SYNONYMS:
                    assert w in {o.category for o in objs}, (q.text, w)
                if w in COLOR_SYNONYMS:
                    assert w in {o.attributes["color"] for o in objs}, (q.text, w)
            n += q.text.lower() != p.text.lower()
    assert n > 100
    # the re-worded phrases use the synonyms (not only the canonical words)
    words = {w.lower() for r in large for p in r.phrases for w in re.findall(r"\w+", p.text)}
    assert len(words & {w for w, c in CONCEPT_OF.items() if w != c}) >= 60


def test_oracle_maps_every_synonym_to_its_concept():
    o = SceneOracle()
    for table in (COLOR_SYNONYMS, SIZE_SYNONYMS, TEXTURE_SYNONYMS):
        for canon, syns in table.items():
            for w in syns:
                assert np.array_equal(o.word_vector([w], 0), o.word_vector([canon], 0)), w
    for canon, pairs in SHAPE_SYNONYMS.items():
        for s, p in pairs:
            for w in (s, p):
                assert np.array_equal(o.word_vector([w], 0), o.word_vector([canon], 0)), w
    assert not np.array_equal(o.word_vector(["disc"], 0), o.word_vector(["square"], 0))
    # in context: binding, span features and the CLIP-shaped token ids agree with the canonical caption
    a, b = "The crimson disc is left of a tiny spotted hoop.", "The red circle is left of a small dotted ring."
    wa, wb = _words(a), _words(b)
    assert wa == wb
    for j in range(len(wa)):
        assert np.array_equal(o.word_vector(wa, j), o.word_vector(wb, j))
    assert np.allclose(o.span_vector(a, 4, 16), o.span_vector(b, 4, 14))
    enc = OracleClip(o).encode_texts([a, b])
    assert enc["input_ids"][0].tolist() == enc["input_ids"][1].tolist()
    assert (enc["input_ids"][0] >= 0).sum() >= 6  # <bos>, red, circle, small, ring, <eos> are oracle words
