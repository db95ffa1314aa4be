"""Gather the data of every report section and render the page (see :mod:`pipeline.report`)."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.counts import artifact_count
from pipeline.report import figures as F
from pipeline.report.formatting import fmt_bytes, fmt_num, fmt_seconds, fmt_value
from pipeline.report.training import training_section

log = logging.getLogger("pipeline")

# artifact -> section id, in page order (training comes last)
ARTIFACT_ORDER = ["samples", "concepts", "negatives", "visual_tokens", "clip_tokens", "image_groups", "regions", "index"]
SECTION_IDS = ["overview", "stages", *ARTIFACT_ORDER, "training"]
RUNLOG = "_logs/stages.json"
N_EXAMPLES = 4


# --------------------------------------------------------------------------- run log
def record_stage(output: str | Path, stage: str, summary: dict, manifest: str | Path | None = None) -> None:
    """Append a finished stage's summary (rows, errors, seconds) to ``<output>/_logs/stages.json``,
    which the report and ``run all``'s closing summary read.

    A rerun that computed no unit (``units_run == 0``: every shard was complete) keeps the times of
    the run that did the work and only notes when it was checked (``checked``, ``checked_seconds``)."""
    from pipeline.io.atomic import write_json_atomic

    path = Path(output) / RUNLOG
    data = read_runlog(output)
    if manifest is not None:
        data["manifest"] = str(manifest)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    stages = data.setdefault("stages", {})
    earlier = stages.get(stage) or {}
    if summary.get("units_run") == 0 and earlier.get("seconds") is not None:
        stages[stage] = {**earlier, "checked": now, "checked_seconds": summary.get("seconds")}
    else:
        stages[stage] = {**{k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool)) or v is None},
                         "finished": now}
    write_json_atomic(path, data)


def read_runlog(output: str | Path) -> dict:
    try:
        return json.loads((Path(output) / RUNLOG).read_text())
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- helpers
class _Images:
    """Decoded sample images by sample id (from the ``samples`` artifact), cached."""

    def __init__(self, samples_art):
        self.refs: dict[int, str] = {}
        self.cache: dict[int, np.ndarray | None] = {}
        if samples_art is not None:
            from pipeline.loaders.samples import image_resolver

            t = samples_art.read("samples", columns=["sample_id", "image"])
            resolve = image_resolver(samples_art.dir)  # stored relative to the dataset root
            self.refs = dict(zip(t.column("sample_id").to_pylist(), map(resolve, t.column("image").to_pylist())))

    def get(self, sid: int) -> np.ndarray | None:
        sid = int(sid)
        if sid not in self.cache:
            from pipeline.readers.images import ImageError, open_image

            try:
                self.cache[sid] = np.asarray(open_image(self.refs[sid]).convert("RGB"))
            except (KeyError, ImageError, OSError):
                self.cache[sid] = None
        return self.cache[sid]


class _Out:
    """The report folder: relative image paths for the page."""

    def __init__(self, root: Path):
        self.root = root
        self.img = root / "img"

    def rel(self, path: Path) -> str:
        return Path(path).relative_to(self.root).as_posix()

    def thumb(self, images: _Images, sid: int, size: int = 160) -> str | None:
        path = self.img / "thumbs" / f"{int(sid)}-{size}.jpg"
        if not path.exists():
            im = images.get(sid)
            if im is None:
                return None
            F.save_thumbnail(im, path, size)
        return self.rel(path)


def _command(stage: str, manifest: str | None) -> str:
    return f"pipeline run {stage} --manifest {manifest or '<manifest.yaml>'}"


def _first_shard_samples(art, n: int, fields=None) -> list[dict]:
    from pipeline.io.wds import iter_shard

    out = []
    for path in art.files("shards"):
        for s in iter_shard(path, fields):
            out.append(s)
            if len(out) >= n:
                return out
    return out


def _sid(sample: dict) -> int:
    return int(sample["__key__"])


# --------------------------------------------------------------------------- stage sections
def _stage_info(spec, art, runlog_stage: dict | None, manifest_path: str | None, stage_cfg_enabled: bool | None) -> dict:
    artifact = spec.writes[0]
    info = {"stage": spec.name, "artifact": artifact, "description": spec.description, "present": art is not None,
            "command": _command(spec.name, manifest_path), "enabled": stage_cfg_enabled, "random_weights": [],
            "models": [], "errors": 0, "broken": None}
    if art is None:
        return info
    m = art.manifest
    errors = art.errors()
    by_reason = []
    if errors.num_rows:
        rows = errors.to_pylist()
        counts = Counter(r["reason"] for r in rows)
        for reason, n in counts.most_common():
            ex = [r for r in rows if r["reason"] == reason][:3]
            by_reason.append({"reason": reason, "count": n, "examples": [
                {"ids": ", ".join(f"{k} {r[k]}" for k in ("sample_id", "caption_id", "source_id") if r.get(k) is not None),
                 "detail": (r.get("detail") or "")[:300], "unit": r.get("unit")} for r in ex]})
    stats = m.get("stats") or {}
    timings = [(k[:-2].replace("_", " "), v) for k, v in stats.items() if k.endswith("_s") and isinstance(v, (int, float))]
    other_stats = [(k, v) for k, v in stats.items() if not k.endswith("_s") and k != "rows"]
    params = {k: v for k, v in (m.get("parameters") or {}).items()}
    models = [{"role": role, "spec": rec.get("spec") or rec.get("id") or "?", "random": bool(rec.get("random_weights")),
               "sha": str(rec.get("weights_sha256") or "")[:16], "detail": {k: v for k, v in rec.items() if k not in ("spec", "random_weights", "weights_sha256")}}
              for role, rec in (m.get("models") or {}).items() if isinstance(rec, dict)]
    from pipeline.io.artifacts import disk_usage

    info.update(
        created=m.get("created"), code_version=m.get("code_version"), fingerprint=str(m.get("fingerprint", ""))[:16],
        tables=[{"name": t, "rows": v["rows"], "files": v["files"]} for t, v in (m.get("tables") or {}).items()],
        rows=main_rows(m), rows_unit=artifact_count(m)[1], shards=m.get("units", 0), errors=errors.num_rows, errors_by_reason=by_reason,
        timings=timings, stats=other_stats, models=models, random_weights=list(m.get("random_weights") or []),
        parameters=json.dumps(params, indent=1, default=str, sort_keys=True), disk=fmt_bytes(disk_usage(art.dir)),
        seconds=(runlog_stage or {}).get("seconds"), path=str(art.dir),
        errors_path=str(art.dir / ((m.get("errors") or {}).get("path") or "errors.parquet")),
    )
    return info


def main_rows(m: dict) -> int:
    """The artifact's one count (pipeline/counts.py: what `pipeline status` and `run all` show)."""
    return artifact_count(m)[0]


