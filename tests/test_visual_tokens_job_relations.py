"""Generated relations are directed in the rank matrix (issue: left/right became the undirected
PSG ``beside``): a scene and its subject/object swap give different rank matrices under the
generated data's vocabulary (``psg56+left``), for every generated predicate; the PSG mapping of real
data is unchanged (there left/right still merge into ``beside``)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.models.relations import scores_from_relations
from pipeline.synthetic.scene import INVERSE, PREDICATES
from pipeline.visual_tokens.graph import build_graph
from pipeline.visual_tokens.predicates import (
    DEFAULT_PREDICATE_MAP,
    PSG_PREDICATES,
    PredicateMapper,
    default_vocabulary,
    resolve_vocabulary,
)

BOXES = np.array([[0, 0, 10, 10], [20, 0, 30, 10]], float)


def _ranks(vocab_name: str, pred: str, swap: bool) -> np.ndarray:
    """Ranks of a 2-object scene stated the way the generator states it (both ordered pairs):
    subject 0 --pred--> object 1 and 1 --INVERSE[pred]--> 0; ``swap`` exchanges the roles."""
    vocab = resolve_vocabulary(vocab_name)
    mp = PredicateMapper(vocab, DEFAULT_PREDICATE_MAP)
    s, o = (1, 0) if swap else (0, 1)
    S, unmapped = scores_from_relations(2, len(vocab), [s, o], [o, s], [pred, INVERSE[pred]], mp)
    assert unmapped == 0
    return build_graph(np.ones(2), S, BOXES).ranks


@pytest.mark.parametrize("pred", PREDICATES)
def test_swapped_generated_scenes_give_different_rank_matrices(pred):
    a, b = _ranks("psg56+left", pred, False), _ranks("psg56+left", pred, True)
    assert a.shape == b.shape == (4, 4)  # image feature, 2 objects, 1 predicate
    assert not np.array_equal(a, b)
    # exactly one node -> node 7, from the subject of the (mapped) relation to its object
    assert (a[1:3, 1:3] == 7).sum() == 1 and (b[1:3, 1:3] == 7).sum() == 1
    assert a[1:3, 1:3].T.tolist() == b[1:3, 1:3].tolist()


def test_psg_mapping_of_real_data_is_kept():
    assert default_vocabulary("synthetic") == "psg56+left" and default_vocabulary("coco") == "psg56"
    left = resolve_vocabulary("psg56+left")
    assert left[:56] == PSG_PREDICATES and left[56] == "left of"  # PSG indices unchanged
    psg = PredicateMapper(PSG_PREDICATES, DEFAULT_PREDICATE_MAP)
    beside = PSG_PREDICATES.index("beside")
    assert psg("left of") == (beside, False) and psg("right of") == (beside, False)
    lr = PredicateMapper(left, DEFAULT_PREDICATE_MAP)
    assert lr("left of") == (56, False) and lr("right of") == (56, True) and lr("next to") == (beside, False)
    # under PSG a left/right scene and its swap are indistinguishable (the reason for psg56+left)
    np.testing.assert_array_equal(_ranks("psg56", "left of", False), _ranks("psg56", "left of", True))
