"""Training curves a person can read: one panel per metric family, markers, log scale where it helps.

Used by the trainer (a run's ``metrics.png``) and by the run report; it lives here, below both,
because :mod:`pipeline` never imports :mod:`train`.

``metrics.jsonl`` (written by :mod:`train.loop`) holds ``{"kind": "train"|"eval", "step", ...}``
rows. :func:`plot_metrics` draws them as a grid of small panels, so that the loss does not
flatten everything else onto one axis and counts never share an axis with percentages:

- train: the losses (every key containing ``loss``; log scale when they span more than a decade
  and stay positive), the learning rate, the gradient norm, throughput (samples/s), and one
  panel per family of the job's other logged values (family = the key's prefix before ``/``);
- eval: one panel per family (``global/i2t_R@1`` -> ``global``), a fixed 0-100 axis for
  percentages (recalls, accuracies: the repository's unit), with the chance level of a metric
  (eval key ``chance/<metric>``) drawn as a dashed line in the metric's colour; counts such as
  ``eval_images`` are constant bookkeeping and go into the panel title instead of a curve.

Every series is drawn with markers, so a run with one eval point or three logged steps still
shows something, and legends sit inside their panel (the figure is saved with a tight bounding
box, so nothing is cut off).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

TRAIN_BOOKKEEPING = {"kind", "step", "epoch", "time"}
THROUGHPUT = ("samples_per_s", "steps_per_s")
# eval keys that are sizes, not metrics: shown in the title
COUNT_PREFIXES = ("eval_", "n_", "num_")


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (unparseable lines, e.g. a torn last line, are skipped)."""
    rows = []
    if not Path(path).exists():
        return rows
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if _is_num(r.get(key)) and _is_num(r.get("step"))]
    return [p[0] for p in pts], [p[1] for p in pts]


def is_percent_metric(key: str) -> bool:
    """Recalls, accuracies and rates are percentages (0-100) in this repository (SugarCrepe's keys,
    ``sugarcrepe/<kind>``, are pairwise accuracies)."""
    k = key.lower()
    return any(t in k for t in ("r@", "recall", "acc", "precision", "%", "pct", "percent", "sugarcrepe"))


def is_fraction_metric(key: str) -> bool:
    k = key.lower()
    return any(t in k for t in ("auc", "iou"))


COUNT_WORDS = {"phrases", "skipped", "available", "triples", "items", "n", "count", "scored", "images", "captions",
               "samples", "pairs", "queries", "rows", "total"}
# a leaf with one of these is a metric even when it names what it counts over (``acc_items``)
METRIC_WORDS = ("acc", "r@", "recall", "precision", "iou", "auc", "score", "loss", "rate", "mean", "avg", "%")


def is_count(key: str, values: list[float]) -> bool:
    """Sizes (items scored or skipped, phrases...), not metrics, by name (a whole number is no sign:
    an accuracy can be exactly 40 %). The leaf's words decide (``skipped_no_image``, ``train_rows``),
    not its family: ``sugarcrepe/skipped_no_image`` is a count although SugarCrepe's metrics are
    percentages."""
    leaf = key.rsplit("/", 1)[-1].lower()
    if leaf in COUNT_WORDS or leaf.startswith(("n_", "num_")) or leaf.endswith(("_count", "_n")):
        return True
    return bool(COUNT_WORDS & set(leaf.split("_"))) and not any(w in leaf for w in METRIC_WORDS)


def _family(key: str) -> str:
    if "/" in key:
        return key.split("/", 1)[0]
    return key.split("_", 1)[0] if "_" in key else "other"


