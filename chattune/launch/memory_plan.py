"""The memory plan `chattune validate` ends with: the estimate (`chattune.model.cost.memory`) of a run of a config on
some number of ranks, on the device and in the compute dtype it plans (`planned_device`): the CPU run the config
asks for, this machine's GPU, or a GPU of a given size planned from a machine without one; its header says which."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class MemoryPlan:
    """End the report with the memory estimate's table (`chattune.model.cost.memory`), planned for a GPU of
    `device_memory` bytes (its CUDA-only settings checked as on that GPU; a `device=cpu` run: its memory per rank);
    None: this machine's GPU, else the CPU."""

    device_memory: int | None = None


def planned_device(device: str, device_memory: int | None, cuda_here: bool) -> tuple[bool, str]:
    """(whether the plan is for CUDA, the line that says which device was planned and why) for a run of `device`
    (the config's: auto, cpu or cuda), `--device-memory` (`device_memory`) and whether this machine has CUDA."""
    if device == "cpu":
        return False, "device=cpu: the run computes on the CPU, and its ranks on one host share its memory"
    if cuda_here:
        return True, "this machine's GPU" if device_memory is None else "a GPU of the size --device-memory gives"
    if device_memory is None:
        return False, (
            "device=auto on a machine without a GPU: the run computes on the CPU, and its ranks on one host share "
            "its memory"
        )
    return True, (
        "a GPU planned with --device-memory: this machine has none, and a launch here would compute on the CPU in "
        "float32, which device=cpu plans"
    )


def memory_table(cfg: DictConfig, ranks: int, device_memory: int | None) -> str:
    """The memory estimate of a run of `cfg` on `ranks` ranks (`chattune.model.cost.memory`) on the device it plans
    (`planned_device`), with the verdict against `device_memory` bytes, else this machine's GPU's memory (the CPU
    without --device-memory: no verdict)."""
    import torch

    from chattune.data.templates.tokenizer import load_tokenizer
    from chattune.distributed import ParallelDims, usable_device_memory
    from chattune.model.cost.memory import hf_config_of, inputs_of
    from chattune.model.cost.memory_advice import report

    on_cuda, why = planned_device(str(cfg.device), device_memory, torch.cuda.is_available())
    given = device_memory is not None
    if device_memory is None and on_cuda:  # this machine's GPU: what a run could allocate there now
        device_memory = usable_device_memory(torch.device("cuda", 0))
    tokenizer_size = None if cfg.model.path is not None else len(load_tokenizer(cfg.tokenizer))
    try:
        layout = ParallelDims.from_config(cfg.parallel, ranks)
    except ValueError as error:  # a layout of several ranks, planned without --ranks (the rules skip the ranks then)
        return f"memory per rank: not estimated on {ranks} rank(s): {error}; pass --ranks N, the launch's ranks"
    inputs = inputs_of(cfg, hf_config_of(cfg, tokenizer_size), layout, on_cuda)
    where = "on a GPU" if on_cuda else "on the CPU"
    header = (
        f"memory per rank, estimated {where} ({ranks} rank(s), {inputs.tokens} tokens a microbatch, "
        f"{str(inputs.compute_dtype).removeprefix('torch.')} compute; --ranks N, --device-memory SIZE):\n  ({why})"
    )
    if on_cuda and given:
        header += (
            "\n  (a launch compares with what its GPU has free, less than the total by the CUDA context, NCCL's "
            "buffers and other processes)"
        )
    return header + "\n" + report(inputs, device_memory)[1]
