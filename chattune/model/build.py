"""The model a recipe trains, and DPO's frozen reference: an HF causal LM from a local directory or from
`model.config` (random weights), with the chunked loss head (or, for a reward model, the same decoder under a
score head: `chattune.model.head.kinds`, `chattune.model.sequence_score`), sharded with FSDP2 per decoder layer and
at the root. One builder, so the policy and a reference built from the config get the same weights.

From a directory the model is built on the meta device, sharded, then each rank loads only its own shard
(`chattune.model.io.load`): no rank ever holds the whole model. Random-init models (small, for experiments)
are built whole on the CPU with the run's seed, as before, then sharded: the same weights on every rank
and in every release."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from hydra.utils import instantiate
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from chattune.config.layout_rules import EXPERT_LORA_REFUSED
from chattune.config.schema import LossConfig, ModelConfig, PeftConfig, RunConfig
from chattune.config.typed import config_dict
from chattune.distributed import ParallelDims, usable_device_memory
from chattune.errors import UnsupportedModel, UserError
from chattune.hf_layout import decoder_layers
from chattune.hub import hub_hint, local_directory
from chattune.model.causal_lm import PackedCausalLM, build_hf_model, written_vocab_size
from chattune.model.checks.architecture import check_architecture
from chattune.model.cost.memory import inputs_of, memory_levers
from chattune.model.cost.memory_advice import report
from chattune.model.head.fused_loss import resolve_loss_implementation
from chattune.model.head.kinds import CAUSAL_LM_HEAD, SCORE_HEAD, ModelHead
from chattune.model.io import load
from chattune.model.io.composite import (
    CompositeCheckpoint,
    describe,
    is_composite,
    load_whole,
    read_composite,
    text_config_of,
)
from chattune.model.packed import kernels
from chattune.model.packed.attention import attention_backend, attention_features
from chattune.model.packed.indexed_attention import indexed_path_name
from chattune.model.packed.kernels import probe_native_gqa, probe_shared_varlen
from chattune.model.packed.mixers import handled_mixers, mixer_path_name
from chattune.model.packed.router_loss import router_loss_for
from chattune.model.peft.adapter_targets import quantized_experts_note
from chattune.model.peft.adapters import add_adapters, initial_values, set_dora_magnitudes, trainable_parameters
from chattune.model.quantization import quantize
from chattune.model.quantization.float8 import convert_linear_layers, fp8_problem
from chattune.model.sequence_score import PackedSequenceScorer, initialise_missing_head, set_padding
from chattune.parallel.expert_parallel import ExpertParallelExperts
from chattune.parallel.fsdp import TORCH_DTYPES, Placement, compile_enabled, compute_dtype, shard_model

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # peft is imported only by runs with adapters (chattune.model.peft.adapters): seconds per process
    from peft import PeftModel


class BuiltModel(NamedTuple):
    hf_model: PreTrainedModel  # the Hugging Face model (with the adapters injected, if any)
    model: PackedCausalLM | PackedSequenceScorer  # the sharded loss-head model around it (FSDP2): what trains
    peft_model: PeftModel | None  # peft's handle on the adapters (None: full fine-tuning)
    placement: Placement  # where and how `model` computes (`chattune.parallel.fsdp.shard_model`'s record)


def build_trained_model(
    cfg: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    dims: ParallelDims,
    head: ModelHead = CAUSAL_LM_HEAD,
    log_memory: bool = True,
) -> BuiltModel:
    """The model a recipe trains: model.path (or model.config) ending in `head`, with the `peft` section's
    adapters, sharded, in training mode, its size logged; with `log_memory`, rank 0 logs the run's memory table
    first (a training run's: an export, which builds the same model, does not)."""
    built = build_sharded_model(
        sections=ModelSections.of(cfg),
        tokenizer=tokenizer,
        dims=dims,
        source=ModelSource(cfg.model.path),
        adapters=cfg.peft,
        head=head,
        memory_table=(lambda hf_config: log_memory_estimate(cfg, hf_config, dims)) if log_memory else None,
        levers=memory_levers(cfg),
    )
    built.model.train()  # from_pretrained returns eval mode, which also switches HF activation checkpointing off
    # (a 4-bit weight counts its matrix's elements)
    num_params = sum(quantize.weight_shape(p).numel() for p in built.hf_model.parameters())
    trained = sum(p.numel() for p in trainable_parameters(built.model))  # the adapters with peft=lora
    logger.info(
        "model: %s, %.2fM parameters (%.2fM trained), %d rank(s) on %s",
        type(built.hf_model).__name__,
        num_params / 1e6,
        trained / 1e6,
        dims.world_size,
        dims.device,
    )
    return built


def log_memory_estimate(cfg: RunConfig, hf_config, dims: ParallelDims) -> None:
    """Rank 0's start-up table of the run's memory per rank (`chattune.model.cost.memory`), a warning if it will not
    fit the device."""
    on_cuda = dims.device.type == "cuda"
    try:
        inputs = inputs_of(cfg, hf_config, dims, on_cuda)
    except (AttributeError, KeyError) as error:  # a config without the keys a run has (a library caller's)
        logger.warning("memory per rank: not estimated (the config lacks %s)", error)
        return
    device_memory = usable_device_memory(dims.device) if on_cuda else None
    estimated, table = report(inputs, device_memory, "device memory free for the run")
    total = estimated.total
    if device_memory is not None and total is not None and total > device_memory:
        logger.warning("memory per rank, estimated: this run will not fit the device\n%s", table)
    else:
        logger.info("memory per rank, estimated:\n%s", table)


@dataclass(frozen=True)
class ModelSections:
    """The run's sections a model's building reads, and no others: `model` (its config, FSDP2, compile, float8),
    `loss` (the head's implementation and chunk, the router loss's coefficient) and the run's `seed`."""

    model: ModelConfig
    loss: LossConfig
    seed: int
    shared_prompts: bool = False  # data.share_prompts: the model must compute replies continuing a shared prompt

    @classmethod
    def of(cls, cfg: RunConfig) -> ModelSections:
        return cls(cfg.model, cfg.loss, cfg.seed, cfg.data.share_prompts)


@dataclass(frozen=True)
class ModelSource:
    """Which of a run's models is built and from where: its `role` (the "policy" it trains, or a frozen
    "reference"), its `path` (a directory or a hub id; None: built from model.config) and the config key that path
    comes from (what a message about it names)."""

    path: str | None
    key: str = "model.path"
    role: str = "policy"


def build_sharded_model(
    *,
    sections: ModelSections,
    tokenizer: PreTrainedTokenizerBase,
    dims: ParallelDims,
    source: ModelSource,
    adapters: PeftConfig | None = None,
    head: ModelHead = CAUSAL_LM_HEAD,
    memory_table: Callable[[Any], None] | None = None,
    levers: str = "",
) -> BuiltModel:
    """The model of `source` (its role's: the policy or a reference) loaded from its path (a local directory or a
    hub id, `chattune.hub`), or built from `sections.model.config` when the path is None, ending in `head`
    (`chattune.model.head.kinds`: a causal LM's output layer, or a reward model's score head), with LoRA `adapters`
    (the `peft` section) on its frozen base when given, sharded. `memory_table`: called with the model's HF
    config on rank 0 before a weight loads (the trained model's builder logs the run's memory table there, a
    reference built alike does not); `levers`: the memory levers the start-up line names."""
    path, key = source.path, source.key
    # The same seed on every rank, and for every model built: identical initial weights before sharding.
    torch.manual_seed(sections.seed)
    files, stored_dtype, composite = None, None, None
    if path is None:
        # _convert_="all": plain lists and dicts (transformers 5 configs validate `layer_types` as a list)
        config = instantiate(sections.model.config, _convert_="all")
        vocab_size = written_vocab_size(sections.model.config, len(tokenizer))  # the user's, else the tokenizer's
        hf_model = build_hf_model(tokenizer, config=config, head=head, vocab_size=vocab_size)  # whole, on CPU
        if memory_table is not None and dims.is_main:  # what the run will take per rank
            memory_table(hf_model.config)
    else:
        directory = local_directory(path, key)  # a hub id: downloaded once per node (collective)
        if not directory.is_dir():
            raise UserError(f"{key} {path!r} is not a local directory{hub_hint(path, 'model')}")
        stored_config = AutoConfig.from_pretrained(directory)
        if memory_table is not None and dims.is_main:  # what the run will take per rank, before loading a weight
            memory_table(stored_config)
        hf_model, files, composite = _empty_or_full(directory, head)
        stored_dtype = load.source_dtype(stored_config)
        check_vocabulary(hf_model, tokenizer)
    if head is SCORE_HEAD:
        if dims.cp > 1:  # the schema of the reward recipe refuses it first
            raise UserError("parallel.context: a reward model runs every packed row whole; set parallel.context=1")
        set_padding(hf_model, tokenizer)
    # on a random-init miniature: the real weights may not exist yet
    device_type = dims.device.type
    dtype = compute_dtype(sections.model.fsdp.param_dtype, device_type)
    check_architecture(hf_model.config, dims.device, dims.cp_group, dtype, sections.shared_prompts)
    if adapters is not None and dims.ep > 1:
        raise UserError(f"peft: {EXPERT_LORA_REFUSED}; set parallel.expert=1 or train without adapters")
    peft_model = add_adapters(hf_model, adapters, head.peft_task_type) if adapters is not None else None
    if adapters is not None and adapters.quantize_base is not None:  # QLoRA: the frozen base's linears in 4 bits
        quantize.quantize_linears(decoder_layers(hf_model), adapters.quantize_base, TORCH_DTYPES[dtype], dims.device)
        if note := quantized_experts_note(hf_model, dtype):
            logger.info(note)
    implementation = resolve_loss_implementation(sections.loss.implementation, device_type, dtype)
    # The chunked head's matmuls (and only those: `chattune.model.head.chunked_loss`) in TF32 on CUDA, where bf16/fp16
    # inputs make its forward exact in TF32.
    tf32_head = device_type == "cuda" and dtype != "float32" and implementation == "chunked"
    if device_type == "cuda":
        probe_native_gqa(dims.device)  # before any layer is compiled: the attention reads what it settles
        if sections.shared_prompts:  # rows with shared prompts on the varlen kernel only where it agrees here
            probe_shared_varlen(dims.device)
    initial = initial_values(hf_model) if files is not None else None  # the adapters of a meta-built model
    replicated = quantize.replicated_parameters(hf_model)
    compile = _compiles(
        sections.model.compile, device_type, quantized=bool(replicated), tensor_parallel=dims.splits_layers
    )
    router_loss = router_loss_for(hf_model, sections.loss.router_aux_coef)
    if router_loss is not None and head is SCORE_HEAD:
        raise UserError(
            f"loss.router_aux_coef: {type(hf_model).__name__} would train with its router load-balancing loss, "
            "which the reward recipe does not add to its loss; set loss.router_aux_coef=0"
        )
    if router_loss is not None and dims.cp > 1:
        raise UserError(
            f"loss.router_aux_coef: {type(hf_model).__name__} trains with its router load-balancing loss, "
            "computed per document, and parallel.context>1 splits documents across ranks; set "
            "loss.router_aux_coef=0 to train without it, or parallel.context=1"
        )
    fp8 = getattr(sections.model, "fp8", None)  # (a library caller's config may leave it out)
    if fp8:
        problem = fp8_problem(fp8, dims.device, adapted=adapters is not None)
        if problem:
            raise UserError(f"model.fp8: {problem}")
    # The context group set on the model (its attention modules and its loss read it there), before compiling.
    packed = (
        PackedSequenceScorer(hf_model, stored_dtype)
        if head is SCORE_HEAD
        else PackedCausalLM(
            hf_model,
            sections.loss.chunk_size,
            implementation,
            stored_dtype,
            tf32_head,
            router_loss,
            context_group=dims.cp_group,
        )
    )
    if fp8:  # the decoder layers' linear layers, before compiling and sharding them
        converted = convert_linear_layers(decoder_layers(packed), fp8)
        logger.info("model.fp8=%s: %d linear layers of the decoder in float8 (torchao)", fp8, converted)
    placement = shard_model(packed, dims, **config_dict(sections.model.fsdp), compile=compile, replicated=replicated)
    describe_compute(packed, placement, levers, sections.shared_prompts)
    if dims.cp > 1:
        logger.info(
            "context parallelism: %d ranks share each packed row (a slice each; attention exchanged all-to-all)",
            dims.cp,
        )
    # What the export writes back: the composite's layout (None: the model's own). A reward model is a text
    # sequence classifier, which no composite class holds: it is exported as one.
    packed.composite = composite if head is CAUSAL_LM_HEAD else None
    if files is not None:
        keys = composite.stored_names if composite is not None else None
        load.materialise_and_load(
            packed, hf_model, directory, files, dims.device, initial, keys, cpu_offload=placement.cpu_offload
        )
    if adapters is not None and adapters.use_dora:
        set_dora_magnitudes(hf_model)  # from the loaded (or quantized) base: the norms of the weights it runs with
    return BuiltModel(hf_model, packed, peft_model, placement)


_described: set[str] = set()


def _compiles(setting: bool | str, device_type: str, quantized: bool, tensor_parallel: bool) -> bool:
    """model.compile for this model: `auto` leaves uncompiled what is not verified compiled here (bitsandbytes'
    4-bit layers, a tensor-parallel model's DTensor plans), saying so; `true` still asks for a 4-bit base and is
    refused for a tensor-parallel model."""
    compile = compile_enabled(setting, device_type)
    if compile and tensor_parallel:
        if setting != "auto":
            raise UserError(
                "model.compile=true: compiling a tensor-parallel model is not built; set model.compile=auto"
            )
        logger.info("model.compile=auto: not compiling the decoder layers of a tensor-parallel model")
        return False
    if compile and quantized and setting == "auto":
        logger.info("model.compile=auto: not compiling the decoder layers of a 4-bit base")
        return False
    return compile


def shared_prompt_attention(device_type: str) -> str:
    """The start-up line's words for the attention of rows with shared prompts (`chattune.model.packed.attention`)."""
    if device_type == "cuda" and kernels._shared_varlen:
        return (
            " (rows with shared prompts: the varlen kernel with each segment's prompt keys gathered before its own, "
            "where a layer takes it; otherwise per-segment SDPA)"
        )
    return " (rows with shared prompts: per-segment SDPA with each prompt's keys, a loop outside compiled graphs)"


def describe_compute(
    model: PackedCausalLM | PackedSequenceScorer, placement: Placement, levers: str = "", shared_prompts: bool = False
) -> None:
    """Log once what a step runs: the attention path (and that of rows with `shared_prompts`), the output layer's loss
    (or the score head), whether the decoder layers are compiled and the memory `levers` in use; warn where a setting
    makes the CUDA path slow (nothing falls back silently)."""
    device_type, dtype = placement.device.type, placement.compute_dtype
    line = (
        f"compute: {dtype} on {device_type}; attention: "
        f"{attention_backend(device_type, dtype, attention_features(model.hf_model))}"
        f"{shared_prompt_attention(device_type) if shared_prompts else ''}; "
        f"{model.describe_head()}; "
        f"decoder layers {'compiled' if placement.compiled else 'not compiled'}; "
        f"mesh: {placement.dims.describe()}"
    )
    mixer_paths = mixer_path_name(set(handled_mixers(model.hf_model).values()), device_type)
    if mixer_paths:
        line += f"; sequence mixers: {mixer_paths}"
    indexed = indexed_path_name(model.hf_model)
    if indexed:
        line += f"; {indexed}"
    transform = getattr(model, "logit_transform", None)  # a causal LM's (a score head has none)
    if transform is not None and transform.describe():
        line += f"; output logits: {transform.describe()}"
    experts = experts_implementation(model.hf_model, placement.compiled, dtype)
    if experts:
        line += f"; experts: {experts}"
    if model.router_loss is not None:
        line += f"; {model.router_loss.describe()}"
    if levers:
        line += f"; levers: {levers}"
    if line in _described:  # a DPO reference built like the policy: said once
        return
    _described.add(line)
    logger.info(line)
    if device_type == "cuda" and dtype == "float32":
        logger.warning(
            "model.fsdp.param_dtype=float32 on CUDA: attention runs per document through SDPA (a loop "
            "over documents, a graph break in every compiled layer) and every matmul in fp32, several "
            "times slower than bf16; model.fsdp.param_dtype=auto computes in bf16 (fp32 masters either way)"
        )


def experts_implementation(hf_model: PreTrainedModel, compiled: bool, compute_dtype: str) -> str | None:
    """How a MoE model's experts run (transformers' `experts_implementation`: grouped_mm, its default where
    torch's grouped GEMM can dispatch, else eager, the per-expert loop), None for a model without experts
    modules of transformers' experts interface. Inside compiled layers transformers keeps the grouped GEMM for
    bf16 weights only (inductor has none for other dtypes) and loops over the experts otherwise."""
    modules = [*hf_model.modules(), *(m.compute for m in hf_model.modules() if isinstance(m, ExpertParallelExperts))]
    if not any(hasattr(module, "_is_expert_parallel") for module in modules):  # set by that interface
        return None
    name = hf_model.config.get_text_config()._experts_implementation
    if name == "grouped_mm" and compiled and compute_dtype != "bfloat16":
        return f"a loop over the experts (compiled {compute_dtype} layers: transformers' grouped GEMM takes bf16 only)"
    return {"grouped_mm": "grouped GEMM (torch._grouped_mm)", "eager": "a loop over the experts (eager)"}.get(
        name, name
    )


class Checkpoint(NamedTuple):
    """A model directory's model, built: meta-built with its checkpoint's `files` to load per shard, or whole
    (`files` None); `composite` where it is the language model of a vision-language checkpoint."""

    hf_model: PreTrainedModel
    files: dict[str, Path] | None
    composite: CompositeCheckpoint | None = None


def _empty_or_full(directory: Path, head: ModelHead = CAUSAL_LM_HEAD) -> Checkpoint:
    """The model of `directory` ending in `head`: meta-built with its checkpoint's files when the checkpoint can be
    read shard by shard, else whole from `from_pretrained`, with a warning that says why. A score head the
    checkpoint lacks (a causal LM's directory) is initialised here, as `from_pretrained` would. A vision-language
    checkpoint: its language model (`chattune.model.io.composite`)."""
    files = load.checkpoint_files(directory)
    config = AutoConfig.from_pretrained(directory)
    if is_composite(config):
        text_config = text_config_of(config)
        if type(text_config) not in head.auto_class._model_mapping:
            raise UnsupportedModel(
                f"model.path {directory}: {config.model_type} is a vision-language model whose language model "
                f"({text_config.model_type}) transformers has no {head.name} class for"
            )
        if files is None:
            raise UserError(
                f"model.path {directory}: a vision-language checkpoint ({config.model_type}) without safetensors "
                "weights; chattune reads its language model from safetensors files only"
            )
        hf_model = load.build_empty(directory, head, config=text_config)
        if head is SCORE_HEAD:  # a composite holds no score head
            initialise_missing_head(hf_model, set(), directory)
        composite = read_composite(directory, config, files, hf_model)
        hf_model.config.use_cache = False
        logger.info("model.path: %s", describe(hf_model, composite))
        if composite.per_shard:
            return Checkpoint(hf_model, files, composite)
        logger.warning(
            "model.path %s: transformers converts some of its language model's tensors while loading (e.g. experts "
            "stored one by one), so every rank loads the whole model with from_pretrained (host memory: the full "
            "model per rank)",
            directory,
        )
        load_whole(composite, hf_model)
        return Checkpoint(hf_model, None, composite)
    if type(config) not in head.auto_class._model_mapping:
        raise UserError(
            f"model.path {directory}: its config.json is a {config.model_type} model, which is neither a "
            f"{head.name} of transformers nor a vision-language model whose language model chattune trains"
        )
    if files is None:
        reason = "it holds no safetensors weights"
    else:
        hf_model = load.build_empty(directory, head)
        started = initialise_missing_head(hf_model, set(files), directory) if head is SCORE_HEAD else set()
        missing = [name for name in load.missing_tensors(hf_model, files) if name not in started]
        if not missing:
            hf_model.config.use_cache = False
            return Checkpoint(hf_model, files)
        reason = (
            f"{len(missing)} of the model's tensors are stored under other names (e.g. {missing[0]}), which "
            "transformers converts while loading"
        )
    logger.warning(
        "model.path %s: %s, so every rank loads the whole model with from_pretrained (host memory: "
        "the full model per rank)",
        directory,
        reason,
    )
    hf_model = load.load_full(directory, head)
    hf_model.config.use_cache = False
    return Checkpoint(hf_model, None)


def check_vocabulary(hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    embeddings = hf_model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only {embeddings} embeddings")
