"""C3 concept mining (Song et al. 2024): vectorised miner, plain-Python reference, normalisation."""
from .mining import MiningParams, mine  # noqa: F401
