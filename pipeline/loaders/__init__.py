"""Readers that turn stage artifacts (WebDataset shards) into training batches."""
