"""The final Hugging Face export: a standard sharded safetensors directory (`model-0000k-of-0000n.safetensors`
and `model.safetensors.index.json`), config and tokenizer, loadable without chattune.

Tensors are gathered one at a time, each rank's rows streamed into the file as they arrive, so rank 0
holds one rank's part of one tensor at a time, never the model (gathering the whole state dict first, as
`save_pretrained` needs, costs rank 0 the full model in fp32: 280 GB for 70B). A safetensors header lists
every tensor's dtype, shape and byte range, all known before any tensor is gathered, so each file's header
is written first and its tensors appended. The weights are written in the source model's dtype by default
(a bf16 checkpoint comes back bf16, not twice its size in fp32). The directory is written as `hf.partial`
and renamed, so a crash never leaves a half-written `hf/`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PreTrainedTokenizerBase

from chattune.distributed import on_mesh_device, whole_tensor
from chattune.files import set_aside
from chattune.hub import hub_id
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.io.composite import adapter_targets, copy_source_files
from chattune.model.io.load import STORED_DTYPES, SafetensorsFile, checkpoint_files, saved_tensors, stored_name
from chattune.model.io.weights import SAFETENSORS_INDEX
from chattune.model.peft.adapters import ADAPTER, LORA_PARAMETER
from chattune.model.quantization.quantize import dequantized, is_quantized, weight_shape
from chattune.parallel.fsdp import reshard

if TYPE_CHECKING:  # peft is imported where an adapter is exported: it costs seconds per process
    from peft.tuners.lora import LoraLayer

logger = logging.getLogger(__name__)
MAX_SHARD_BYTES = 5 * 2**30  # transformers' long-standing default shard size
SAFETENSORS_DTYPES = {dtype: name for name, dtype in STORED_DTYPES.items()}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the source checkpoint written back byte for byte (a vision-language model's vision tower)."""

    file: SafetensorsFile
    key: str


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # its name in the HF model (and the file)
    source: torch.Tensor | StoredTensor  # the parameter (a DTensor shard) or buffer to gather, or a source's bytes
    dtype: torch.dtype  # as written
    shape: tuple[int, ...]
    merge: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # (rows in fp32, first row) -> merged rows

    @property
    def num_bytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def export_dtype(setting: str, source: torch.dtype | None) -> torch.dtype:
    """export.dtype resolved: `auto` is the source checkpoint's dtype (fp32 for random-init models)."""
    if setting == "auto":
        return source or torch.float32
    return getattr(torch, setting)


def plan_tensors(model: PackedCausalLM, dtype: torch.dtype) -> list[PlannedTensor]:
    """What `save_pretrained` would save, in order: parameters (a tied output layer once, under the
    embedding's name) and persistent buffers; floating-point tensors in `dtype`. With LoRA adapters, the
    base model with each adapter merged into its layer, under the base's own names (a 4-bit base
    dequantized). Collective when there are adapters (their small A, B and DoRA magnitudes are gathered whole)."""
    hf_model = model.hf_model
    planned = []
    wrapped = _wrapped_parameters(hf_model)
    for name, tensor in saved_tensors(hf_model):
        if LORA_PARAMETER.search(name) or ".original_module." in name:
            continue  # adapters are merged below; a module in modules_to_save is written as trained
        owner, _, leaf = name.rpartition(".")
        wrapper = wrapped.get((id(hf_model.get_submodule(owner)), leaf)) if wrapped else None
        if wrapper is not None:  # an adapted parameter: an MoE expert stack, a router's weight
            merge = _parameter_merge(wrapper, tensor.ndim)
        elif name.endswith(".base_layer.weight"):
            merge = _lora_merge(hf_model.get_submodule(name.removesuffix(".base_layer.weight")))
        else:
            merge = None
        floating = tensor.is_floating_point() or is_quantized(tensor)
        planned.append(
            PlannedTensor(
                stored_name(name), tensor, dtype if floating else tensor.dtype, tuple(weight_shape(tensor)), merge
            )
        )
    composite = model.composite
    if composite is None:
        return planned
    # The checkpoint's own layout: the language model under its keys there, every other tensor as stored.
    planned = [dataclasses.replace(t, name=composite.stored_names[t.name]) for t in planned]
    files = checkpoint_files(composite.directory)
    readers = {path: SafetensorsFile(path) for path in set(files.values())}
    for key in composite.other_keys:
        reader = readers[files[key]]
        entry = reader.header[key]
        planned.append(
            PlannedTensor(key, StoredTensor(reader, key), STORED_DTYPES[entry["dtype"]], tuple(entry["shape"]))
        )
    return planned


