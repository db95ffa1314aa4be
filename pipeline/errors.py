"""The errors a user sees as one line, and how any exception becomes that line.

Below :mod:`pipeline.runtime` (Ray workers report failures with :func:`describe_exception`),
:mod:`pipeline.stage` (which re-exports these names for the stages) and :mod:`pipeline.models`
(a model that cannot load is a :class:`StageError` naming its manifest key), so that each of them
imports this module and none imports another to reach it.
"""

from __future__ import annotations

import contextlib
import re


class StageError(RuntimeError):
    """A stage cannot run (missing input, bad option); the message is shown as the one-line error."""


class RayStartError(RuntimeError):
    """Ray cannot start or be joined; the message is one line."""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# How much of a value or of a library's message a one-line error shows.
SHOWN_CHARS = 300


def shorten(text, limit: int = SHOWN_CHARS) -> str:
    """``text`` cut to at most about ``limit`` characters at a word boundary (a character boundary
    when no blank is near), marked ``... (N characters)``: a one-line error never prints a whole
    megabyte value, nor a word cut in half."""
    text = str(text)
    if len(text) <= limit:
        return text
    cut = text[:limit]
    blank = cut.rfind(" ")
    if blank > limit // 2:
        cut = cut[:blank]
    return f"{cut.rstrip(' ,;:')}... ({len(text):,} characters)"


def describe_exception(e: BaseException, limit: int = SHOWN_CHARS) -> str:
    """``Type: first line of the message``, without memory addresses (same input, same bytes), cut
    at a word boundary past ``limit`` characters (:func:`shorten`)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = shorten(_ADDRESS.sub("", text), limit)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextlib.contextmanager
def model_key(key: str, spec):
    """Loading the model named by manifest key ``key`` (e.g. ``models.clip``): any failure becomes
    the one-line :class:`StageError` ``models.clip: 'x/y' not found or not loadable (...)``; a spec
    naming a local path that does not exist: ``models.clip: ./x does not exist (a local path, ...)``,
    never a hub's repo-id complaint."""
    from pipeline.models.required import require_local

    try:
        require_local(key, spec)
    except FileNotFoundError as e:
        raise StageError(str(e)) from None
    try:
        yield
    except StageError:
        raise
    except Exception as e:
        raise StageError(f"{key}: {spec!r} not found or not loadable ({describe_exception(e)})") from None
