"""Loading a Hugging Face model folder (or cached hub id) so that a half-right one is refused, not used.

``from_pretrained`` quietly does three wrong things with a damaged folder: it initialises at random
every weight the config asks for and the weight file lacks (a layer added to ``config.json``), drops
weights it has no place for, and builds a tokenizer of a few words when the tokenizer files are
missing (every word then becomes the unknown token). :func:`load_model` and :func:`load_tokenizer`
refuse each in one line naming the folder and the file at fault; :func:`check_folder` names a Git LFS
pointer file as one (a clone without ``git lfs pull``). The library's load report and warnings go
to the run's log file, never the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

from pipeline.errors import StageError, shorten

log = logging.getLogger("pipeline")

LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
# A model's embedding may have more rows than its tokenizer has tokens (padded to a multiple of 64 or
# 128 for speed); never fewer (ids past the table), nor far more (a tokenizer of another model, or
# one rebuilt from nothing).
VOCAB_PADDING = 128


class ModelFolderError(StageError):
    """A model folder that would load wrong; the message names the folder and the file."""


def _local(spec: str) -> Path | None:
    p = Path(str(spec)).expanduser()
    return p if p.is_dir() else None


def check_folder(spec: str) -> None:
    """Refuse a local folder holding a Git LFS pointer in place of any of its files."""
    folder = _local(spec)
    if folder is None:
        return
    for f in sorted(folder.iterdir()):
        try:
            if f.is_file() and f.stat().st_size < 1024:
                with open(f, "rb") as fh:
                    head = fh.read(len(LFS_POINTER))
                if head == LFS_POINTER:
                    raise ModelFolderError(f"model folder {folder}: {f.name} is a Git LFS pointer, not the file; "
                                           f"run `git lfs pull` in the clone")
        except OSError:
            continue


@contextlib.contextmanager
def report_to_log():
    """The library's messages while loading (its LOAD REPORT table, progress bars' warnings, Python
    warnings) go to the run's log (logger ``pipeline.models.load``, DEBUG), not the terminal."""
    from transformers.utils import logging as hf_logging

    lib = logging.getLogger("transformers")
    target = logging.getLogger("pipeline.models.load")

    class Forward(logging.Handler):
        def emit(self, record):
            target.debug("%s", record.getMessage())

    saved, propagate = lib.handlers[:], lib.propagate
    lib.propagate = False  # another library may have turned transformers' propagation on
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    for h in saved:
        lib.removeHandler(h)
    fwd = Forward()
    lib.addHandler(fwd)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            target.debug("%s: %s", w.category.__name__, w.message)
    finally:
        lib.removeHandler(fwd)
        lib.propagate = propagate
        for h in saved:
            lib.addHandler(h)
        if progress:
            hf_logging.enable_progress_bar()


def _weights_name(spec: str) -> str:
    folder = _local(spec)
    if folder is not None:
        for name in WEIGHT_FILES:
            if (folder / name).is_file():
                return name
    return "the weight file"


def _keys(keys) -> str:
    keys = sorted(keys)
    return shorten(", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else ""), 200)


def load_model(cls, spec: str, unused: tuple[str, ...] = (), **kwargs):
    """``cls.from_pretrained(spec)``, refusing a folder whose weights do not fill the model its
    ``config.json`` describes (missing weights would be random) or hold weights it has no place for.
    ``unused``: key prefixes of parts the caller never runs (a ``BertModel``'s pooler, absent from a
    masked-LM checkpoint): missing there is allowed, those parts' outputs are never read. When
    ``unused`` is given, ``cls`` is a body loaded from a checkpoint with a task head (``AutoModel``
    from a masked LM): weights outside the body's own modules (the head) are dropped on purpose."""
    check_folder(spec)
    with report_to_log():
        model, info = cls.from_pretrained(spec, output_loading_info=True, **kwargs)
    where = f"model folder {spec}" if _local(spec) else f"model {spec!r}"
    missing = [k for k in info.get("missing_keys") or [] if not any(k.startswith(p) for p in unused)]
    if missing:
        raise ModelFolderError(
            f"{where}: {_weights_name(spec)} lacks {len(missing)} weight(s) that config.json asks for ({_keys(missing)}): "
            "they would be random; use the config.json saved with these weights")
    unexpected = list(info.get("unexpected_keys") or [])
    if unused:
        body = {name for name, _ in model.named_children()}
        prefix = f"{getattr(model, 'base_model_prefix', '')}."
        unexpected = [k for k in unexpected if k.removeprefix(prefix).split(".")[0] in body]
    if unexpected:
        raise ModelFolderError(
            f"{where}: {_weights_name(spec)} holds {len(unexpected)} weight(s) the model of config.json has no place "
            f"for ({_keys(unexpected)}): they would be dropped; use the config.json saved with these weights")
    mismatched = list(info.get("mismatched_keys") or [])
    if mismatched:
        names = [m[0] if isinstance(m, (tuple, list)) else str(m) for m in mismatched]
        raise ModelFolderError(f"{where}: {_weights_name(spec)} has {len(names)} weight(s) of another shape than "
                               f"config.json's ({_keys(names)}); use the config.json saved with these weights")
    return model


def load_tokenizer(spec: str, vocab_size: int | None, cls=None):
    """``AutoTokenizer.from_pretrained(spec)`` (or ``cls``), refusing one whose vocabulary does not
    fit the model's (``vocab_size`` from its config): missing tokenizer files make the library build
    a tokenizer of a few words, and every word becomes the unknown token."""
    if cls is None:
        from transformers import AutoTokenizer as cls
    check_folder(spec)
    with report_to_log():
        tok = cls.from_pretrained(spec)
    n = len(tok)
    if vocab_size is not None and not (n <= vocab_size <= n + VOCAB_PADDING):
        folder = _local(spec)
        present = [f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")
                   if folder is not None and (folder / f).is_file()]
        files = (f"its tokenizer files ({', '.join(present)})" if present
                 else "no tokenizer.json / tokenizer_config.json / vocab file")
        where = f"model folder {folder}" if folder is not None else f"model {spec!r}"
        raise ModelFolderError(
            f"{where}: {files} give a vocabulary of {n:,} tokens, config.json's vocab_size is {vocab_size:,}; "
            "copy in the tokenizer files saved with this model")
    return tok
