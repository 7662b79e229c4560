"""LoRA adapters through peft: injected into the HF model before sharding, the base frozen.

`add_adapters` calls peft's `get_peft_model`, which injects the LoRA layers into the model in place (the
HF model object stays the one `PackedCausalLM` runs; the returned PeftModel is kept for what peft owns:
switching the adapters off, its config and its adapter file format). Everything but the adapters is
frozen, so the optimizer, its state and the checkpoints hold only those.

On a meta-built model (loaded shard by shard, `chattune.model.io.load`) peft's initialisation of the adapters
is a no-op; they are given CPU memory and initialised here with peft's own `reset_lora_parameters` (seeded
like the rest of the run), and `initial_values` hands them to the loader, which writes them into their
shards after FSDP2 allocates them. DoRA's magnitudes are the norms of the base weights' rows: they are
computed after the base is loaded (`set_dora_magnitudes`).
"""

from __future__ import annotations

import difflib
import logging
import re
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import PreTrainedModel

from chattune.config.schema import PeftConfig
from chattune.data.packing import PackedBatch
from chattune.distributed import whole_tensor
from chattune.model.peft.adapter_targets import AdapterTargets, describe_adapters, expert_stacks, resolve_targets

if TYPE_CHECKING:  # peft (and the bitsandbytes it imports) is imported where adapters are made: seconds per process
    from peft import LoraConfig, PeftModel
from chattune.errors import UserError
from chattune.model.quantization import quantize

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's name for the one adapter
LORA_PARAMETER = re.compile(r"\.lora_(A|B|magnitude_vector|embedding_A|embedding_B)\.")


ALL_LINEAR = "all-linear"


def target_names(settings: PeftConfig) -> str | list[str]:
    """peft.target_modules as chattune reads it: `all-linear`, or module names (a single string is one name;
    peft itself would take it as a regular expression over full module paths)."""
    target = settings.target_modules
    if isinstance(target, str):
        return target if target == ALL_LINEAR else [target]
    return list(target)


def check_module_names(hf_model: PreTrainedModel, settings: PeftConfig) -> None:
    """Every name in peft.target_modules and peft.modules_to_save must name modules of the model (peft matches
    a name against the end of a module's path, and silently trains nothing for a name that matches none),
    with the nearest names the model has suggested."""
    # An MoE model's stacked expert weights are parameters, named like modules (`down_proj`, `gate_up_proj`).
    paths = [name for name, _ in hf_model.named_modules() if name] + expert_stacks(hf_model)
    leaves = sorted({path.rsplit(".", 1)[-1] for path in paths})
    targets = target_names(settings)
    for key, names in (
        ("peft.target_modules", [] if targets == ALL_LINEAR else targets),
        ("peft.modules_to_save", list(settings.modules_to_save or [])),
    ):
        for name in names:
            if not any(path == name or path.endswith("." + name) for path in paths):
                near = difflib.get_close_matches(name, leaves, n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(near)}?" if near else f" (its modules: {', '.join(leaves[:20])})"
                raise UserError(f"{key}: {name!r} names no module of {type(hf_model).__name__}{hint}")


