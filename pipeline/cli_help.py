"""What the `pipeline` and `train` commands share in their help and their errors: plain help text
wrapped at word boundaries to the terminal (100 columns when not a terminal, and at most 100), a
"did you mean" for a mistyped stage or job name, and a manifest section's options listed with
their defaults and whole descriptions (`train list <job>`)."""

from __future__ import annotations

import difflib
import json
import os
import shutil
import sys

HELP_WIDTH = 100  # columns of help text when not writing to a terminal, and at most on one


def help_width() -> int:
    """The terminal's width (``COLUMNS`` when set), at most ``HELP_WIDTH``; ``HELP_WIDTH`` when
    stdout is not a terminal (a pipe, a file, a test)."""
    if os.environ.get("COLUMNS", "").isdigit():
        return max(40, min(int(os.environ["COLUMNS"]), HELP_WIDTH))
    if not sys.stdout.isatty():
        return HELP_WIDTH
    return max(40, min(shutil.get_terminal_size((HELP_WIDTH, 24)).columns, HELP_WIDTH))


def typer_settings() -> dict:
    """Keyword arguments for ``typer.Typer``: click's plain help formatter (words are never cut, no
    boxes, no markup), wrapped to :func:`help_width`."""
    width = help_width()
    return {"rich_markup_mode": None,
            "context_settings": {"terminal_width": width, "max_content_width": width,
                                 "help_option_names": ["--help", "-h"]}}


def did_you_mean(kind: str, name: str, choices: list[str]) -> str:
    """``unknown <kind> 'nme'; did you mean 'name'? <kind>s: a, b, c`` (no suggestion when nothing is close)."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {kind} {name!r}{hint} {kind}s: {', '.join(choices) or '(none)'}"


def _default(field) -> str:
    if field.is_required():
        return "(required)"
    if field.default_factory is not None:
        v = field.default_factory()
    else:
        v = field.default
    return json.dumps(v, default=str) if not isinstance(v, str) else v


# one line for the options many sections share, where a job's Config does not describe its own
COMMON = {
    "epochs": "passes over the training data (fractional allowed)",
    "max_steps": "stop after this many optimizer steps (overrides epochs)",
    "batch_size": "examples per optimizer step",
    "lr": "peak learning rate (AdamW)",
    "weight_decay": "AdamW weight decay",
    "betas": "AdamW betas",
    "warmup_frac": "linear warmup, fraction of total steps",
    "seed": "seed of the model's initialisation and the data order",
    "best_mode": "whether a larger or a smaller best_metric is better",
    "variant": "the paper's variant (its page in docs/jobs lists them)",
    "train_splits": "the samples' splits trained on",
    "eval_splits": "the samples' splits evaluated on (held out)",
    "width": "model width",
    "layers": "transformer layers",
    "heads": "attention heads",
    "dropout": "dropout probability",
}


DEFAULT_COLUMN = 16  # the default column's width; a longer default puts its description on the next line


def option_lines(section_cls, width: int | None = None) -> list[str]:
    """Every option of a manifest section class: ``name  default  what it does``, the description
    whole, wrapped at words to ``width`` columns under its own column (a default wider than
    :data:`DEFAULT_COLUMN` is printed whole and its description starts on the next line; on a
    terminal too narrow for three columns every description goes below its option, indented)."""
    import textwrap

    width = width or help_width()
    rows = [(name, _default(f), f.description or COMMON.get(name, "")) for name, f in section_cls.model_fields.items()]
    w0 = max((len(r[0]) for r in rows), default=0)
    w1 = min(max((len(r[1]) for r in rows), default=0), DEFAULT_COLUMN)
    indent = " " * (2 + w0 + 2 + w1 + 2)
    stacked = width - len(indent) < 30  # a narrow terminal: each description on the lines below its option
    if stacked:
        indent = " " * 6
    room = width - len(indent)
    out = []
    for name, default, desc in rows:
        text = textwrap.wrap(" ".join(desc.split()), room, break_on_hyphens=False, break_long_words=False)
        if stacked or len(default) > w1:
            out.append(f"  {name:{w0}s}  {default}")
        else:
            out.append(f"  {name:{w0}s}  {default:{w1}s}  {text.pop(0) if text else ''}".rstrip())
        out += [indent + line for line in text]
    return out


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending with an ellipsis where it was cut."""
    return text if len(text) <= width else text[: width - 1] + "…"