def chance_keys(metrics: list[str], chances: list[str]) -> dict[str, str]:
    """metric -> the key of its chance level: ``chance/<m>`` (concept-ot: ``chance/i2t_R@1`` for
    ``global/i2t_R@1``), ``chance_<m>`` or ``<prefix>_chance_<m>`` (relation-head:
    ``val_chance_recall@20`` for ``val_recall@20``), ``<m>_chance`` (infoground: ``val_r1_chance``
    for ``val_r1``), or ``chance/<family>`` for every metric of a family (concept-ot:
    ``chance/sugarcrepe`` for ``sugarcrepe/swap_att``)."""
    out = {}
    for c in chances:
        bare = c.removesuffix("_chance").replace("chance/", "").replace("chance_", "")
        for m in metrics:
            if m == bare or m.endswith("/" + bare) or m.replace("/", "_") == bare:
                out.setdefault(m, c)
    for c in chances:  # family-level chance last: a metric's own chance key wins
        if c.startswith("chance/") and "/" not in c[len("chance/"):]:
            for m in metrics:
                if "/" in m and m.split("/", 1)[0] == c[len("chance/"):]:
                    out.setdefault(m, c)
    return out


def metric_panels(rows: list[dict]) -> list[dict]:
    """The panels :func:`plot_metrics` draws: ``{"title", "keys", "kind", "rows", "log", "ylim", "chance",
    "ylabel", "counts"}``."""
    tr = [r for r in rows if r.get("kind") == "train"]
    ev = [r for r in rows if r.get("kind") == "eval"]
    panels: list[dict] = []

    def add(title, keys, src, kind, ylim=None, chance=None, ylabel="", log_ok=False, counts=None):
        keys = [k for k in keys if _series(src, k)[0]]
        if not keys:
            return
        vals = [v for k in keys for v in _series(src, k)[1]]
        log = log_ok and bool(vals) and min(vals) > 0 and max(vals) / min(vals) > 10 and ylim is None
        panels.append({"title": title, "keys": keys, "kind": kind, "rows": src, "log": log, "ylim": ylim,
                       "chance": chance or {}, "ylabel": ylabel, "counts": counts or {}})

    tkeys = sorted({k for r in tr for k, v in r.items() if _is_num(v)} - TRAIN_BOOKKEEPING)
    losses = [k for k in tkeys if "loss" in k.lower()]
    add("train loss", losses, tr, "train", log_ok=True)
    add("learning rate", [k for k in tkeys if k == "lr"], tr, "train")
    add("gradient norm", [k for k in tkeys if k == "grad_norm"], tr, "train", log_ok=True)
    add("throughput (eval steps included)", [k for k in ("samples_per_s",) if k in tkeys] or
        [k for k in THROUGHPUT if k in tkeys], tr, "train", ylabel="per second")
    rest = [k for k in tkeys if k not in losses and k not in ("lr", "grad_norm") and k not in THROUGHPUT]
    fams: dict[str, list[str]] = defaultdict(list)
    for k in rest:
        fams[_family(k)].append(k)
    for fam, keys in sorted(fams.items()):
        add(f"train: {fam}", keys, tr, "train")

    ekeys = sorted({k for r in ev for k, v in r.items() if _is_num(v)} - TRAIN_BOOKKEEPING)
    # sizes (integers in every row: items scored, skipped, phrases...) go into titles, not onto an axis
    ints = {k for k in ekeys if is_count(k, _series(ev, k)[1])}
    metric_keys = [k for k in ekeys if "chance" not in k and not k.startswith(COUNT_PREFIXES) and k not in ints]
    chance = chance_keys(metric_keys, [k for k in ekeys if "chance" in k])
    last = ev[-1] if ev else {}
    efams: dict[str, list[str]] = defaultdict(list)
    for k in metric_keys:
        efams[_family(k)].append(k)
    for fam, keys in sorted(efams.items()):
        counts = {k.split("/", 1)[-1]: last[k] for k in sorted(ints) if _family(k) == fam and _is_num(last.get(k))
                  and not k.startswith(COUNT_PREFIXES)}
        # percentages on a 0-100 axis (every job logs recalls and accuracies in percent, so an
        # accuracy of 0 or 0.5 % is one, not a fraction), AUCs / IoUs on a 0-1 axis
        pct = [k for k in keys if is_percent_metric(k)]
        frac = [k for k in keys if k not in pct and is_fraction_metric(k)]
        other = [k for k in keys if k not in pct and k not in frac]
        ch = {k: chance[k] for k in keys if k in chance}
        add(f"eval: {fam} (%)", pct, ev, "eval", ylim=(0, 100), chance=ch, ylabel="%", counts=counts)
        add(f"eval: {fam} (0-1)", frac, ev, "eval", ylim=(0, 1), chance=ch, ylabel="fraction", counts=counts)
        add(f"eval: {fam}", other, ev, "eval", chance=ch, counts=counts)
    return panels