# --------------------------------------------------------------------------- artifact sections
def _samples_section(art, images: _Images, out: _Out) -> dict:
    t = art.read("samples", columns=["sample_id", "width", "height", "split"]).to_pylist()
    caps = art.read("captions", columns=["caption_id", "sample_id", "text"]).to_pylist()
    first_cap: dict[int, str] = {}
    n_caps = Counter()
    for c in caps:
        first_cap.setdefault(c["sample_id"], c["text"])
        n_caps[c["sample_id"]] += 1
    splits = Counter(r["split"] for r in t)
    items = []
    for r in t[:8]:
        thumb = out.thumb(images, r["sample_id"])
        items.append({"sample_id": r["sample_id"], "thumb": thumb, "caption": first_cap.get(r["sample_id"], ""),
                      "size": f"{r['width']}×{r['height']}", "split": r["split"], "n_captions": n_caps[r["sample_id"]]})
    return {"items": items, "n": len(t), "captions": len(caps), "splits": dict(splits),
            "tables": {k: v["rows"] for k, v in art.manifest["tables"].items()}}


def _concepts_section(art, images: _Images, out: _Out) -> dict:
    vocab = art.read("vocab").to_pylist()
    text = {v["concept_id"]: v["text"] for v in vocab}
    by_n: dict[int, list] = {}
    for v in sorted(vocab, key=lambda v: (-v["df"], v["text"])):
        by_n.setdefault(int(v["n"]), []).append(v)
    top = [{"n": n, "concepts": [(v["text"], v["df"]) for v in lst[:8]], "total": len(lst)} for n, lst in sorted(by_n.items())]
    conc = art.read("concepts").to_pylist()
    rows_of: dict[int, dict] = {}
    for r in conc:  # the first image with the concept and its partners (other images containing it, K1)
        rows_of.setdefault(r["concept_id"], r)
    hn = {}
    if "hard_negatives" in art.tables():
        for r in art.read("hard_negatives").to_pylist():
            hn[r["concept_id"]] = list(zip(r["negatives"] or [], r["scores"] or []))
    # a few concepts: the most frequent one of each n >= 2 (then n = 1) that has partners
    examples, used = [], set()
    for n in sorted(by_n, key=lambda n: (n < 2, n)):
        for v in by_n[n]:
            if v["concept_id"] in rows_of and rows_of[v["concept_id"]]["partners"]:
                r = rows_of[v["concept_id"]]
                sids = [r["sample_id"], *list(r["partners"])[:4]]
                examples.append({"text": v["text"], "n": v["n"], "df": v["df"],
                                 "thumbs": [(sid, out.thumb(images, sid, 120), k == 0) for k, sid in enumerate(sids)],
                                 "negatives": [(text.get(int(c), str(c)), float(s)) for c, s in hn.get(v["concept_id"], [])[:6]]})
                used.add(v["concept_id"])
                break
        if len(examples) >= N_EXAMPLES:
            break
    n_per_image = Counter(r["sample_id"] for r in conc)
    hist = None
    if n_per_image:
        hist = out.rel(F.histogram_figure(np.array(list(n_per_image.values())), out.img / "concepts_per_image.png",
                                          "concepts per image", "concepts"))
    return {"top": top, "examples": examples, "vocab": len(vocab), "rows": len(conc), "hist": hist,
            "has_hard_negatives": bool(hn)}


