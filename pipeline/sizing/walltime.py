"""Wall time of a CPU stage from the costs :mod:`pipeline.sizing.calibrate` measured.

wall = process start + Ray attach/start + the stage's pools (task: Ray Data's task pool and the
stage's imports in a worker; actor: the actor pool and a worker's cold build, once in the driver
for provenance and once per actor) + the busiest worker's items x seconds per item (x the measured
slowdown of that many workers at once) + the stage's driver-side work (mine-concepts' n-gram
mining and hard-negative search; build-index's search is its units' work).
"""

from __future__ import annotations

from pathlib import Path


def makespan(unit_rows: list[float], workers: int) -> float:
    """Rows (or seconds) on the busiest worker when units go, in order, each to the first worker
    free (what a pool of workers does with a queue of units)."""
    loads = [0] * max(1, workers)
    for r in unit_rows:
        i = loads.index(min(loads))
        loads[i] += r
    return max(loads) if unit_rows else 0


def loadable(spec: str | None) -> bool:
    """A model that can be built here without a download: a random preset, the scene oracle, a
    local folder or a packaged model."""
    if not spec:
        return False
    from pipeline.models import clip, mlm
    from pipeline.models.scene_oracle import is_oracle

    s = spec.strip()
    try:
        if clip.is_random_spec(s) or mlm.is_random_spec(s) or is_oracle(s) or Path(s).is_dir():
            return True
        return mlm.package_model_path(s) is not None
    except Exception:
        return False


def units_of(name: str, cfg, size, rows: dict, manifest) -> list[int]:
    """Items (the stage's per-item unit) of each unit of work, as the stage plans its units."""
    from pipeline.sizing.artifacts import unit_rows

    cpi = size.captions_per_image
    if name == "negative-captions":  # units of shard_size samples within each of ingest's captions files
        ingest_files = unit_rows(size.images, manifest.stages.ingest.shard_size)
        return [round(r * cpi) for f in ingest_files for r in unit_rows(f, cfg.shard_size)]
    if name == "mine-concepts":
        return unit_rows(rows.get("vocab", 0), cfg.encode_unit)
    if name == "ingest":
        return unit_rows(size.images, cfg.shard_size)
    if name == "build-index":
        return unit_rows(size.images, cfg.query_chunk) + unit_rows(size.captions, cfg.query_chunk)
    return unit_rows(size.images, getattr(cfg, "shard_size", size.images) or size.images)


def stage_wall(name: str, cfg, manifest, size, rows: dict, cost: dict, sysc: dict, workers: int) -> tuple[float, str]:
    """Wall seconds of a stage from its measured per-item cost and the fixed costs, and what they cover."""
    units = units_of(name, cfg, size, rows, manifest)
    busiest = makespan(units, workers)
    process, ray_s = sysc.get("process_s") or 0.0, sysc.get("ray_start_s") or 0.0
    tasks, actors = sysc.get("task_pool_s") or 0.0, sysc.get("actor_pool_s") or 0.0
    load, imp = cost.get("load_s", 0.0), cost.get("import_s", 0.0)
    fixed = process + ray_s
    parts = [f"process start {process:.1f} s", f"Ray attach/start {ray_s:.1f} s"]
    busy = min(workers, len(units))
    slow = float(sysc.get("parallel", {}).get(str(busy), 1.0)) if busy > 1 else 1.0
    together = cost.get("per_item_s_together", {}).get(str(busy))
    if together:  # the stage's own work timed with that many copies at once
        slow = together / cost["per_item_s"]
    work = busiest * cost.get("per_item_s", 0.0) * slow
    how = (f"{cost.get('per_item_s', 0.0) * 1e3:.3g} ms per {cost.get('item', 'item')} (measured, the stage's worker on "
           f"the first records) x {busiest:,} on the busiest of {busy} workers" +
           (f" x {slow:.2f} ({busy} at once here, measured)" if busy > 1 else ""))
    if name in ("extract-clip-tokens", "negative-captions"):  # the driver builds the model once for provenance, then each actor
        fixed += 2 * load + actors
        parts.append(f"actor pool {actors:.1f} s, worker build {load:.1f} s (cold: imports and model; driver and each actor)")
    elif name == "ingest":
        fixed += tasks + imp
        read = cost.get("read_per_item_s", 0.0) * size.images  # the driver reads the records, the workers check and write
        work += read
        parts.append(f"task pool {tasks:.1f} s, the stage's imports in a worker {imp:.1f} s, the driver's reading {read:.1f} s")
        if cost.get("generate_s") and not _generated(manifest):
            gen = cost["generate_s"] * size.images  # the reader generates the dataset in the driver first
            work += gen
            parts.append(f"generating the dataset {gen:.1f} s ({cost['generate_s'] * 1e3:.2f} ms per image, measured)")
    elif name == "mine-concepts":
        mine = size.captions * cost.get("mine_per_caption_s", 0.0)
        fixed += tasks + imp + actors + 2 * load  # mining tasks, then the encoder's actors; the encoder is built in the driver too
        work += mine
        parts.append(f"task pool {tasks:.1f} s, imports {imp:.1f} s, actor pool {actors:.1f} s, encoder build {load:.1f} s "
                     f"(cold; driver and each actor); n-gram mining {mine:.1f} s "
                     f"({cost.get('mine_per_caption_s', 0) * 1e6:.0f} us per caption, measured)")
        if cost.get("hn_per_pair_s") and rows.get("vocab"):
            hn = rows["vocab"] ** 2 * cost["hn_per_pair_s"]
            work += hn
            parts.append(f"hard-negative search {hn:.1f} s")
    elif name == "build-index":  # the driver's build, then query units of both sides over the other side's index
        fixed += tasks + imp
        read = cost.get("read_per_row_s", 0.0) * (size.images + size.captions)
        build = sum(cost["build_s"].values())
        parts.append(f"task pool {tasks:.1f} s, the stage's imports in a worker {imp:.1f} s, reading "
                     f"{size.images + size.captions:,} embeddings {read:.1f} s (measured per row)")
        from pipeline.sizing.artifacts import unit_rows

        secs = [q * cost["per_query_s"][side] for side, n in (("images", size.images), ("captions", size.captions))
                for q in unit_rows(n, cfg.query_chunk)]
        search = makespan(secs, workers) * slow
        work = read + build + search
        how = (f"search {search:.1f} s on the busiest of {busy} workers ({cost['how']}; the stage's own search timed "
               f"here, one thread" + (f"; x {slow:.2f}, {busy} at once here, measured" if busy > 1 else "") + ")")
    return fixed + work, f"{how}; + {', '.join(parts)}"


def _generated(manifest) -> bool:
    """Whether a generated dataset is already on disk (ingest then only reads it)."""
    from pipeline.io import storage
    from pipeline.readers import synthetic_root

    ds = manifest.dataset
    return ds.kind != "synthetic" or (synthetic_root(ds, storage.local_path(manifest.output)) / "_params.json").is_file()
