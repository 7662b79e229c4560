"""chattune: fine-tuning recipes for chat LLMs on packed, padding-free batches with FSDP2.

The library holds the pieces every recipe shares (data, packing, attention, loss, the update step,
metrics, checkpointing); the recipes in `recipes/` tell the training story with them.
"""

import logging

import torch

__version__ = "0.1.0"

# bitsandbytes, which peft imports whenever it is installed, warns at import that its CPU backend's
# optional `kernels` package is missing (bitsandbytes 0.50). chattune trains 4-bit bases on CUDA only, so
# on the CPU that warning is noise, and it would stand before a launch's one clear error message.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# torchao (the low-bit optimizers; transformers imports it whenever it is installed) warns at import that its
# CUDA-only kernels do not load on a machine without CUDA, and torch 2.13 that torchao registers two enums the
# old way: noise before every run's first line. On CUDA its kernel warnings stay (there they mean something).
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
if not torch.cuda.is_available():
    logging.getLogger("torchao").setLevel(logging.ERROR)
