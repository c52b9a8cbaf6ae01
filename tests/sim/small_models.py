"""Models for the tests that simulate every layout of a space, or many micro-batches one by one."""

from pathlib import Path

# Qwen3-0.6B's shape cut to 8 layers (its spec file): PP 2, 4 and 8, VP and the embedding-and-loss
# split as the full model has them, at under a third of its simulated kernels
EIGHT_LAYERS = str(Path(__file__).parent / "data" / "qwen3-0.6b-8-layers.json")
# Qwen3-30B-A3B's shape cut to 4 layers: its tokens and experts a layer, a twelfth of its matrices
MOE_FOUR_LAYERS = str(Path(__file__).parent / "data" / "qwen3-30b-a3b-4-layers.json")
