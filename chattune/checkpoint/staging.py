"""Host copies of a run state: the buffers a snapshot (`chattune.checkpoint.snapshot`) and an async checkpoint save
(`chattune.checkpoint.checkpoint.BackgroundSaves`) copy a step's shards into.

Why our own and not DCP's stager (`DefaultStager`):
- torch 2.11 and 2.12's `DefaultStager` closes its copier at the end of every stage, so a stager kept for the run
  failed at the second save (`KeyError: <class 'type'>`, the first GPU run), and a fresh one per save allocated and
  page-locked the whole state again each time (gigabytes, seconds of cudaHostRegister). `HostBuffers` are
  allocated once and reused by every save while the shapes stay, on every torch.
- torchao's low-bit optimizers keep AdamW's moments as tensor subclasses (`OptimState8bit`, `OptimState4bit`,
  `OptimStateFp8`: codes and block scales behind one tensor). DCP's stager copies every tensor through
  `new_empty`, which they do not implement (`save_async=true` with `torchao.optim.AdamW8bit` failed at its first
  save, found by scripts/gpu_check's `low_bit` item), and their own `copy_` into a plain host tensor
  dequantizes (4 bytes an element where they hold 1). The buffers hold each subclass's inner tensors (its codes
  and scales, `__tensor_flatten__`) and rebuild the subclass around the copies.
- One flat buffer per dtype, cut into views, page-locked with cudaHostRegister on CUDA: torch's pinned allocator
  rounds each allocation up to a power of two, up to twice the state's size.
The synchronous `dcp.save` needs none of this (it serializes the live state as it is).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def is_tensor_subclass(tensor: torch.Tensor) -> bool:
    """A traceable tensor subclass (one made of plain tensors, as torchao's quantized optimizer states are: codes
    and block scales), not a plain tensor or parameter. A DTensor is asked of its local shard."""
    data = _local(tensor)
    return type(data) not in (torch.Tensor, nn.Parameter) and hasattr(data, "__tensor_flatten__")


@dataclasses.dataclass(frozen=True)
class _Inner:
    """A path step into a tensor subclass: its inner tensor `name` (`__tensor_flatten__`)."""

    name: str


def state_tensors(obj: Any, path: tuple = (), found: dict | None = None) -> dict[tuple, torch.Tensor]:
    """Every plain tensor of a nested state (dicts, lists, tuples) by its path: a DTensor's local shard, a tensor
    subclass's inner tensors (their paths end in `_Inner(name)`)."""
    found = {} if found is None else found
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor) and is_tensor_subclass(obj):
        for name in cast(Any, obj).__tensor_flatten__()[0]:
            state_tensors(getattr(obj, name), (*path, _Inner(name)), found)
    elif isinstance(obj, torch.Tensor):
        found[path] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            state_tensors(value, (*path, key), found)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            state_tensors(value, (*path, i), found)
    return found


class HostBuffers:
    """Host buffers for the tensors of a state dict: one flat buffer per dtype, cut into a view per tensor,
    allocated at the first copy and reused while the tensors keep their shapes (`allocations` counts how often
    they were made). `pinned` (CUDA): the flat buffers page-locked and the copies non-blocking."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self.allocations = 0
        self._views: dict[tuple, torch.Tensor] = {}
        self._flat: list[torch.Tensor] = []
        self._layout: tuple = ()

    def __call__(self, state: dict, stream: torch.cuda.Stream | None = None, dtensors: bool = False) -> dict:
        """The host copy of `state` (non-tensor values deep-copied); on CUDA queued, not waited for. `stream`: the
        side stream the copies run on (each source is recorded on it, so that the allocator does not hand its
        memory out while the copy reads it). `dtensors`: a DTensor's copy is a DTensor of the same placement around
        its host shard (what DCP's planner saves); else the host shard itself (a snapshot's own layout)."""
        tensors = state_tensors(state)
        layout = tuple((path, tuple(t.shape), t.dtype) for path, t in tensors.items())
        if layout != self._layout:
            self._allocate(tensors)
            self._layout = layout
        for path, tensor in tensors.items():
            if stream is not None and tensor.is_cuda:
                tensor.record_stream(stream)
            self._views[path].copy_(tensor.detach(), non_blocking=self.pinned and tensor.is_cuda)
        return self._rebuilt(state, (), dtensors)

    def _allocate(self, tensors: dict[tuple, torch.Tensor]) -> None:
        self.release()
        sizes: dict[torch.dtype, int] = {}
        for tensor in tensors.values():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
        flat = {dtype: torch.empty(numel, dtype=dtype) for dtype, numel in sizes.items()}
        if self.pinned:
            for buffer in flat.values():
                if buffer.numel() and int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 1)):
                    raise RuntimeError("page-locking the host copy of the run state failed (cudaHostRegister)")
        offsets = dict.fromkeys(sizes, 0)
        for path, tensor in tensors.items():
            start = offsets[tensor.dtype]
            self._views[path] = flat[tensor.dtype][start : start + tensor.numel()].view(tensor.shape)
            offsets[tensor.dtype] = start + tensor.numel()
        self._flat = list(flat.values())
        self.allocations += 1

    def release(self) -> None:
        """Unregister and drop the buffers."""
        if self.pinned:
            for buffer in self._flat:
                if buffer.numel():
                    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self._views, self._flat, self._layout = {}, [], ()

    def _rebuilt(self, obj, path: tuple, dtensors: bool):
        if isinstance(obj, torch.Tensor):
            local: Any = obj.to_local() if isinstance(obj, DTensor) else obj  # (a subclass's protocol: untyped)
            if is_tensor_subclass(local):  # its inner tensors' copies, made the subclass again
                names, context = local.__tensor_flatten__()
                inner = {name: self._views[(*path, _Inner(name))] for name in names}
                copied = type(local).__tensor_unflatten__(inner, context, local.size(), local.stride())
            else:
                copied = self._views[path]
            if dtensors and isinstance(obj, DTensor):
                return DTensor(copied, obj._spec, requires_grad=False)
            return copied
        if isinstance(obj, dict):
            return {key: self._rebuilt(value, (*path, key), dtensors) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._rebuilt(value, (*path, i), dtensors) for i, value in enumerate(obj))
        return copy.deepcopy(obj)


class ReusedHostStager:
    """The `AsyncStager` of every async save of a run (`dcp.async_save(..., async_stager=...)`): the state copied
    into one set of `HostBuffers` (page-locked on CUDA), its DTensors kept as DTensors. Synchronous: `stage` waits
    for the copies, so the optimizer may change the state once it returns. The buffers are the next save's too, so
    a save must be written before the next one stages (`BackgroundSaves` waits for it)."""

    _synchronize_after_execute = False  # (the AsyncStager protocol's: `stage` has already waited)

    def __init__(self, pinned: bool) -> None:
        self.buffers = HostBuffers(pinned)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict) -> dict:
        staged = self.buffers(state_dict, dtensors=True)
        if self.buffers.pinned:
            torch.cuda.current_stream().synchronize()  # the non-blocking copies, before the writer reads them
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies before it returns."""

    def close(self) -> None:
        self.buffers.release()