def lora_config(
    settings: PeftConfig, task_type: str = "CAUSAL_LM", targets: AdapterTargets | None = None
) -> LoraConfig:
    """The `peft` config section as peft's LoraConfig, for peft's `task_type` (`chattune.model.head.kinds`: SEQ_CLS
    makes peft train a sequence-classification model's score head in full, next to the adapters), over the
    resolved `targets` (`chattune.model.peft.adapter_targets`; default: the names as written)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets.modules if targets is not None else target_names(settings),
        target_parameters=(targets.parameters or None) if targets is not None else None,
        use_dora=settings.use_dora,
        modules_to_save=list(settings.modules_to_save) if settings.modules_to_save else None,
        # A tied model has one embedding matrix: training embed_tokens or lm_head trains it, as one tensor
        # read at the input and the output (as full fine-tuning would), not two copies that drift apart.
        ensure_weight_tying=bool(settings.modules_to_save),
        task_type=task_type,
    )


def add_adapters(hf_model: PreTrainedModel, settings: PeftConfig, task_type: str = "CAUSAL_LM") -> PeftModel:
    """Inject LoRA adapters into `hf_model` in place and freeze the rest; returns peft's wrapper. A meta-built
    model's adapters are initialised here, its DoRA magnitudes (which need the base weights) by
    `set_dora_magnitudes` once the base is loaded. A 4-bit base (QLoRA) is quantized after this, under the
    adapters (`chattune.model.quantization.quantize`)."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    check_module_names(hf_model, settings)
    targets = resolve_targets(hf_model, settings, task_type)
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`: once per rank
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(hf_model, lora_config(settings, task_type, targets))
    head = hf_model.get_output_embeddings() if task_type == "CAUSAL_LM" else None
    if isinstance(head, LoraLayer):  # the losses read the output layer's weight and bias, never its forward
        raise UserError(
            "peft.target_modules: names the output layer, whose LoRA adapter chattune's losses would never train "
            "(they compute the logits from its weight and bias, not through its forward); train it in full with "
            "peft.modules_to_save instead"
        )
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, LoraLayer) and any(p.is_meta for p in module.lora_A.parameters()):
                module.lora_A.to_empty(device="cpu")
                module.lora_B.to_empty(device="cpu")
                module.reset_lora_parameters(ADAPTER, True)  # peft's default init: kaiming A, zero B
    logger.info(describe_adapters(hf_model, targets))
    return peft_model


def is_dora_magnitude(name: str) -> bool:
    return ".lora_magnitude_vector." in name


@torch.no_grad()
def set_dora_magnitudes(hf_model: PreTrainedModel) -> None:
    """DoRA's magnitudes of a model loaded shard by shard: the row norms of W + scaling * B @ A, computed as
    peft computes them when the weights are in memory. Collective (A is gathered whole). A magnitude is
    sharded along its rows like its layer's weight (FSDP2 shards both along dim 0, with the same chunking),
    so each rank computes its own rows from its own rows of W and B."""
    from peft.tuners.lora import LoraLayer

    for module in hf_model.modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_magnitude_vector:
            continue
        magnitude = module.lora_magnitude_vector[ADAPTER].weight
        weight, a, b = module.get_base_layer().weight, module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        a = whole_tensor(a).to(a.device)  # (back to the host under CPU offload)
        local_b = b.to_local() if isinstance(b, DTensor) else b
        local_magnitude = magnitude.to_local() if isinstance(magnitude, DTensor) else magnitude
        if isinstance(weight, DTensor):
            local_weight = weight.to_local()
        else:  # a 4-bit base: replicated whole, take this rank's rows
            first = _first_row(magnitude)
            local_weight = quantize.dequantized(weight)[first : first + local_magnitude.shape[0]]
        rows = local_weight.float() + module.scaling[ADAPTER] * (local_b.float() @ a.float())
        local_magnitude.copy_(torch.linalg.norm(rows, dim=1))


def _first_row(tensor: torch.Tensor) -> int:
    if not isinstance(tensor, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return offset[0]


def initial_values(hf_model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Parameters that already hold values on a meta-built model (the adapters), by name."""
    return {
        name: p.detach().clone()
        for name, p in hf_model.named_parameters()
        if not p.is_meta and not quantize.is_quantized(p)
    }


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class BaseModelView:
    """The policy with its adapters switched off: its frozen base model, a DPO reference without a second
    copy of the weights in memory. Each call runs in eval mode and restores the policy's mode; `eval`,
    `train` and `requires_grad_` are no-ops (the policy's mode and trainable adapters are its own), and it
    reads as in eval mode."""

    training = False

    def __init__(self, model: nn.Module, peft_model: PeftModel):
        self.model, self.peft_model = model, peft_model

    def eval(self) -> BaseModelView:
        return self

    def train(self, mode: bool = True) -> BaseModelView:
        return self

    def requires_grad_(self, requires_grad: bool = True) -> BaseModelView:
        return self

    def modules(self):
        """The policy's modules (what resharding the view frees: `chattune.parallel.fsdp.reshard`)."""
        return self.model.modules()

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.peft_model.disable_adapter():
                return self.model(batch)
        finally:
            self.model.train(was_training)
