"""Loading a local Hugging Face model directory into a sharded model without a full copy on any rank.

The model is built on the meta device (shapes only), sharded with FSDP2, then materialised: each rank
allocates only its own shard of every parameter and reads exactly those rows from the safetensors files
(plain reads of the byte range of its rows: FSDP2 shards along the first dimension, which is contiguous
in the row-major safetensors layout). This is how torchtitan and torchtune start large models;
`from_pretrained` on every rank would hold the whole model in host memory per rank (8 ranks of an 8B model:
~256 GB in fp32).

What `from_pretrained` does besides copying tensors is reproduced and tested bit for bit
(tests/distributed/test_sharded_load.py): tied embeddings stay one parameter (the checkpoint's `lm_head.weight`, if
any, is ignored, as transformers does); non-persistent buffers (rotary `inv_freq`) are computed by the
model's own `_init_weights`, which is what `from_pretrained` runs for them; the source dtype is cast to
the fp32 of the shards exactly as `from_pretrained(dtype=float32)` casts it.

A directory this cannot read (no safetensors, or tensor names that transformers renames while loading:
fused MoE experts, legacy prefixes) is loaded by `from_pretrained` on every rank, with a warning.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import struct
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from chattune.errors import UserError
from chattune.model.head.kinds import CAUSAL_LM_HEAD, ModelHead
from chattune.model.io.weights import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from chattune.model.packed.attention import ATTENTION_NAME
from chattune.model.peft.adapters import is_dora_magnitude
from chattune.model.quantization import quantize

logger = logging.getLogger(__name__)


def checkpoint_files(directory: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it (from the index, or the one file), or None when the
    directory has no safetensors weights."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SAFETENSORS_SINGLE
    if single.is_file():
        return {name: single for name in SafetensorsFile(single).header if name != "__metadata__"}
    return None


def source_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype a model directory's config says its weights are stored in (None when it does not say)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def build_empty(
    directory: Path, head: ModelHead = CAUSAL_LM_HEAD, config: PretrainedConfig | None = None
) -> PreTrainedModel:
    """The model of `directory`'s config (or `config`: a vision-language checkpoint's text config), ending in
    `head`, with fp32 parameters on the meta device (no memory) and real buffers, computed as `from_pretrained`
    computes them."""
    if config is None:
        config = AutoConfig.from_pretrained(directory, **head.config_overrides)
    else:
        config = copy.deepcopy(config)
        for key, value in head.config_overrides.items():
            setattr(config, key, value)
    with torch.device("meta"):
        model = head.auto_class.from_config(config, attn_implementation=ATTENTION_NAME, dtype=torch.float32)
    _materialise_buffers(model)
    return model


@torch.no_grad()
def _materialise_buffers(model: PreTrainedModel) -> None:
    """Give every meta buffer CPU memory and the value `from_pretrained` gives it: the model's own
    `_init_weights` of the module that owns it (which, for a rotary embedding, recomputes `inv_freq` from the
    config). Parameters stay on meta (initialising a meta tensor is a no-op)."""
    for module in model.modules():
        owned = [name for name, buffer in module._buffers.items() if buffer is not None and buffer.is_meta]
        if not owned:
            continue
        for name in owned:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        model._init_weights(module)


def missing_tensors(model: PreTrainedModel, files: dict[str, Path]) -> list[str]:
    """The model's parameters and persistent buffers that the checkpoint does not hold under their own name."""
    return [name for name in _loadable_names(model) if name not in files]


def checkpoint_key(name: str, keys: dict[str, str] | None) -> str:
    """Where a model's tensor lies in its checkpoint: its stored name, or, for the language model of a
    vision-language checkpoint, the key `keys` gives it (`chattune.model.io.composite`)."""
    stored = stored_name(name)
    return keys.get(stored, stored) if keys else stored


def saved_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what an HF checkpoint holds, in order: parameters (tied ones once, by their first
    name) and persistent buffers."""
    persistent = [
        (f"{prefix}{'.' if prefix else ''}{name}", buffer)
        for prefix, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]
    return list(model.named_parameters()) + persistent


def _loadable_names(model: nn.Module) -> list[str]:
    return [name for name, _ in saved_tensors(model)]


# The segments peft adds to the names of the modules it wraps: q_proj.base_layer.weight is the checkpoint's
# q_proj.weight; a module in modules_to_save keeps the original and a trained copy of it.
_PEFT_WRAPPERS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")


def stored_name(name: str) -> str:
    """A parameter's name in an HF checkpoint, for a model that peft may have wrapped."""
    return _PEFT_WRAPPERS.sub("", name)