def _negatives_section(art, out: _Out, captions: dict[int, str]) -> dict:
    t = art.read("negatives", columns=["caption_id", "sample_id", "start", "end", "noun", "candidates", "p", "q", "score", "rejected"])
    rows = t.to_pylist()
    seen, items = set(), []
    for r in rows:  # one caption per image, so the examples differ
        if r["sample_id"] in seen or not r["candidates"]:
            continue
        seen.add(r["sample_id"])
        cap = captions.get(r["caption_id"], "")
        s, e = int(r["start"]), int(r["end"])
        aligned = bool(cap) and cap[s:e].lower() == (r["noun"] or "").lower()
        if not aligned:  # the span does not match the caption text: show both, substitute nothing
            pre, mid, post = (cap + " — noun: " if cap else ""), r["noun"], ""
        else:
            pre, mid, post = cap[:s], cap[s:e], cap[e:]
        cands = list(zip(r["candidates"], r["p"] or [], r["q"] or [], r["score"] or []))[:5]
        items.append({"caption_id": r["caption_id"], "sample_id": r["sample_id"], "pre": pre, "noun": mid, "post": post, "aligned": aligned,
                      "candidates": [{"word": c, "p": p, "q": q, "score": sc,
                                      "sentence": c} for c, p, q, sc in cands],
                      "rejected": len(r["rejected"] or [])})
        if len(items) >= 6:
            break
    n_cands = [len(r["candidates"] or []) for r in rows]
    return {"items": items, "rows": len(rows), "captions": len({r["caption_id"] for r in rows}),
            "mean_candidates": float(np.mean(n_cands)) if n_cands else 0.0}


