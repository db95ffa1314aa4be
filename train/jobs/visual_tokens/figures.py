"""visual-tokens figures: Fig. 4's image-text similarities over training and the rank weights."""

from __future__ import annotations

import json
from pathlib import Path


def similarity_figure(job, model, out_dir: Path, res: dict) -> None:
    """Fig. 4 over training (mean cosine of matching / other pairs at every evaluation, this one
    included) beside the learned rank weights w_r, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    mp = job.run_dir / "metrics.jsonl"
    if mp.exists():
        rows = [json.loads(x) for x in mp.read_text().splitlines() if x.strip()]
    ev = [r for r in rows if r.get("kind") == "eval" and "similarity/mean_cos_diag" in r]
    # this evaluation is logged after it returns: its step is the last train line's
    now = max([r.get("step", 0) for r in rows if r.get("kind") == "train"], default=0)
    pts = [(r["step"], r["similarity/mean_cos_diag"], r["similarity/mean_cos_offdiag"]) for r in ev if r["step"] < now]
    pts.append((now, res.get("similarity/mean_cos_diag", float("nan")), res.get("similarity/mean_cos_offdiag", float("nan"))))
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    s, d, o = zip(*pts)
    ax[0].plot(s, d, marker="o", label="diagonal (matching pairs)")
    ax[0].plot(s, o, marker="o", label="off-diagonal (other pairs)")
    ax[0].set_xlabel("training step (evaluations; set eval_every for a curve)")
    ax[0].set_ylabel("mean cosine similarity (eval)")
    ax[0].set_title(f"{job.cfg.variant}: image-text similarity (Fig. 4)", fontsize=9)
    ax[0].legend(fontsize=7)
    w = model.rank_weights()
    if w is not None:
        Lw, Hw, _ = w.shape
        for li in range(Lw):
            for hi in range(Hw):
                ax[1].plot(range(8), w[li, hi].cpu().numpy(), marker=".", alpha=0.7 if Lw * Hw > 1 else 1,
                           label=f"layer {li} head {hi}" if Lw * Hw > 1 else "learned w")
        ax[1].plot(range(8), range(8), "k--", lw=0.8, label="init w_r = r")
        ax[1].set_xlabel("rank r (7 node-node, 6 node-edge, 5 edge-node, 4..1 kNN)")
        ax[1].set_ylabel("w_r (added to attention logits)")
        if Lw * Hw <= 8:
            ax[1].legend(fontsize=6)
    else:
        ax[1].text(0.5, 0.5, f"no rank weights ({job.cfg.variant})", ha="center")
    ax[1].set_title("learned rank weights w", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "similarity_and_rank_weights.png", dpi=90)
    plt.close(fig)
