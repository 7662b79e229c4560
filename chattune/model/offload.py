"""Activation offloading (`model.fsdp.offload_activations`): what autograd saves for the backward, moved to host
memory in the forward and brought back in the backward, so a long row's activations live on the host instead of the
device.

With activation checkpointing, what the forward saves is each decoder layer's input (torch's non-reentrant checkpoint
saves its inputs under the hooks active around it; the layer's own activations are recomputed in the backward under
checkpoint's hooks and never reach these): the device keeps one layer's activations at a time. Without it, every
saved activation moves, which costs more copies for the same saving.

Each tensor moves once per forward however often it is saved (the normed input that q, k and v all save, gate
and up's, the rotary cos/sin every layer saves): a tensor saved again, unchanged (the same view of the same storage,
the same version, while that storage is alive: a freed storage's memory is handed out again), gets the first save's
host copy, and the backward brings it back once for all its uses.

Left on the device: parameters and views of them (an FSDP2 layer's gathered weights, saved by every linear layer: the
all-gather brings them back, a copy would double the traffic), and tensors under `min_bytes` (not worth a copy).

On CUDA the copies run on a side stream into page-locked host memory, overlapped with compute: the forward keeps a
tensor alive until its copy's event has passed (checked every `stash` tensors, and at the backward's start); the
backward copies each tensor back on the side stream when autograd asks for it, the compute stream waiting on it, and
`record_stream` keeps its memory until the compute stream is done with it. On the CPU the activations are on the host
already and nothing is saved: the same hooks copy each tensor into a host buffer of its own and back, which is what
the CPU tests check (the exact values, the tensors chosen).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1024  # smaller tensors stay: a copy costs more than it saves
FORWARD_STASH = 4  # device tensors kept alive while their copies run, before the forward waits for the oldest


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (linear layers save `weight.t()`)."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


class _Moved:
    """One offloaded tensor: its host copy, and while its uses in the backward last, its copy back on the device."""

    __slots__ = ("host", "uses", "on_device")

    def __init__(self, host: torch.Tensor) -> None:
        self.host, self.uses, self.on_device = host, 1, None


def _saved_key(tensor: torch.Tensor) -> tuple:
    """The same values wherever this is equal: the storage, the view of it, the dtype and the version."""
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor._version,
    )


class ActivationOffload:
    """The pack and unpack hooks of one training process; `hooks()` is the context a forward runs under."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES, stash: int = FORWARD_STASH):
        self.device, self.min_bytes, self.stash_size = device, min_bytes, stash
        self.offloaded_bytes = 0  # in the current forward (the memory estimate's test reads it)
        self._streams = device.type == "cuda"
        if self._streams:
            self._compute = torch.cuda.current_stream(device)
            self._copy = torch.cuda.Stream(device)
        self._in_flight: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        # this forward's offloaded tensors by `_saved_key`, with a weak reference to their storage: each moves once
        self._moved: dict[tuple, tuple[weakref.ref, _Moved]] = {}

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self.offloaded_bytes = 0
        self._moved = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._wait_for_copies(keep=0)  # the backward may free what the forward kept alive
            self._moved = {}  # (autograd holds what it saved; the next forward's tensors are new)

    def _pack(self, tensor: torch.Tensor) -> tuple[bool, torch.Tensor | _Moved]:
        size = tensor.numel() * tensor.element_size()
        if tensor.device != self.device or size < self.min_bytes or _is_weight(tensor):
            return False, tensor
        key = _saved_key(tensor)
        storage, moved = self._moved.get(key, (None, None))
        if moved is not None and storage() is not None:  # saved before, unchanged, alive: its copy serves this use
            moved.uses += 1
            return True, moved
        self.offloaded_bytes += size
        if not self._streams:
            host = torch.empty_like(tensor, device="cpu")
            host.copy_(tensor)
        else:
            self._copy.wait_stream(self._compute)  # the activation is computed
            with torch.cuda.stream(self._copy):
                host = torch.empty_like(tensor, device="cpu", pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                self._in_flight.append((tensor, self._copy.record_event()))
            self._wait_for_copies(keep=self.stash_size)
        moved = _Moved(host)
        self._moved[key] = (weakref.ref(tensor.untyped_storage()), moved)
        return True, moved

    def _wait_for_copies(self, keep: int) -> None:
        """Release the device tensors of all but the `keep` latest copies, once those copies are done."""
        while len(self._in_flight) > keep:
            _, event = self._in_flight.pop(0)
            if self._streams:
                self._compute.wait_event(event)

    def _unpack(self, packed: tuple[bool, torch.Tensor | _Moved]) -> torch.Tensor:
        offloaded, saved = packed
        if not offloaded:
            return saved
        assert isinstance(saved, _Moved)
        if not self._streams:
            return saved.host  # the host buffer itself, as `.to("cpu")` of it would return
        on_device = saved.on_device
        if on_device is None:  # its first use in the backward brings it back, for all of them
            # No wait for the compute stream: the host copy was written on the copy stream, so the copy back can
            # start while the compute stream still runs the backward's earlier nodes.
            with torch.cuda.stream(self._copy):
                on_device = saved.host.to(self.device, non_blocking=True)
            self._compute.wait_stream(self._copy)
            on_device.record_stream(self._compute)  # allocated on the copy stream, used on the compute stream
        saved.uses -= 1
        saved.on_device = on_device if saved.uses > 0 else None  # the last use lets it go
        return on_device


def activation_offload(model: nn.Module) -> contextlib.AbstractContextManager:
    """The context a training forward of `model` runs under: its offloading hooks, or nothing."""
    offload = getattr(model, "activation_offload", None)
    return offload.hooks() if offload is not None else contextlib.nullcontext()