def _whole_fp32(weight: torch.Tensor) -> torch.Tensor:
    """An adapter's small tensor whole (gathered where sharded), in fp32, for a merge."""
    weight = weight.detach()
    return whole_tensor(weight).float()


def _lora_merge(layer: LoraLayer) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """Rows [a, b) of a LoRA layer's merged weight from the base's rows: W + scaling * B @ A, and with DoRA
    each row of that rescaled to its trained magnitude, m / ||W + scaling * B @ A|| (peft's merge; the norm
    of a row needs only that row). None when the layer has no adapter."""
    if ADAPTER not in layer.lora_A:
        return None
    full = _whole_fp32
    a, b, scaling = full(layer.lora_A[ADAPTER].weight), full(layer.lora_B[ADAPTER].weight), layer.scaling[ADAPTER]
    magnitude = full(layer.lora_magnitude_vector[ADAPTER].weight) if ADAPTER in layer.lora_magnitude_vector else None

    def merged(rows: torch.Tensor, first: int) -> torch.Tensor:
        last = first + rows.shape[0]
        rows = rows + scaling * (b[first:last] @ a).to(rows.device)
        if magnitude is not None:
            rows = rows * (magnitude[first:last].to(rows.device) / torch.linalg.norm(rows, dim=1)).unsqueeze(1)
        return rows

    return merged


def _wrapped_parameters(hf_model) -> dict[tuple[int, str], LoraLayer]:
    """peft's adapters on parameters (`lora.ParamWrapper`: an MoE model's stacked experts, a router's weight),
    by (id of the module holding the parameter, its name)."""
    if not any(".lora_" in name for name, _ in hf_model.named_parameters()):
        return {}
    from peft.tuners.lora import ParamWrapper

    return {
        (id(module.get_base_layer()), module.parameter_name): module
        for module in hf_model.modules()
        if isinstance(module, ParamWrapper)
    }


def _parameter_merge(wrapper: LoraLayer, ndim: int) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """Rows [a, b) (experts, for a 3-D stack) of an adapted parameter with its adapter merged, as peft's
    `ParamWrapper.get_delta_weight` computes it: expert e's delta is scaling * B_e @ A_e, with A's rows and
    B's columns holding the experts' rank-r factors (A: experts x rank rows; B: rank x experts columns)."""
    if ADAPTER not in wrapper.lora_A:
        return None
    full = _whole_fp32
    a, b, scaling = full(wrapper.lora_A[ADAPTER].weight), full(wrapper.lora_B[ADAPTER].weight), wrapper.scaling[ADAPTER]
    if ndim == 2:
        delta = scaling * (b @ a)  # (out, in), as the parameter
    else:
        experts = wrapper.num_experts
        a, b = a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)  # e r i, o r e
        layout = "e o i" if wrapper._did_swap_in_out_features else "e i o"  # the stack's own (experts, ., .)
        delta = scaling * torch.einsum(f"o r e, e r i -> {layout}", b, a)

    def merged(rows: torch.Tensor, first: int) -> torch.Tensor:
        return rows + delta[first : first + rows.shape[0]].to(rows.device)

    return merged


def split_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor is a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.num_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.num_bytes
    return shards


