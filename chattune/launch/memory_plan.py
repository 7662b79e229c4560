"""The memory plan `chattune validate` ends with: the estimate (`chattune.model.memory`) of a run of a config on
some number of ranks, planned for a GPU of a given size, else this machine's GPU, else the CPU."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class MemoryPlan:
    """End the report with the memory estimate's table (`chattune.model.memory`), planned for a GPU of
    `device_memory` bytes (its CUDA-only settings checked as on that GPU); None: this machine's GPU, else the CPU."""

    device_memory: int | None = None


def memory_table(cfg: DictConfig, ranks: int, device_memory: int | None) -> str:
    """The memory estimate of a run of `cfg` on `ranks` ranks (`chattune.model.memory`), planned for a GPU of
    `device_memory` bytes, else this machine's first GPU, else the CPU (no verdict)."""
    import torch

    from chattune.data.tokenizer import load_tokenizer
    from chattune.distributed import ParallelDims
    from chattune.model.memory import hf_config_of, inputs_of
    from chattune.model.memory_advice import report

    on_cuda = device_memory is not None or (cfg.device != "cpu" and torch.cuda.is_available())
    if device_memory is None and on_cuda:
        device_memory = torch.cuda.get_device_properties(0).total_memory
    vocab = None if cfg.model.path is not None else len(load_tokenizer(cfg.tokenizer))
    layout = ParallelDims.from_config(cfg.parallel, ranks)
    inputs = inputs_of(cfg, hf_config_of(cfg, vocab), layout, on_cuda)
    where = "on a GPU" if on_cuda else "on the CPU"
    header = (
        f"memory per rank, estimated {where} ({ranks} rank(s), {inputs.tokens} tokens a microbatch, "
        f"{str(inputs.compute_dtype).removeprefix('torch.')} compute; --ranks N, --device-memory SIZE):"
    )
    return header + "\n" + report(inputs, device_memory)[1]
