"""chattune: fine-tuning recipes for chat LLMs on packed, padding-free batches with FSDP2.

The library holds the pieces every recipe shares (data, packing, attention, loss, the update step,
metrics, checkpointing); the recipes in `recipes/` tell the training story with them.
"""

__version__ = "0.1.0"
