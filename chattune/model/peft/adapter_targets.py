"""What a LoRA adapter reaches in a mixture-of-experts model, decided before peft sees the config, and said.

transformers 5 stores an MoE layer's experts as stacked 3-D parameters (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), not as nn.Linear modules, so `all-linear` alone does not reach them. peft reaches
them only in the families it converts for adapters trained on transformers 4 (Qwen3-MoE, DeepSeek-V3,
Mixtral...), and that conversion also moves every linear named like a transformers-4 expert projection to the
experts: a dense layer's or a shared expert's `down_proj` silently gets no adapter (huggingface/peft#3711, up to
peft 0.21; 0.22 keeps the module), and it runs again when peft loads the adapter. gpt-oss and Qwen3.5-MoE experts
are not reached at all.

So on a model with stacked experts chattune names the targets itself: peft's `target_parameters` for every
expert stack (gpt-oss's biases excepted: peft adapts weights), every linear layer but the output layer and the
router as `target_modules`, and the router's weight only with `peft.train_router`. peft's own conversion is
then asked what it would change when the adapter is loaded: a module it would move is left out of
`all-linear` with the reason logged, and refused when named. A model without stacked experts keeps the
config as the user wrote it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from chattune.errors import UserError

logger = logging.getLogger(__name__)

ROUTER_NAMES = ("gate", "router")  # an MoE block's router, next to its `experts`
SCORE_HEADS = ("score", "classifier")  # a sequence classifier's head, trained in full (peft's SEQ_CLS)


@dataclass
class AdapterTargets:
    """peft's `target_modules` and `target_parameters`, and the linears `all-linear` leaves out (with why)."""

    modules: list[str] | str
    parameters: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding an `experts` child whose weights are stacked 3-D parameters, by path."""
    return {
        path: module
        for path, module in model.named_modules()
        if isinstance(getattr(module, "experts", None), nn.Module)
        and any(p.ndim == 3 for p in _unwrapped(module.experts).parameters(recurse=False))
    }


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module under peft's wrappers (a wrapped parameter's module sits under nested `base_layer`s)."""
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def expert_stacks(model: nn.Module) -> list[str]:
    """Every stacked expert weight by its full name (`...mlp.experts.gate_up_proj`), wrapped or not."""
    return [
        f"{path}.experts.{name}"
        for path, block in moe_blocks(model).items()
        for name, parameter in _unwrapped(block.experts).named_parameters(recurse=False)
        if parameter.ndim == 3
    ]


def routers(model: nn.Module) -> dict[str, nn.Module]:
    """Each MoE block's router (its `gate` or `router` child), by path."""
    return {
        f"{path}.{name}": getattr(block, name)
        for path, block in moe_blocks(model).items()
        for name in ROUTER_NAMES
        if isinstance(getattr(block, name, None), nn.Module)
    }


def resolve_targets(model: PreTrainedModel, settings, task_type: str) -> AdapterTargets:
    """The targets of `peft.target_modules` (`all-linear` or names) on `model`: unchanged without stacked
    experts; with them, explicit module and parameter names that peft loads back as they trained."""
    stacks = expert_stacks(model)
    named = settings.target_modules
    if not stacks:
        return AdapterTargets(named if named == "all-linear" or not isinstance(named, str) else [named])
    router_paths = routers(model)
    linear_routers = [path for path, module in router_paths.items() if isinstance(module, nn.Linear)]
    router_weights = [f"{path}.weight" for path, m in router_paths.items() if not isinstance(m, nn.Linear)]
    if named == "all-linear":
        modules = [path for path in _linear_paths(model, task_type) if path not in router_paths]
        parameters = list(stacks)
    else:
        names = [named] if isinstance(named, str) else list(named)
        experts = {f"{path}.experts" for path in moe_blocks(model)}  # reached through their stacks
        modules = [name for name in names if _names_a_module(model, name, skip=experts)]
        parameters = [s for s in stacks if any(_matches(s, n) or _matches(s.rsplit(".", 1)[0], n) for n in names)]
    if getattr(settings, "train_router", False):
        modules += [path for path in linear_routers if path not in modules]
        parameters += router_weights
    moved = _moved_by_peft(model, modules, parameters, settings)
    if moved and named != "all-linear":
        raise UserError(
            f"peft.target_modules: {', '.join(sorted({m.rsplit('.', 1)[-1] for m in moved}))} on "
            f"{type(model).__name__}: peft moves a target of that name to the stacked experts when it loads the "
            "adapter (its conversion of transformers-4 MoE adapters, huggingface/peft#3711), so those layers' "
            "adapters would not load; use peft.target_modules=all-linear (it adapts the experts and says what it "
            "leaves out), or name other modules"
        )
    modules = [m for m in modules if m not in moved]
    if _moved_by_peft(model, modules, parameters, settings):  # what is left must load exactly as it trains
        raise UserError(
            f"peft.target_modules: peft would change the targets of this adapter on {type(model).__name__} when "
            "loading it (its conversion of transformers-4 MoE adapters); name the modules to adapt explicitly"
        )
    return AdapterTargets(modules, parameters, sorted(moved))


