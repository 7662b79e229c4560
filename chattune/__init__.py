"""chattune: fine-tuning recipes for chat LLMs on packed, padding-free batches with FSDP2.

The library holds the pieces every recipe shares (data, packing, attention, loss, the update step,
metrics, checkpointing); the recipes in `recipes/` tell the training story with them.
"""

import logging

__version__ = "0.1.0"

# bitsandbytes, which peft imports whenever it is installed, warns at import that its CPU backend's
# optional `kernels` package is missing (bitsandbytes 0.50). chattune trains 4-bit bases on CUDA only, so
# on the CPU that warning is noise, and it would stand before a launch's one clear error message.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# torchao (low-bit optimizers, float8; transformers imports it whenever it is installed) warns at import that its
# CUDA-only kernels do not load on a machine without CUDA, and torch 2.13 that torchao registers two enums the old
# way: noise before every run's first line. Its kernel warnings stay where CUDA is (there they mean something).
# torch is not imported here (the recipe table and the CLI's parser promise not to): the filter asks it at log time,
# when torchao has imported it.


class _CudaKernelsOnCpu(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Failed to load"):
            return True
        import torch

        return torch.cuda.is_available()


logging.getLogger("torchao").addFilter(_CudaKernelsOnCpu())
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

# A recipe copied before a module moved gets an error naming its new place (chattune/moved.py)
from chattune import moved as _moved  # noqa: E402

_moved.install()
