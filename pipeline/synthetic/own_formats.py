"""The generated dataset written in the layouts a researcher's own data comes in (docs/manifests.md):

* ``webdataset/``: as img2dataset writes it (``--output_format webdataset``): shards ``00000.tar``,
  ``00001.tar``... holding ``<key>.jpg``, ``<key>.txt`` (the caption) and ``<key>.json``
  (``url``, ``key``, ``caption``, ``status``, ``width``, ``height``), keys ``<shard><index>`` (9 digits),
  and beside each shard its ``<shard>.parquet`` (one row per sample) and ``<shard>_stats.json``;
* ``cc3m/``: ``captions.tsv`` with ``caption<TAB>images/<file>`` rows (CC3M's layout with local
  paths instead of URLs) and the ``images/`` it names;
* ``folder/``: ``images/`` and ``captions.tsv`` (``file<TAB>caption``, every caption of an image).

One caption per image in the first two (as CC3M / img2dataset), all captions in the folder. The
generated COCO file's own splits are not carried over (own data has none): ``dataset.splits`` makes
them. manifests/own-webdataset.yaml, own-cc3m.yaml and own-folder.yaml read ``data/own/<layout>``::

    python -m pipeline.synthetic.own_formats data/own            # 200 generated images
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
from pathlib import Path

LAYOUTS = ("webdataset", "cc3m", "folder")
SHARD_SIZE = 100


def _images_and_captions(source: Path) -> list[tuple[str, bytes, list[str], int, int]]:
    """(file name, JPEG bytes, captions in annotation order, width, height) per image, by image id."""
    coco = json.loads((source / "annotations" / "captions.json").read_text())
    caps: dict[int, list[tuple[int, str]]] = {}
    for a in coco["annotations"]:
        caps.setdefault(int(a["image_id"]), []).append((int(a["id"]), a["caption"]))
    out = []
    for im in sorted(coco["images"], key=lambda im: int(im["id"])):
        texts = [c for _, c in sorted(caps.get(int(im["id"]), []))]
        data = (source / "images" / im["file_name"]).read_bytes()
        out.append((im["file_name"], data, texts, int(im["width"]), int(im["height"])))
    return out


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tf.addfile(info, io.BytesIO(data))


def write_webdataset(items, out: Path, shard_size: int = SHARD_SIZE) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(items), shard_size)):
        rows = []
        with tarfile.open(out / f"{shard:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for i, (fname, data, texts, w, h) in enumerate(items[start:start + shard_size]):
                key = f"{shard:05d}{i:04d}"
                meta = {"url": f"https://images.example.org/{fname}", "key": key, "caption": texts[0],
                        "status": "success", "error_message": None, "width": w, "height": h,
                        "original_width": w, "original_height": h}
                _add(tf, f"{key}.jpg", data)
                _add(tf, f"{key}.txt", texts[0].encode())
                _add(tf, f"{key}.json", json.dumps(meta).encode())
                rows.append(meta)
        pq.write_table(pa.Table.from_pylist(rows), out / f"{shard:05d}.parquet")
        (out / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": len(rows), "successes": len(rows), "failed_to_download": 0, "failed_to_resize": 0}, indent=2))
    return out


def write_cc3m(items, out: Path) -> Path:
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for fname, data, texts, _, _ in items:
        (out / "images" / fname).write_bytes(data)
        lines.append(f"{texts[0]}\timages/{fname}")
    (out / "captions.tsv").write_text("\n".join(lines) + "\n")
    return out


def write_folder(items, out: Path) -> Path:
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = ["file\tcaption"]
    for fname, data, texts, _, _ in items:
        (out / "images" / fname).write_bytes(data)
        lines += [f"{fname}\t{t}" for t in texts]
    (out / "captions.tsv").write_text("\n".join(lines) + "\n")
    return out


def write_layouts(out: str | Path, n_images: int = 200, seed: int = 0, image_size: int = 128) -> dict[str, Path]:
    """Generate ``n_images`` scenes (pipeline/synthetic/generate.py) under ``out/source`` and write them
    in each layout under ``out/<layout>`` (replaced if present); return the layout folders."""
    from pipeline.synthetic.generate import generate

    out = Path(out).resolve()
    generate(out / "source", n_images=n_images, seed=seed, image_size=image_size, captions_per_image=2)
    items = _images_and_captions(out / "source")
    paths = {}
    for layout, write in (("webdataset", write_webdataset), ("cc3m", write_cc3m), ("folder", write_folder)):
        shutil.rmtree(out / layout, ignore_errors=True)
        paths[layout] = write(items, out / layout)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.synthetic.own_formats", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write <out>/webdataset, <out>/cc3m, <out>/folder in (e.g. data/own)")
    ap.add_argument("--n-images", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    for layout, p in write_layouts(a.out, a.n_images, a.seed).items():
        print(f"{layout:<11} {p}")


if __name__ == "__main__":
    main()