def _visual_tokens_section(art, images: _Images, out: _Out) -> dict:
    from pipeline.masks import rle_decode

    samples = _first_shard_samples(art, N_EXAMPLES + 4)
    samples = sorted(samples, key=lambda s: -len(s.get("triplets.npy", [])))[:N_EXAMPLES]
    items = []
    for s in samples:
        sid = _sid(s)
        im = images.get(sid)
        meta = s.get("meta.json") or {}
        if im is None:
            items.append({"sample_id": sid, "figure": None, "note": "image not readable"})
            continue
        masks = [rle_decode(m) for m in (s.get("masks.json") or [])]
        cats = meta.get("categories") or []
        labels = [cats[k] if k < len(cats) else str(k) for k in range(len(masks))]
        preds = meta.get("predicates") or []
        tri = s.get("triplets.npy")
        tsc = s.get("triplet_scores.npy")
        triplets = []
        if tri is not None and len(tri):
            for k, (a, b, p) in enumerate(np.asarray(tri).tolist()):
                triplets.append((a, b, preds[p] if p < len(preds) else str(p), float(tsc[k]) if tsc is not None else float("nan")))
        ranks = s.get("ranks.npy")
        names = ["I"] + [f"V{k} {labels[k]}" for k in range(len(masks))] + [f"U {p}" for p in preds]
        fig = F.visual_tokens_figure(im, masks, labels, triplets[:12], ranks, names, out.img / "visual_tokens" / f"{sid}.png",
                                     title=f"sample {sid}: {len(masks)} tangible, {len(preds)} intangible, {len(triplets)} triplets")
        items.append({"sample_id": sid, "figure": out.rel(fig),
                      "triplets": [(labels[a] if a < len(labels) else a, p, labels[b] if b < len(labels) else b, sc) for a, b, p, sc in triplets[:8]],
                      "n_triplets": len(triplets)})
    m = art.manifest
    return {"items": items, "stats": {k: v for k, v in (m.get("stats") or {}).items() if not k.endswith("_s")},
            "embedding": m.get("embedding"), "dims": m.get("dims")}


def _clip_tokens_section(art, out: _Out) -> dict:
    m = art.manifest
    fig = None
    if "captions" in art.tables():
        n = art.read("captions", columns=["n_tokens"]).column("n_tokens").to_numpy()
        if len(n):
            fig = out.rel(F.histogram_figure(n, out.img / "clip_text_tokens.png", "text tokens per caption", "tokens"))
    return {"dims": m.get("dims"), "hist": fig}


def _image_groups_section(art, images: _Images, out: _Out) -> dict:
    m = art.manifest
    dims = m.get("dims") or {}
    grid = dims.get("grid")
    items = []
    for s in _first_shard_samples(art, N_EXAMPLES, fields=None):
        sid = _sid(s)
        im = images.get(sid)
        a = s.get("assign.npy")
        if im is None or a is None:
            items.append({"sample_id": sid, "figure": None, "note": "image or assignment not readable"})
            continue
        K, N = a.shape
        g = tuple(grid) if grid and grid[0] * grid[1] == N else (int(round(math.sqrt(N))),) * 2
        if g[0] * g[1] != N:
            items.append({"sample_id": sid, "figure": None, "note": f"assignment has {N} patches, not a square grid"})
            continue
        fig = F.image_groups_figure(im, a, g, out.img / "image_groups" / f"{sid}.png", title=f"sample {sid}: {K} groups over a {g[0]}×{g[1]} patch grid")
        items.append({"sample_id": sid, "figure": out.rel(fig)})
    return {"items": items, "dims": dims}


def _regions_section(art, images: _Images, out: _Out) -> dict:
    m = art.manifest
    cats = m.get("categories") or []
    items = []
    for s in _first_shard_samples(art, N_EXAMPLES):
        sid = _sid(s)
        im = images.get(sid)
        boxes = s.get("boxes.npy")
        scores = s.get("scores.npy")
        if im is None or boxes is None:
            items.append({"sample_id": sid, "figure": None, "note": "image not readable"})
            continue
        order = np.argsort(-scores)[:8] if scores is not None and len(scores) else np.arange(min(8, len(boxes)))
        if s.get("categories.json") is not None:
            names = list(s["categories.json"])
        else:
            labels = s.get("labels.npy")
            names = [cats[int(x)] if labels is not None and 0 <= int(x) < len(cats) else str(int(x)) for x in (labels if labels is not None else [])]
        sel_names = [names[i] if i < len(names) else "?" for i in order]
        sc = scores[order] if scores is not None else np.ones(len(order))
        fig = F.regions_figure(im, boxes[order], sc, sel_names, out.img / "regions" / f"{sid}.png",
                               title=f"sample {sid}: top {len(order)} of {len(boxes)} boxes")
        items.append({"sample_id": sid, "figure": out.rel(fig), "boxes": [(n, float(x)) for n, x in zip(sel_names, sc)]})
    return {"items": items, "backend": m.get("backend"), "dims": m.get("dims")}


