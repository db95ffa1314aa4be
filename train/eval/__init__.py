"""Evaluation: retrieval (two-stage, G.4), SugarCrepe-format compositionality."""
