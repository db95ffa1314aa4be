"""The report's pictures (matplotlib, Agg): one function per artifact view, each writes one PNG.

Every function takes an RGB image as a numpy array [H, W, 3] (uint8) where it draws over an image,
and a path to write; it returns the path. Colours come from the ``tab20`` map, so group k, mask k
or box k always has the same colour within a figure and its legend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_DPI = 100


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colour(k: int):
    plt = _plt()
    return plt.get_cmap("tab20")(k % 20)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, bbox_inches="tight")
    _plt().close(fig)
    return path


def save_thumbnail(img: np.ndarray, path: Path, size: int = 160) -> Path:
    """A JPEG thumbnail (longest side ``size``)."""
    from PIL import Image

    im = Image.fromarray(img)
    im.thumbnail((size, size))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, format="JPEG", quality=88)
    return path


def visual_tokens_figure(img: np.ndarray, masks: list[np.ndarray], labels: list[str], triplets: list[tuple[int, int, str, float]],
                         ranks: np.ndarray | None, token_names: list[str], path: Path, title: str = "") -> Path:
    """Left: tangible masks (filled, outlined, numbered) and triplets as labelled arrows between mask
    centres; right: the attention rank matrix over T = (I, V, U) as a small heatmap."""
    plt = _plt()
    ncol = 2 if ranks is not None and ranks.size else 1
    fig, axes = plt.subplots(1, ncol, figsize=(4.6 * ncol + (0.6 if ncol == 2 else 0), 4.3), squeeze=False)
    ax = axes[0, 0]
    ax.imshow(img)
    h, w = img.shape[:2]
    overlay = np.zeros((h, w, 4), np.float32)
    centres = []
    for k, m in enumerate(masks):
        c = _colour(k)
        mm = m.astype(bool)
        overlay[mm] = (c[0], c[1], c[2], 0.45)
        if mm.any():
            ys, xs = np.nonzero(mm)
            centres.append((xs.mean(), ys.mean()))
            ax.contour(mm.astype(float), levels=[0.5], colors=[c], linewidths=1.2)
        else:
            centres.append((np.nan, np.nan))
    ax.imshow(overlay)
    for k, (cx, cy) in enumerate(centres):
        if np.isfinite(cx):
            ax.text(cx, cy, f"{k}:{labels[k]}" if k < len(labels) else str(k), fontsize=7, ha="center", va="center",
                    color="black", bbox=dict(boxstyle="round,pad=0.15", fc="white", ec=_colour(k), alpha=0.85))
    for s, o, pred, score in triplets:
        if s >= len(centres) or o >= len(centres):
            continue
        (x0, y0), (x1, y1) = centres[s], centres[o]
        if not (np.isfinite(x0) and np.isfinite(x1)):
            continue
        # curved, so that a -> b and b -> a stay apart; the label sits on the curve's middle
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops=dict(arrowstyle="-|>", color="yellow", lw=1.5, shrinkA=8, shrinkB=8,
                                    connectionstyle="arc3,rad=0.25"))
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        dx, dy = x1 - x0, y1 - y0
        mx, my = mx + 0.125 * dy, my - 0.125 * dx  # arc3's control point is offset by rad * length / 2
        ax.text(mx, my, f"{pred} {score:.2f}", fontsize=6.5, color="black", ha="center", va="center",
                bbox=dict(boxstyle="round,pad=0.12", fc="yellow", ec="none", alpha=0.85))
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.axis("off")
    ax.set_title(title or "tangible masks and triplets", fontsize=9)
    if ncol == 2:
        from matplotlib.colors import BoundaryNorm, ListedColormap

        ax2 = axes[0, 1]
        # ranks of Kalibhat et al. (pipeline/visual_tokens/graph.py): 7 subject-object of a triplet,
        # 6 node -> its predicate, 5 predicate -> node, 4..1 first..fourth nearest neighbour, 0 none
        cmap = ListedColormap(["#f2f2f2", "#c6dbef", "#9ecae1", "#6baed6", "#3182bd", "#fdae6b", "#e6550d", "#a50f15"])
        im = ax2.imshow(ranks, cmap=cmap, norm=BoundaryNorm(np.arange(-0.5, 8.5), 8), interpolation="nearest")
        n = ranks.shape[0]
        if n <= 30 and len(token_names) == n:
            ax2.set_xticks(range(n))
            ax2.set_yticks(range(n))
            ax2.set_xticklabels(token_names, rotation=90, fontsize=6)
            ax2.set_yticklabels(token_names, fontsize=6)
        ax2.set_title(f"attention ranks, row attends to column ({n} tokens)", fontsize=9)
        cb = fig.colorbar(im, ax=ax2, fraction=0.046, pad=0.04, ticks=range(8))
        cb.ax.set_yticklabels(["0 none", "1 4th NN", "2 3rd NN", "3 2nd NN", "4 1st NN", "5 pred→node", "6 node→pred",
                               "7 subj–obj"], fontsize=6.5)
    fig.tight_layout()
    return _save(fig, path)


def image_groups_figure(img: np.ndarray, assign: np.ndarray, grid: tuple[int, int], path: Path, title: str = "") -> Path:
    """The soft patch-to-group assignment [K, N] over the image: the image; each patch coloured by
    its most likely group (patch grid drawn); the probability of that group per patch, on a scale
    from 1/K (uniform: the groups do not separate the patch) to 1 (one group)."""
    plt = _plt()
    from matplotlib.patches import Patch
    from PIL import Image

    K = assign.shape[0]
    gh, gw = grid
    a = assign.astype(np.float32).reshape(K, gh, gw)
    hard = a.argmax(0)
    conf = a.max(0)
    h, w = img.shape[:2]
    colours = np.array([plt.get_cmap("tab10")(k % 10)[:3] for k in range(K)], np.float32)
    rgb = np.asarray(Image.fromarray((colours[hard] * 255).astype(np.uint8)).resize((w, h), Image.NEAREST))
    fig, axes = plt.subplots(1, 3, figsize=(11.5, 3.9))
    axes[0].imshow(img)
    axes[0].set_title("image", fontsize=9)
    axes[1].imshow(img)
    axes[1].imshow(rgb, alpha=0.55)
    for y in np.linspace(0, h, gh + 1)[1:-1]:
        axes[1].axhline(y, color="white", lw=0.4, alpha=0.7)
    for x in np.linspace(0, w, gw + 1)[1:-1]:
        axes[1].axvline(x, color="white", lw=0.4, alpha=0.7)
    axes[1].set_title(f"most likely of {K} groups per patch", fontsize=9)
    share = np.bincount(hard.ravel(), minlength=K) / hard.size
    axes[1].legend(handles=[Patch(color=colours[k], label=f"group {k}: {100 * share[k]:.0f}% of patches") for k in range(K)],
                   fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=min(K, 3), framealpha=0.9,
                   columnspacing=0.8, handlelength=1.2)  # below its panel: beside it, it covered the next one
    im = axes[2].imshow(conf, cmap="viridis", vmin=1.0 / K, vmax=1.0, extent=(0, w, h, 0), interpolation="nearest")
    flat = abs(float(conf.mean()) - 1.0 / K) < 0.02
    axes[2].set_title(f"probability of that group (mean {conf.mean():.2f}; uniform 1/K = {1 / K:.2f})"
                      + ("\nuniform: the groups do not separate the patches" if flat else ""), fontsize=9,
                      color="#b3261e" if flat else "black")
    fig.colorbar(im, ax=axes[2], fraction=0.046, pad=0.04)
    for ax in axes:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def regions_figure(img: np.ndarray, boxes: np.ndarray, scores: np.ndarray, labels: list[str], path: Path, title: str = "") -> Path:
    """Top boxes, each with its label and score."""
    plt = _plt()
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(4.4, 4.4))
    ax.imshow(img)
    for k, (b, s) in enumerate(zip(boxes, scores)):
        x0, y0, x1, y1 = (float(v) for v in b)
        c = _colour(k)
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec=c, lw=1.6))
        ax.text(x0, y0, f"{labels[k] if k < len(labels) else '?'} {s:.2f}", fontsize=6.5, va="bottom", color="black",
                bbox=dict(boxstyle="square,pad=0.1", fc=c, ec="none", alpha=0.8))
    ax.set_xlim(0, img.shape[1])
    ax.set_ylim(img.shape[0], 0)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def bar_figure(names: list[str], values: list[float], path: Path, title: str, xlabel: str) -> Path:
    """Horizontal bars (e.g. error reasons, rows per stage)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 0.35 * len(names) + 1.0))
    ax.barh(range(len(names)), values, color=[_colour(k) for k in range(len(names))])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    for k, v in enumerate(values):
        ax.text(v, k, f" {v:,.0f}" if float(v).is_integer() else f" {v:.3g}", va="center", fontsize=7)
    ax.margins(x=0.15)
    fig.tight_layout()
    return _save(fig, path)


def histogram_figure(values: np.ndarray, path: Path, title: str, xlabel: str, bins: int = 20) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.4, 2.8))
    values = np.asarray(values)
    if values.size and np.issubdtype(values.dtype, np.integer):  # counts: one bar per integer
        lo, hi = int(values.min()), int(values.max())
        step = max(1, int(np.ceil((hi - lo + 1) / 40)))
        bins = np.arange(lo - 0.5, hi + step + 0.5, step)
    ax.hist(values, bins=bins, color=_colour(0), edgecolor="white")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel("count", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    return _save(fig, path)
