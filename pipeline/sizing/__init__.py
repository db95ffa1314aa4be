"""Sizing a run before it starts (``pipeline plan``): rows, bytes on disk, forward cost and wall time per stage.

* :mod:`pipeline.sizing.dataset`: the dataset's size, counted by its reader (no image opened), and a
  sample of its records for per-image shapes (captions, caption lengths, instances, relations);
* :mod:`pipeline.sizing.shapes`: each model slot's output shapes (from the model's config, the
  adapters' random presets, or a cited table of the published checkpoints) and forward FLOPs
  (counted on the meta device: no weights, no compute);
* :mod:`pipeline.sizing.artifacts`: bytes on disk per artifact, from those shapes and the exact
  container layout (npy headers, 512-byte tar blocks, Parquet written for a few calibration rows);
* :mod:`pipeline.sizing.plan`: the calibration (seconds per image measured on this machine),
  wall time on the manifest's cluster, the table, ``--json`` and the free-space check.
"""