def materialise_and_load(
    model: nn.Module,
    hf_model: PreTrainedModel,
    directory: Path,
    files: dict[str, Path],
    device: torch.device,
    initial: dict[str, torch.Tensor] | None = None,
    keys: dict[str, str] | None = None,
    cpu_offload: bool = False,
) -> None:
    """After `fully_shard` of a meta-built model: allocate each rank's shards on `device` (on the host under
    `cpu_offload`, the model's `Placement`'s) and fill them from
    the checkpoint, reading only this rank's rows; parameters in `initial` (adapters created after the
    build) from those full values instead. Buffers keep the values they were built with, unless the
    checkpoint holds them (persistent buffers). `keys`: checkpoint keys by the model's names (`checkpoint_key`)."""
    initial = initial or {}
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    # FSDP2 allocates only the local shards; the placeholders of a 4-bit base are left alone (allocating them
    # would hold the whole base in fp32) and filled, quantized, one layer at a time below.
    placeholders = {id(p) for p in quantize.replicated_parameters(hf_model)}
    # Under CPU offload (`shard_model(cpu_offload=True)`) the shards live on the host; buffers compute on `device`.
    shards = {id(p) for p in model.parameters()} if cpu_offload else set()
    model._apply(
        lambda t: t if id(t) in placeholders else torch.empty_like(t, device="cpu" if id(t) in shards else device)
    )
    readers = {file: SafetensorsFile(file) for file in set(files.values())}
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        for name, target in saved_tensors(hf_model):
            if id(target) in placeholders or is_dora_magnitude(name):
                continue  # below / computed from the loaded base (adapters.set_dora_magnitudes)
            if name in initial:
                _load_local(InMemory(initial[name]), "", target, directory)
            else:
                stored = checkpoint_key(name, keys)
                _load_local(readers[files[stored]], stored, target, directory)
        for module_name, module in hf_model.named_modules():
            if quantize.has_quantized_weight(module):
                weight, bias = (
                    _read_whole(readers, files, checkpoint_key(f"{module_name}.{kind}", keys), directory, module)
                    for kind in ("weight", "bias")
                )
                quantize.load_quantized(module, weight, bias, device)


def _read_whole(
    readers: dict, files: dict[str, Path], name: str, directory: Path, module: nn.Module
) -> torch.Tensor | None:
    """Tensor `name` whole, for a 4-bit layer (None for the bias of a layer that has none)."""
    target = getattr(module, name.rsplit(".", 1)[1])
    if target is None:
        return None
    stored = readers[files[name]]
    shape = list(quantize.weight_shape(target))
    if list(stored.shape(name)) != shape:
        raise UserError(
            f"model.path {directory}: tensor {name} has shape {stored.shape(name)} in the checkpoint, "
            f"but the model built from its config.json expects {shape}"
        )
    return stored.read_rows(name, 0, shape[0])


class InMemory:
    """A full tensor already in memory, read like a checkpoint file (the `SafetensorsFile` interface)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def shape(self, name: str) -> list[int]:
        return list(self.tensor.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.tensor[start:stop] if self.tensor.dim() else self.tensor.reshape(1)


class SafetensorsFile:
    """Reads byte ranges of a safetensors file with plain reads. Not memory-mapped on purpose: pages of a
    mapping stay in the process's resident memory until it is unmapped (a rank touching half of a 16 GB
    file would hold 8 GB more), while pages read stay in the page cache, which the kernel reclaims."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(length))
        self.data_offset = 8 + length

    def shape(self, name: str) -> list[int]:
        return self.header[name]["shape"]

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the first dimension of tensor `name`, in its stored dtype."""
        entry = self.header[name]
        shape, dtype = entry["shape"], STORED_DTYPES[entry["dtype"]]
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        rows = torch.empty([stop - start, *shape[1:]], dtype=dtype)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_offset + entry["data_offsets"][0] + start * row_bytes)
            view = rows.view(-1).view(torch.uint8).numpy() if rows.numel() else memoryview(b"")
            if f.readinto(view) != len(view):
                raise UserError(f"{self.path}: tensor {name} is cut short (the file is truncated)")
        return rows

    def copy_bytes(self, name: str, out, block: int = 64 * 2**20) -> None:
        """Tensor `name`'s stored bytes, unchanged, written to the open file `out` (in blocks)."""
        first, last = self.header[name]["data_offsets"]
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_offset + first)
            left = last - first
            while left:
                data = f.read(min(block, left))
                if not data:
                    raise UserError(f"{self.path}: tensor {name} is cut short (the file is truncated)")
                out.write(data)
                left -= len(data)


STORED_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _load_local(stored: SafetensorsFile, name: str, target: torch.Tensor, directory: Path) -> None:
    """Copy this rank's part of tensor `name` into `target` (a DTensor: a block of rows, as FSDP2 shards, and of
    columns where tensor parallelism splits them too; or a replicated tensor)."""
    if list(stored.shape(name)) != list(target.shape):
        raise UserError(
            f"model.path {directory}: tensor {name} has shape {stored.shape(name)} in the checkpoint, "
            f"but the model built from its config.json expects {list(target.shape)}"
        )
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        local = target.to_local()
    else:
        shape, offset, local = tuple(target.shape), (0,) * target.dim(), target
    if local.numel() == 0:  # a rank past the end of a short dimension holds nothing
        return
    if target.dim() == 0:
        local.copy_(stored.read_rows(name, 0, 1).reshape(()))
        return
    rows = stored.read_rows(name, offset[0], offset[0] + shape[0])
    # split along a later dimension too (tensor parallelism's row-wise layers): this rank's columns of its rows
    columns = tuple(slice(start, start + size) for start, size in zip(offset[1:], shape[1:]))
    local.copy_(rows[(slice(None), *columns)])


def load_full(directory: Path, head: ModelHead = CAUSAL_LM_HEAD) -> PreTrainedModel:
    """`from_pretrained` in fp32 on the CPU: the whole model on every rank (the fallback)."""
    return head.auto_class.from_pretrained(
        directory, attn_implementation=ATTENTION_NAME, dtype=torch.float32, **head.config_overrides
    )
