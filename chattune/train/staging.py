"""Staging for `dcp.async_save` of a state that holds tensor subclasses.

torchao's low-bit optimizers keep AdamW's moments as tensor subclasses (`OptimState8bit`, `OptimState4bit`,
`OptimStateFp8`: codes and block scales behind one tensor). DCP's stager (`DefaultStager`, and the one
`async_save` makes when given none) copies every tensor through `new_empty`, which those subclasses do not
implement: `save_async=true` with `optimizer._target_=torchao.optim.AdamW8bit` failed at its first save
(`NotImplementedError: OptimState8bit dispatch: ... aten.new_empty`), found by scripts/gpu_check.py's
`low_bit` item. `SubclassSafeStager` takes those leaves out of the state, lets the inner stager copy the rest
(pinned buffers on CUDA), and puts back a host copy of each made with `_to_copy`, which they implement; the
synchronous `dcp.save` needs none of this (it serializes them as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Path = tuple[Any, ...]  # keys and indices from the state's root to a leaf


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def is_tensor_subclass(tensor: torch.Tensor) -> bool:
    """A traceable tensor subclass (one made of plain tensors, as torchao's quantized optimizer states are: codes
    and block scales), not a plain tensor or parameter. A DTensor is asked of its local shard."""
    data = _local(tensor)
    return type(data) not in (torch.Tensor, nn.Parameter) and hasattr(data, "__tensor_flatten__")


def tensor_leaves(
    state: Any, keep: Callable[[torch.Tensor], bool] = lambda _: True, path: Path = ()
) -> list[tuple[Path, torch.Tensor]]:
    """(path, tensor) of every tensor in `state` (dicts, lists and tuples) for which `keep` holds."""
    if isinstance(state, torch.Tensor):
        return [(path, state)] if keep(state) else []
    if isinstance(state, dict):
        return [leaf for key, value in state.items() for leaf in tensor_leaves(value, keep, (*path, key))]
    if isinstance(state, (list, tuple)):
        return [leaf for index, value in enumerate(state) for leaf in tensor_leaves(value, keep, (*path, index))]
    return []


def subclass_leaves(state: Any) -> list[tuple[Path, torch.Tensor]]:
    """(path, tensor) of every tensor subclass in `state` (a DTensor whose local shard is one included)."""
    return tensor_leaves(state, is_tensor_subclass)


def host_copy(value: torch.Tensor) -> torch.Tensor:
    """A copy of `value` in host memory, a DTensor's placement and shape kept (its local shard copied). A tensor
    subclass is copied tensor by tensor through its `__tensor_flatten__`: torchao's `_to_copy` moves the inner
    tensors with `.to(device)`, which returns them uncopied when they are on the host already, and the optimizer
    would then change the staged copy while it is written."""
    if isinstance(value, DTensor):
        return DTensor(host_copy(value._local_tensor), value._spec, requires_grad=False)
    if not is_tensor_subclass(value):
        return value.detach().to("cpu", copy=True)
    subclass: Any = value  # (a traceable tensor subclass: torch's protocol, not in Tensor's stubs)
    names, context = subclass.__tensor_flatten__()
    inner = {name: host_copy(getattr(value, name)) for name in names}
    return type(subclass).__tensor_unflatten__(inner, context, value.size(), value.stride())


def _with(state: Any, leaves: dict[Path, Any]) -> Any:
    """`state` rebuilt along the paths of `leaves` with those leaves replaced (the rest shared)."""
    on_the_way = {path[:depth] for path in leaves for depth in range(len(path))}

    def rebuilt(value: Any, path: Path) -> Any:
        if path in leaves:
            return leaves[path]
        if path not in on_the_way:
            return value
        if isinstance(value, dict):
            return {key: rebuilt(item, (*path, key)) for key, item in value.items()}
        items = [rebuilt(item, (*path, index)) for index, item in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items

    return rebuilt(state, ())


def _set(state: Any, path: Path, value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


class SubclassSafeStager:
    """An `AsyncStager` around `inner` (a DCP stager, or None: every tensor copied by `host_copy`) for states
    with tensor-subclass leaves: those are copied by `host_copy`, the rest by `inner`. Synchronous: the state
    is safe to change once `stage` returns."""

    def __init__(self, inner: Any | None) -> None:
        self.inner = inner

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict) -> dict:
        leaves = subclass_leaves(state_dict)
        if self.inner is None:
            return _with(state_dict, {path: host_copy(value) for path, value in tensor_leaves(state_dict)})
        staged = self.inner.stage(_with(state_dict, dict.fromkeys((path for path, _ in leaves), None)))
        if isinstance(staged, Future):
            staged = staged.result()
        for path, value in leaves:
            _set(staged, path, host_copy(value))
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copies before it returns."""

    def close(self) -> None:
        """The inner stager stays its maker's to close."""
