"""Readers that turn stage artifacts into training batches, one module per artifact, on
:mod:`pipeline.io.shards` (WebDataset shards) and :mod:`pipeline.io.artifacts` (tables)."""