def _index_section(art, images: _Images, out: _Out, captions: dict[int, str], cap_owner: dict[int, int]) -> dict:
    m = art.manifest
    img_q, cap_q = [], []
    if "image_negatives" in art.tables():
        for r in art.read("image_negatives").slice(0, 3).to_pylist():
            sid = r["sample_id"]
            own = [c for c, o in cap_owner.items() if o == sid][:1]
            img_q.append({"sample_id": sid, "thumb": out.thumb(images, sid), "caption": captions.get(own[0], "") if own else "",
                          "neighbours": [{"caption_id": c, "text": captions.get(c, f"caption {c}"), "image": cap_owner.get(c),
                                          "thumb": out.thumb(images, cap_owner[c], 64) if c in cap_owner else None,
                                          "score": float(s)} for c, s in list(zip(r["caption_ids"], r["scores"]))[:5]]})
    if "caption_negatives" in art.tables():
        for r in art.read("caption_negatives").slice(0, 3).to_pylist():
            cap_q.append({"caption_id": r["caption_id"], "text": captions.get(r["caption_id"], ""), "sample_id": r["sample_id"],
                          "thumb": out.thumb(images, r["sample_id"], 120),
                          "neighbours": [{"sample_id": i, "thumb": out.thumb(images, i, 120), "score": float(s)}
                                         for i, s in list(zip(r["image_ids"], r["scores"]))[:5]]})
    return {"image_queries": img_q, "caption_queries": cap_q, "faiss": m.get("faiss"), "similarity": m.get("similarity")}