def _linear_paths(model: PreTrainedModel, task_type: str) -> list[str]:
    """What peft's `all-linear` takes: every nn.Linear and Conv1D but the output layer (or the score head)."""
    heads = {model.get_output_embeddings()} if task_type == "CAUSAL_LM" else set()
    heads |= {getattr(model, name) for name in SCORE_HEADS if task_type == "SEQ_CLS" and hasattr(model, name)}
    return [
        path
        for path, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and module not in heads
    ]


def _matches(path: str, name: str) -> bool:
    return path == name or path.endswith("." + name)


def _names_a_module(model: nn.Module, name: str, skip: set[str]) -> bool:
    return any(_matches(path, name) for path, _ in model.named_modules() if path and path not in skip)


def _moved_by_peft(model: PreTrainedModel, modules: list[str], parameters: list[str], settings) -> list[str]:
    """The module targets peft's transformers-4 conversion would turn into other targets, on loading."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers,
            get_model_conversion_mapping,
        )
    except ImportError:  # a peft without the conversion: nothing moves
        return []
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(modules))
    config.target_parameters = list(parameters)
    probe = copy.deepcopy(config)
    convert_peft_config_for_transformers(probe, model=model, conversions=get_model_conversion_mapping(model))
    # Compared by what the names reach in this model, not as names: peft 0.22 keeps a module name it used to move
    # (huggingface/peft#3711) and adds it to the parameters too, where it reaches the stacks already targeted.
    module_paths = [path for path, _ in model.named_modules() if path]
    parameter_paths = [path for path, _ in model.named_parameters(remove_duplicate=False)]
    kept = _reached(module_paths, probe.target_modules or [])
    moved = [m for m in modules if not _reached(module_paths, [m]) <= kept]
    changed = _reached(parameter_paths, probe.target_parameters or []) != _reached(parameter_paths, parameters)
    if not moved and (changed or probe.rank_pattern):
        return ["<the target parameters>"]  # changed in another way: the caller refuses
    return moved


def _reached(paths: list[str], names) -> set[str]:
    """The `paths` (of modules or parameters) that peft's target `names` reach: a path or its last parts."""
    names = [names] if isinstance(names, str) else list(names)
    return {path for path in paths if any(_matches(path, name) for name in names)}


GROUPS = ("attention", "dense MLP", "experts", "router", "other")


def parameter_group(name: str, router_paths: list[str]) -> str:
    """Which part of a decoder a (trainable) parameter adapts, by its name."""
    plain = name.replace(".base_layer", "")
    if any(plain.startswith(path + ".") for path in router_paths):
        return "router"
    parts = plain.split(".")
    if "experts" in parts:
        return "experts"
    if any(p in parts for p in ("mlp", "feed_forward", "ffn", "shared_expert", "shared_experts", "block_sparse_moe")):
        return "dense MLP"
    if any("attn" in p or "attention" in p or "mixer" in p for p in parts):
        return "attention"
    return "other"


def trainable_by_group(model: nn.Module) -> dict[str, int]:
    """Trainable parameter counts per group (attention, dense MLP, experts, router, other)."""
    router_paths = list(routers(model))
    counts = dict.fromkeys(GROUPS, 0)
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            counts[parameter_group(name, router_paths)] += parameter.numel()
    return counts


def describe_adapters(model: nn.Module, targets: AdapterTargets) -> str:
    """The start-up line: the adapter's trainable parameters per group, and what `all-linear` left out."""
    counts = trainable_by_group(model)
    line = "adapter: trainable parameters " + ", ".join(f"{group} {n:,}" for group, n in counts.items())
    if expert_stacks(model) and counts["experts"] == 0:
        line += " (the experts are not adapted: peft.target_modules names none of their stacks)"
    if targets.left_out:
        leaves = sorted({path.rsplit(".", 1)[-1] for path in targets.left_out})
        line += (
            f"; left out of all-linear: {len(targets.left_out)} linear layers named {', '.join(leaves)}, which "
            "peft would move to the stacked experts when loading the adapter (huggingface/peft#3711)"
        )
    return line


def quantized_experts_note(model: nn.Module, dtype: str) -> str | None:
    """QLoRA's start-up note on an MoE model: its expert stacks are not in 4 bits."""
    from chattune.model.quantization.quantize import is_quantized

    stacks = [name for name in expert_stacks(model) if not is_quantized(_stack(model, name))]
    if not stacks:
        return None
    return (
        f"QLoRA: the {len(stacks)} stacked expert weights stay in {dtype} (bitsandbytes quantizes linear layers "
        "only); their adapters train as with LoRA"
    )


def _stack(model: nn.Module, name: str):
    path, _, leaf = name.rpartition(".")
    return getattr(_unwrapped(model.get_submodule(path)), leaf)
