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

Host memory: one flat slab, page-locked once (cudaHostRegister) and cut by a bump pointer into each forward's copies,
reused by the next forward (`_HostArena`). torch's pinned allocator rounds every tensor up to a power of two (up to
twice the bytes moved) and caches the blocks; the slab is what the largest forward moved, plus nothing. A forward
that starts while an earlier one's copies are still held by its graph (two forwards, then one backward) gets slabs
of its own; a slab is unregistered once nothing holds it.

On CUDA the copies run on a side stream, overlapped with compute. The forward keeps a tensor alive until its copy's
event has passed (checked every `stash` tensors, and at the backward's start). The backward brings tensors back on
the side stream before autograd asks for them: the first use of a tensor also starts the copies of the ones saved
before it (the backward unpacks in about the reverse of the forward's order), up to `prefetch_bytes` brought back
ahead and not used yet. The compute stream waits on each tensor's own copy event, and `record_stream` keeps the
memory until the compute stream is done with it. On the CPU the activations are on the host already and nothing is
saved: the same hooks copy each tensor into the slab and back (a copy, prefetched the same way), which is what the
CPU tests check (the exact values, the tensors chosen, the order they come back in).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1024  # smaller tensors stay: a copy costs more than it saves
FORWARD_STASH = 4  # device tensors kept alive while their copies run, before the forward waits for the oldest
PREFETCH_BYTES = 256 * 2**20  # brought back ahead of the backward's use: about a layer of a 16k-token row
SLAB_ALIGNMENT = 512  # bytes: where each copy starts in a slab (any dtype's alignment)
MIN_SLAB_BYTES = 64 * 2**20  # the first forward's slabs grow by at least this


def _is_weight(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one (linear layers save `weight.t()`)."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


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


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class _Slab:
    """A flat host buffer, page-locked where `pinned`, unregistered when the last thing holding it lets go."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            if int(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0)):
                raise RuntimeError(
                    "model.fsdp.offload_activations: page-locking the host slab failed (cudaHostRegister)"
                )
            weakref.finalize(self, _unregister, self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def _span(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """The strides of `tensor`'s host copy: its own where its elements fill their span without gaps or overlaps (the
    copy back then has the layout autograd saved: a transposed view stays one), else contiguous ones; and the
    elements the copy needs (its numel either way)."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=tensor.stride):
        if tensor.shape[dim] == 1:
            continue
        if tensor.stride(dim) != expected:
            return tensor.numel(), torch.empty(tensor.shape, device="meta").stride()
        expected *= tensor.shape[dim]
    return tensor.numel(), tensor.stride()


class _HostArena:
    """The host memory of the forwards' copies: slabs handed out by a bump pointer, reused forward after forward.
    After a forward that needed more than its slabs held, the next one gets one slab of the most a forward has
    needed (while a forward's copies are still held, the next forward gets slabs of its own)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.slab_bytes = 0  # the slabs held for reuse (the figure against the estimate's host row)
        self._slabs: list[_Slab] = []
        self._slab, self._offset, self._used, self._most = 0, 0, 0, 0

    def start_forward(self, reusable: bool) -> None:
        """A new forward; `reusable`: no copy of an earlier forward is held any more."""
        self._most = max(self._most, self._used)
        if not reusable:
            self._slabs = []  # (each slab lives on in the copies that hold it)
        elif len(self._slabs) > 1 or (self._most and sum(slab.nbytes for slab in self._slabs) < self._most):
            self._slabs = [_Slab(self._most, self.pinned)]
        self._slab, self._offset, self._used = 0, 0, 0
        self.slab_bytes = sum(slab.nbytes for slab in self._slabs)

    def take(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Slab]:
        """An uninitialised host tensor of `tensor`'s shape, dtype and (dense) strides, and the slab it is cut from."""
        elements, stride = _span(tensor)
        nbytes = elements * tensor.element_size()
        need = -(-nbytes // SLAB_ALIGNMENT) * SLAB_ALIGNMENT
        while self._slab < len(self._slabs) and self._offset + need > self._slabs[self._slab].nbytes:
            self._slab, self._offset = self._slab + 1, 0
        if self._slab == len(self._slabs):
            self._slabs.append(_Slab(max(need, MIN_SLAB_BYTES), self.pinned))
            self._offset = 0
            self.slab_bytes += self._slabs[-1].nbytes
        slab = self._slabs[self._slab]
        raw = slab.buffer[self._offset : self._offset + nbytes]
        self._offset += need
        self._used += need
        return raw.view(tensor.dtype).as_strided(tensor.shape, stride), slab


class _Forward:
    """One forward's offloaded tensors in the order they were saved (the backward brings them back in about the
    reverse order), and how far ahead of the backward's uses their copies back have started."""

    def __init__(self) -> None:
        self.moved: list[weakref.ref[_Moved]] = []  # (weak: autograd holds the tensors, and nothing else should)
        self.cursor = 0  # moved[:cursor] not yet brought back ahead of their use
        self.ahead = 0  # bytes brought back ahead and not used yet


class _Moved:
    """One offloaded tensor: its host copy, and while its uses in the backward last, its copy back on the device."""

    __slots__ = ("host", "slab", "uses", "on_device", "ready", "index", "forward", "ahead", "__weakref__")

    def __init__(self, host: torch.Tensor, slab: _Slab, forward: _Forward) -> None:
        self.host, self.slab, self.uses, self.forward = host, slab, 1, forward
        self.on_device: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None  # its copy back's event (CUDA)
        self.index, self.ahead = len(forward.moved), False
        forward.moved.append(weakref.ref(self))

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class ActivationOffload:
    """The pack and unpack hooks of one training process; `hooks()` is the context a forward runs under."""

    def __init__(
        self,
        device: torch.device,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        stash: int = FORWARD_STASH,
        prefetch_bytes: int = PREFETCH_BYTES,
    ):
        self.device, self.min_bytes, self.stash_size, self.prefetch_bytes = device, min_bytes, stash, prefetch_bytes
        self.offloaded_bytes = 0  # in the current forward (the memory estimate's test reads it)
        self.brought_ahead = 0  # tensors of the last backwards brought back before autograd asked for them
        self._streams = device.type == "cuda"
        if self._streams:
            self._compute = torch.cuda.current_stream(device)
            self._copy = torch.cuda.Stream(device)
        self._arena = _HostArena(pinned=self._streams)
        self._in_flight: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        # this forward's offloaded tensors by `_saved_key`, with a weak reference to their storage: each moves once
        self._moved: dict[tuple, tuple[weakref.ref, _Moved]] = {}
        self._forward = _Forward()
        self._held: weakref.WeakSet[_Moved] = weakref.WeakSet()  # the last forward's copies its graph still holds

    @property
    def host_bytes(self) -> int:
        """The host memory held for the copies: the slabs."""
        return self._arena.slab_bytes

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        self.offloaded_bytes = 0
        self._moved = {}
        self._arena.start_forward(reusable=not self._held)
        self._forward = _Forward()
        self._held = weakref.WeakSet()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._wait_for_copies(keep=0)  # the backward may free what the forward kept alive
            self._moved = {}  # (autograd holds what it saved; the next forward's tensors are new)
            self._forward.cursor = len(self._forward.moved)

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
        host, slab = self._arena.take(tensor)
        if not self._streams:
            host.copy_(tensor)
        else:
            self._copy.wait_stream(self._compute)  # the activation is computed
            with torch.cuda.stream(self._copy):
                host.copy_(tensor, non_blocking=True)
                self._in_flight.append((tensor, self._copy.record_event()))
            self._wait_for_copies(keep=self.stash_size)
        moved = _Moved(host, slab, self._forward)
        self._held.add(moved)
        self._moved[key] = (weakref.ref(tensor.untyped_storage()), moved)
        return True, moved

    def _wait_for_copies(self, keep: int) -> None:
        """Release the device tensors of all but the `keep` latest copies, once those copies are done."""
        while len(self._in_flight) > keep:
            _, event = self._in_flight.pop(0)
            if self._streams:
                self._compute.wait_event(event)

    def _bring_back(self, moved: _Moved) -> None:
        """Start `moved`'s copy back to the device (on the CPU: a copy out of the slab, which the next forward
        overwrites)."""
        if not self._streams:
            moved.on_device = moved.host.clone()
            return
        # No wait for the compute stream: the host copy was written on the copy stream, so the copy back can start
        # while the compute stream still runs the backward's earlier nodes.
        with torch.cuda.stream(self._copy):
            moved.on_device = moved.host.to(self.device, non_blocking=True)
            moved.ready = self._copy.record_event()
        moved.on_device.record_stream(self._compute)  # allocated on the copy stream, used on the compute stream

    def _prefetch(self, forward: _Forward, below: int) -> None:
        """Start the copies back of the tensors saved before index `below`, latest first, until `prefetch_bytes`
        are ahead of the backward's uses."""
        forward.cursor = min(forward.cursor, below)
        while forward.cursor > 0 and forward.ahead < self.prefetch_bytes:
            forward.cursor -= 1
            earlier = forward.moved[forward.cursor]()
            if earlier is not None and earlier.on_device is None and earlier.uses > 0:
                self._bring_back(earlier)
                earlier.ahead = True
                forward.ahead += earlier.nbytes

    def _unpack(self, packed: tuple[bool, torch.Tensor | _Moved]) -> torch.Tensor:
        offloaded, saved = packed
        if not offloaded:
            return saved
        assert isinstance(saved, _Moved)
        if saved.on_device is None:  # not brought back ahead: its first use brings it back, for all of them
            self._bring_back(saved)
        elif saved.ahead:  # brought back ahead: its first use
            saved.ahead = False
            saved.forward.ahead -= saved.nbytes
            self.brought_ahead += 1
        self._prefetch(saved.forward, saved.index)
        on_device = saved.on_device
        assert on_device is not None
        if saved.ready is not None:
            self._compute.wait_event(saved.ready)
        saved.uses -= 1
        if saved.uses == 0:  # the last use lets it go
            saved.on_device, saved.ready = None, None
        return on_device