# --------------------------------------------------------------------------- the page
def build_report(output: str | Path, manifest_path: str | Path | None = None, manifest=None) -> Path:
    """Write ``<output>/report/index.html`` (and its images) and return its path."""
    import jinja2

    from pipeline.io.artifacts import Artifact, ArtifactMissing
    from pipeline.stage import dependency_order, registry

    from pipeline.io import storage

    if manifest is not None:
        storage.configure_from(manifest)
    location = storage.normalize(output)  # an object-storage run: read through its local mirror
    output = storage.local_path(location)
    if storage.is_remote(location):
        output.mkdir(parents=True, exist_ok=True)
    if not output.is_dir():
        raise FileNotFoundError(f"{output} is not a folder: run `pipeline run all --manifest {manifest_path or '<manifest.yaml>'}` first")
    runlog = read_runlog(output)
    manifest_path = str(manifest_path) if manifest_path else runlog.get("manifest")
    root = output / "report"
    if (root / "img").is_dir():
        shutil.rmtree(root / "img")
    out = _Out(root)
    out.img.mkdir(parents=True, exist_ok=True)

    reg = registry()
    arts: dict[str, object] = {}
    incomplete: dict[str, str] = {}
    for spec in reg.values():
        for a in spec.writes:
            try:
                arts[a] = Artifact(storage.join(location, a))
            except ArtifactMissing:
                arts[a] = None
                if (output / a).is_dir():
                    incomplete[a] = "the folder exists but has no _manifest.json: the stage started and did not finish"
    stages = []
    for name in dependency_order(list(reg)):
        spec = reg[name]
        enabled = None
        if manifest is not None:
            enabled = bool(getattr(getattr(manifest.stages, spec.key, None), "enabled", True))
        try:
            info = _stage_info(spec, arts.get(spec.writes[0]), (runlog.get("stages") or {}).get(name), manifest_path, enabled)
        except Exception as e:  # a broken artifact must not take the whole report down
            log.warning("report: stage %s: %s", name, e)
            info = {"stage": name, "artifact": spec.writes[0], "present": False, "command": _command(name, manifest_path),
                    "broken": f"{type(e).__name__}: {e}", "random_weights": [], "models": [], "errors": 0,
                    "description": spec.description, "enabled": enabled}
        info["incomplete"] = incomplete.get(spec.writes[0])
        stages.append(info)
    producer = {s["artifact"]: s for s in stages}
    for s_ in stages:  # an artifact computed from a random-weights artifact inherits the warning
        inherited = sorted({f"{m} (via {a})" for a in reg[s_["stage"]].reads for m in (producer.get(a, {}).get("random_weights") or [])})
        s_["inherited_random"] = inherited

    images = _Images(arts.get("samples"))
    captions: dict[int, str] = {}
    cap_owner: dict[int, int] = {}
    if arts.get("samples") is not None:
        t = arts["samples"].read("captions", columns=["caption_id", "sample_id", "text"])
        captions = dict(zip(t.column("caption_id").to_pylist(), t.column("text").to_pylist()))
        cap_owner = dict(zip(t.column("caption_id").to_pylist(), t.column("sample_id").to_pylist()))

    builders = {
        "samples": lambda a: _samples_section(a, images, out),
        "concepts": lambda a: _concepts_section(a, images, out),
        "negatives": lambda a: _negatives_section(a, out, captions),
        "visual_tokens": lambda a: _visual_tokens_section(a, images, out),
        "clip_tokens": lambda a: _clip_tokens_section(a, out),
        "image_groups": lambda a: _image_groups_section(a, images, out),
        "regions": lambda a: _regions_section(a, images, out),
        "index": lambda a: _index_section(a, images, out, captions, cap_owner),
    }
    sections = []
    for a in ARTIFACT_ORDER:
        st = producer.get(a, {"stage": "?", "command": ""})
        sec = {"id": a, "artifact": a, "stage": st.get("stage"), "command": st.get("command"), "data": None,
               "missing": None, "error": None, "random_weights": st.get("random_weights") or [],
               "inherited_random": st.get("inherited_random") or []}
        if arts.get(a) is None:
            why = incomplete.get(a) or f"no `{a}` artifact under {output}"
            if st.get("enabled") is False:
                why += f" (stage {st['stage']} is disabled in the manifest: stages.{st['stage'].replace('-', '_')}.enabled)"
            sec["missing"] = why
        else:
            try:
                sec["data"] = builders[a](arts[a])
            except Exception as e:
                log.warning("report: section %s failed: %s: %s", a, type(e).__name__, e)
                sec["error"] = f"{type(e).__name__}: {e}"
        sections.append(sec)

    training = training_section(output, out, manifest_path)
    random_models = sorted({f"{m['role']} ({m['spec']})" for s in stages for m in s.get("models", []) if m["random"]})
    oracle_models = sorted({m["role"] for s in stages for m in s.get("models", []) if m["detail"].get("testbed_instrument")})
    overview = {
        "rows": [(s["stage"], s["artifact"], s.get("rows"), s.get("shards"), s.get("errors"), s.get("seconds"), s["present"],
                  bool(s.get("random_weights")), s.get("rows_unit", "")) for s in stages],
        "total_errors": sum(s.get("errors") or 0 for s in stages),
        "total_seconds": sum(s.get("seconds") or 0 for s in stages),
        "missing": [s["artifact"] for s in stages if not s["present"]],
    }
    env = jinja2.Environment(loader=jinja2.PackageLoader("pipeline.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=fmt_num, seconds=fmt_seconds, value=fmt_value, anchor=lambda s: re.sub(r"[^a-z0-9]+", "-", str(s).lower()))
    html = env.get_template("report.html.j2").render(
        title=f"vlpipe run report: {output.name}", output=str(output), manifest=manifest_path,
        created=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        stages=stages, sections=sections, training=training, overview=overview, random_models=random_models, oracle_models=oracle_models,
        section_ids=SECTION_IDS,
    )
    from pipeline.io.atomic import write_bytes_atomic

    write_bytes_atomic(root / "index.html", html.encode("utf-8"))
    return root / "index.html"