def eval_counts(rows: list[dict]) -> dict[str, float]:
    """The last eval row's sizes (``eval_images`` ...)."""
    ev = [r for r in rows if r.get("kind") == "eval"]
    if not ev:
        return {}
    return {k: v for k, v in ev[-1].items() if k.startswith(COUNT_PREFIXES) and _is_num(v)}


def _short(key: str, fam_title: str) -> str:
    return key.split("/", 1)[1] if "/" in key and not fam_title.startswith("train loss") else key


def plot_metrics(metrics_path: Path, out_png: Path, title: str | None = None) -> Path | None:
    """Draw ``metrics.jsonl`` as per-family panels into ``out_png``; None when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(Path(metrics_path))
    panels = metric_panels(rows)
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.3 * nrows), squeeze=False)
    sizes = eval_counts(rows)
    for ax, p in zip(axes.flat, panels):
        for key in p["keys"]:
            xs, ys = _series(p["rows"], key)
            every = max(1, len(xs) // 25)
            (line,) = ax.plot(xs, ys, marker="o", markersize=3.5, markevery=every, linewidth=1.3,
                              label=_short(key, p["title"]))
            if key in p["chance"]:
                _, cy = _series(p["rows"], p["chance"][key])
                if cy:
                    ax.axhline(cy[-1], color=line.get_color(), linestyle="--", linewidth=0.9, alpha=0.8)
        if p["chance"]:
            ax.plot([], [], color="0.4", linestyle="--", linewidth=0.9, label="chance (same colour)")
        title_text = p["title"]
        extra = {**({k.replace("eval_", ""): v for k, v in sizes.items()} if p["kind"] == "eval" else {}), **p["counts"]}
        if extra:
            title_text += "\n" + ", ".join(f"{k}={v:,.0f}" for k, v in extra.items())
        ax.set_title(title_text, fontsize=8.5)
        ax.set_xlabel("step", fontsize=8)
        steps = sorted({x for k in p["keys"] for x in _series(p["rows"], k)[0]})
        if len(steps) == 1:  # one logged step: a point in the middle, one tick
            ax.set_xlim(steps[0] - 1, steps[0] + 1)
            ax.set_xticks(steps)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if p["ylabel"]:
            ax.set_ylabel(p["ylabel"], fontsize=8)
        if p["log"]:
            ax.set_yscale("log")
        many = len(p["keys"]) + bool(p["chance"]) > 3
        if p["ylim"]:
            lo, hi = p["ylim"]
            # room above the top for the legend, so no line at 100 % hides under it
            ax.set_ylim(lo, hi + (hi - lo) * (0.3 if many else 0.12))
            ax.set_yticks(np.linspace(lo, hi, 6))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(p["keys"]) > 1 or p["chance"]:
            if p["ylim"]:
                ax.legend(fontsize=6, loc="upper center", ncol=4 if many else 3, framealpha=0.85, columnspacing=0.8,
                          handlelength=1.5)
            else:
                ax.legend(fontsize=6.5, loc="best", ncol=2 if len(p["keys"]) > 5 else 1, framealpha=0.8)
        elif p["keys"] and not p["ylabel"]:
            ax.set_ylabel(p["keys"][0], fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.97))
    else:
        fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return out_png