def safetensors_header(tensors: list[PlannedTensor]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `tensors` in this order; padded
    with spaces so the data starts 8-byte aligned, as the safetensors library writes it."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for tensor in tensors:
        entries[tensor.name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.num_bytes],
        }
        offset += tensor.num_bytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def _write_gathered(f, tensor: PlannedTensor, is_main: bool) -> None:
    """Collective: rank 0 writes the full tensor's bytes, in the export dtype, to `f`. FSDP2 shards along the
    first dimension, in rank order, which is also the order of the rows in the file: rank 0 writes its own
    rows, then receives each other rank's rows and writes them. No rank ever holds the full tensor (a
    gather would: gloo also copies the gathered tensor once more into a flat buffer)."""
    if isinstance(tensor.source, StoredTensor):  # the source's bytes: rank 0 reads them, no collective
        if is_main:
            tensor.source.file.copy_bytes(tensor.source.key, f)
        return
    # A 4-bit weight: its full-precision matrix (replicated); a shard CPU offload keeps on the host: on the device.
    source = on_mesh_device(dequantized(tensor.source).detach())

    def write(part: torch.Tensor, first_row: int = 0) -> None:
        if tensor.merge is not None:  # a merged adapter
            part = tensor.merge(part.float(), first_row)
        f.write(part.to(device="cpu", dtype=tensor.dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)

    if not isinstance(source, DTensor):  # a buffer: every rank has all of it
        if is_main:
            write(source)
        return
    placements, mesh = tuple(source.placements), source.device_mesh
    if placements == (Shard(0),):
        shard_ranks, shard_dim = mesh.mesh.flatten().tolist(), 0
    elif placements == (Replicate(), Shard(0)):  # HSDP: this rank's replica group's shards
        shard_ranks, shard_dim = mesh.mesh[mesh.get_local_rank(0)].tolist(), 1
    else:  # split over tp as well: gathered whole on every rank
        full = source.full_tensor()
        if is_main:
            write(full)
        return
    if 0 not in shard_ranks:  # a copy of the shards rank 0's group holds (another replica group, another tp rank)
        return
    group, world = mesh.get_group(shard_dim), len(shard_ranks)
    rows = source.shape[0]
    chunk = -(-rows // world)  # FSDP2 shards like torch.chunk: ceil(rows / W) rows per rank, fewer at the end
    local = source.to_local()
    if not is_main:
        if local.shape[0] > 0:
            send_and_wait(local.contiguous(), group)
        return
    write(local)
    for rank in range(1, world):
        rank_rows = min(chunk, max(0, rows - rank * chunk))
        if rank_rows:
            received = local.new_empty((rank_rows, *source.shape[1:]))
            dist.recv(received, group=group, group_src=rank)
            write(received, rank * chunk)
            del received


def send_and_wait(rows: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Send `rows` to rank 0 and return once they have left: one send in flight per rank. An NCCL send returns
    as soon as it is enqueued, so a rank would otherwise enqueue every tensor of the model at once while
    rank 0 receives and writes them one at a time, and the NCCL watchdog, which times a collective from its
    enqueue, would count rank 0's whole write against the last of them. (gloo's send already blocks.)"""
    dist.send(rows, group=group, group_dst=0)
    if rows.is_cuda:
        torch.cuda.current_stream(rows.device).synchronize()  # `send` made this stream wait for the transfer


def export_run(cfg, built, tokenizer: PreTrainedTokenizerBase, directory: Path, is_main: bool) -> dict[str, Path]:
    """Collective: what the end of a run writes into `directory` (its output_dir), as `cfg.export` says: with
    LoRA the adapter directory `adapter/`, and without LoRA or with export.merge the Hugging Face directory
    `hf/` in export.dtype (auto: the source's). `built`: the run's `BuiltModel`. Returns what was written,
    by name ("adapter", "hf"). The end of a run and `chattune export CHECKPOINT` both write through this."""
    written: dict[str, Path] = {}
    if built.peft_model is not None:
        written["adapter"] = directory / "adapter"
        export_adapter(built.model, built.peft_model, tokenizer, written["adapter"], is_main, cfg.model.path)
    if built.peft_model is None or cfg.export.merge:
        written["hf"] = directory / "hf"
        dtype = export_dtype(cfg.export.dtype, built.model.source_dtype)
        export_hf(built.model, tokenizer, written["hf"], is_main, dtype)  # adapters merged, if any
    return written


def export_hf(
    model: PackedCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    is_main: bool,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Collective: write a sharded Hugging Face directory (weights in `dtype`, config, tokenizer with its
    chat template) that loads without chattune. Every rank takes part in each tensor's gather; rank 0
    writes."""
    reshard(model)  # after an evaluation the root's parameters are its gathered bf16 copies, not the fp32 masters
    staging = _staging(directory) if is_main else None
    shards = split_shards(plan_tensors(model, dtype), max_shard_bytes)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        with open(staging / file_name, "wb") if is_main else contextlib.nullcontext() as f:
            if is_main:
                f.write(safetensors_header(shard))
            for tensor in shard:  # every rank takes part, one tensor at a time
                _write_gathered(f, tensor, is_main)
                if is_main:
                    weight_map[tensor.name] = file_name
                    total += tensor.num_bytes
            if is_main:
                f.flush()
                os.fsync(f.fileno())
    if not is_main:
        return
    (staging / SAFETENSORS_INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    if model.composite is not None:  # its config, processor and template files, as the source has them
        copy_source_files(model.composite, staging)
    else:
        _save_config(model, staging, dtype)
    tokenizer.save_pretrained(staging)
    _publish(staging, directory)


def _staging(directory: Path) -> Path:
    """Rank 0: an empty `directory.partial` to write into (one left by an export that crashed is removed)."""
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, directory: Path) -> None:
    """Rank 0: the complete `staging` becomes `directory`; an earlier export there is set aside as
    `*.abandoned` (a resumed run's export replaces an earlier launch's: never in place)."""
    if directory.exists():
        logger.warning(
            "moved aside: %s -> %s (an earlier export, replaced by this run's)", directory, set_aside(directory)
        )
    os.rename(staging, directory)


def _save_config(model: PackedCausalLM, directory: Path, dtype: torch.dtype) -> None:
    hf_model = model.hf_model
    config = copy.deepcopy(hf_model.config)
    config.use_cache = True  # training needs it off; generation wants it on
    config._attn_implementation = "sdpa"  # readers do not have chattune's packed attention registered
    config.dtype = dtype  # what the weights are stored in: from_pretrained(dtype="auto") gives it back
    config.save_pretrained(directory)
    if hf_model.can_generate() and hf_model.generation_config is not None:
        hf_model.generation_config.save_pretrained(directory)


def export_adapter(
    model: PackedCausalLM,
    peft_model,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    is_main: bool,
    base_path: str | None,
) -> None:
    """Collective: a peft adapter directory (adapter_config.json, adapter_model.safetensors, the tokenizer)
    that `peft.PeftModel.from_pretrained(base, directory)` loads. The trained tensors are small: gathered
    whole."""
    reshard(model)  # read the fp32 masters, not a root left gathered in bf16 by an evaluation
    trained, gathered = {}, {}
    # Every name of a trained tensor: a tied embedding trained in full (modules_to_save) is one parameter
    # under two names, and peft's file holds it under both (gathered once).
    for name, parameter in model.hf_model.named_parameters(remove_duplicate=False):
        if parameter.requires_grad:
            if id(parameter) not in gathered:
                gathered[id(parameter)] = whole_tensor(parameter.detach()).cpu()
            trained[f"base_model.model.{name}"] = gathered[id(parameter)]
    if not is_main:
        return
    staging = _staging(directory)
    from peft import get_peft_model_state_dict

    weights = get_peft_model_state_dict(peft_model, state_dict=trained)
    config = copy.deepcopy(peft_model.peft_config[ADAPTER])
    composite = model.composite
    if composite is not None:  # over the vision-language checkpoint: the composite's names for the same modules
        prefix = "base_model.model."
        weights = {prefix + composite.composite_name(key.removeprefix(prefix)): value for key, value in weights.items()}
        adapted = [name for name, module in model.hf_model.named_modules() if ADAPTER in getattr(module, "lora_A", {})]
        config.target_modules = adapter_targets(composite, adapted)
    # safetensors refuses tensors that share memory: the tied one is written twice, as peft writes it.
    save_file(
        {k: v.clone().contiguous() for k, v in weights.items()},
        staging / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    repo = hub_id(base_path) if base_path else None
    if repo is not None:  # what peft loads the base from: the hub repository and revision, not chattune's hf: path
        config.base_model_name_or_path, _, revision = repo.partition("@")
        config.revision = revision or None
    else:
        config.base_model_name_or_path = base_path
    if isinstance(config.target_modules, set):  # in hash order, which differs from process to process
        config.target_modules = sorted(config.target_modules)
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    _publish(staging, directory)
