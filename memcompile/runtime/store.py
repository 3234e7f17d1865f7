"""Tiered storage for swapped tensors: host memory and disk, outside the device allocator.

    store = TieredStore(disk_path=None)          # a temporary folder for the disk tier
    h = store.put(x, "host")                     # a tensor in host memory (copy of x)
    h = store.put(x, "disk")                     # a tensor backed by a file; its pages are dropped
    y = store.get(h, device)                     # a new device tensor with x's values
    store.wait(y)                                # (CUDA) the compute stream waits for y's copy

The tensors ``put`` returns own their memory: it is released when the last reference goes (for
a saved activation, when the backward has read it), so nothing needs an explicit free and
nothing leaks if a backward never runs.

    device   tier "host"                              tier "disk"
    CPU      numpy buffer (not torch's allocator,     file in disk_path, memory-mapped; written,
             so the CPU profiler sees the saving)     flushed and its pages dropped (a real RAM
                                                      saving); read back on get
    CUDA     pinned CPU tensor, copied on a side       same as CPU (synchronous)
             stream (below)

On CUDA the host tier's copies run on one side stream per device, so they overlap compute:

    put   side stream waits for the compute stream (x is ready), copies x into a pinned buffer;
          ``x.record_stream(side)`` keeps the allocator from reusing x's block before the copy
          is done (x's bytes leave ``memory_allocated`` when x is freed, as on CPU)
    get   allocates y on the compute stream, the side stream waits for the compute stream (y's
          block may have just been freed by compute work), copies, records an event for y
    wait  the compute stream waits for y's event; every reader of y comes after it

The side stream is FIFO, so a reload always follows its tensor's offload. On CPU ``put`` is
synchronous (its source is freed where the graph says, so the copy must be done by then); with
the CPU's copy thread on (``copy_engine.py``: the stand-in for a GPU's copy engine, off by
default: measured slower on this project's CPU) a ``get`` of a swapped tensor runs there and
``wait`` blocks until it is done, so a reload issued early (``rewrites/early_reloads.py``)
overlaps compute; a host-placed parameter's fetch (no ``wait`` in its graph) copies at once.
``TieredStore(asynchronous=False)`` makes every copy synchronous (for benchmarks that measure
what the overlap buys).

Failures (disk full, I/O errors) raise :class:`OffloadError` naming the tier and path; they
happen in the forward, before any parameter is updated.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import tempfile
import threading
import weakref
from typing import Literal

import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memcompile.errors import OffloadError, format_bytes
from memcompile.runtime import copy_engine, placement
from memcompile.runtime.cache import PrefetchCache
from memcompile.runtime.copy_engine import CopyJob
from memcompile.runtime.pinned import (
    is_pinned_host,
    is_pinned_param,
    pinned_copy,
    place_pinned,
    side_stream,
)

log = logging.getLogger(__name__)

__all__ = [
    "OffloadError",
    "Tier",
    "TieredStore",
    "can_host_place",
    "get_store",
    "host_empty",
    "host_storage_bytes",
    "host_tier_copy",
    "is_disk_placed",
    "is_host_placed",
    "is_off_device",
    "is_tier_address",
    "place_on_host",
    "register_store",
    "release_pages",
]

Tier = Literal["host", "disk"]


# CPU host-tier storages by address -> bytes. On CPU the host tier and the device are the same
# RAM, told apart only by who allocated it; measurements (runtime/measure.py) skip these, as
# max_memory_allocated skips pinned host memory on CUDA. An entry goes when its buffer is freed.
_host_storages: dict[int, int] = {}
_host_lock = threading.Lock()


# The addresses among those of swapped tensors (``TieredStore.put``'s host-tier results): their
# reloads have a ``memcompile::wait`` before the first reader, so on the CPU the copy thread may
# make them (copy_engine.py). A host-placed parameter's fetch has none: it copies at once.
_swapped: set[int] = set()


def _unregister(address: int) -> None:
    with _host_lock:
        _host_storages.pop(address, None)
        _swapped.discard(address)


def _host_buffer(nbytes: int, *, swapped: bool = False) -> np.ndarray:
    buffer = np.empty(nbytes, dtype=np.uint8)
    if nbytes:
        address = buffer.ctypes.data
        with _host_lock:
            _host_storages[address] = nbytes
            if swapped:
                _swapped.add(address)
        weakref.finalize(buffer, _unregister, address)
    return buffer


def _is_swapped(h: torch.Tensor) -> bool:
    # A swapped tensor (host or disk tier), read back with a ``wait`` before its first reader.
    address = h.untyped_storage().data_ptr()
    return address in _swapped or address in _disk_maps


def _as_torch(buffer: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    # A byte buffer viewed as a tensor with ``like``'s shape, strides and dtype.
    return torch.from_numpy(buffer).view(like.dtype).as_strided(like.shape, like.stride(), 0)


def is_host_placed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is host-tier memory (a host-placed parameter or gradient, a
    swapped tensor on CPU), not device memory. A host-placed CUDA parameter counts also while
    Dynamo traces with its placeholder (``pinned.py``)."""
    if is_pinned_param(t):
        return True
    if t.device.type != "cpu" or isinstance(t, torch._subclasses.FakeTensor):
        return False
    return t.untyped_storage().data_ptr() in _host_storages or is_pinned_host(t)


#: Storage address of each live disk-tier tensor -> its file mapping (weakly: the tensor's
#: buffer owns it).
_disk_maps: dict[int, weakref.ref[mmap.mmap]] = {}


def _forget_disk(address: int) -> None:
    with _host_lock:
        _disk_maps.pop(address, None)


def is_disk_placed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is a disk-tier file mapping (``TieredStore.put(x, "disk")``)."""
    if (
        t.device.type != "cpu"
        or isinstance(t, torch._subclasses.FakeTensor)
        or is_traceable_wrapper_subclass(t)  # a DTensor: its shard's storage is its owner's
    ):
        return False
    return t.untyped_storage().data_ptr() in _disk_maps


def is_tier_address(address: int) -> bool:
    """Whether a CPU storage at ``address`` is the host tier's or the disk tier's (no pinned
    buffers: a CUDA model's host memory is not its device's anyway). The check per tensor
    without the tensor: loops over every gradient at every step use it."""
    return address in _host_storages or address in _disk_maps


def is_off_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is a tier's, host or disk, not the device's."""
    return is_host_placed(t) or is_disk_placed(t)


def release_pages(t: torch.Tensor) -> int:
    """Write a disk-tier tensor's changed pages to its file and drop its pages from memory (an
    optimizer updated it in place). Returns the bytes released (0: not a disk-tier tensor).

    Raises:
        OffloadError: writing the pages failed (their values stay readable in memory).
    """
    with _host_lock:
        ref = _disk_maps.get(t.untyped_storage().data_ptr())
    mapped = ref() if ref is not None else None
    if mapped is None:
        return 0
    try:
        mapped.flush()
    except OSError as e:
        raise OffloadError(f"disk tier: writing a tensor's pages back failed: {e}") from e
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)
    return t.untyped_storage().nbytes()


def host_storage_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage if it is in the CPU host tier, else 0."""
    return t.untyped_storage().nbytes() if is_host_placed(t) else 0


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor in the host tier (outside torch's allocator, so
    the CPU profiler does not count it as device memory); freed with its last reference."""
    numel = math.prod(shape)
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(_host_buffer(numel * dtype.itemsize)).view(dtype).view(shape)


def _host_copy(x: torch.Tensor, *, swapped: bool = False) -> torch.Tensor:
    # A copy of a CPU tensor that covers its storage, in a (registered) host-tier buffer.
    out = _as_torch(_host_buffer(x.untyped_storage().nbytes(), swapped=swapped), x)
    out.copy_(x)
    return out


#: Device types whose parameters :func:`place_on_host` can move to the host tier.
HOSTABLE_DEVICES = ("cpu", "cuda")


def host_tier_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor ``x`` (covering its storage) in the host tier: the same values,
    shape and strides, in memory outside torch's allocator (optimizer state, ``offload_optimizer``).

    Raises:
        ValueError: ``x`` is not a CPU tensor covering its storage.
    """
    if x.device.type != "cpu" or not can_host_place(x):
        raise ValueError(f"the host tier takes a CPU tensor covering its storage; got {x.device}")
    return _host_copy(x)


def can_host_place(p: torch.Tensor) -> bool:
    """Whether :func:`place_on_host` takes ``p``: a CPU or CUDA tensor covering its whole
    storage (a view of a larger buffer would keep the device copy alive through its other
    users). Not a wrapper subclass (a ``DTensor``: its storage is its shard's, which its owner,
    e.g. FSDP2, manages)."""
    return (
        p.device.type in HOSTABLE_DEVICES
        and not isinstance(p, torch._subclasses.FakeTensor)
        and not is_traceable_wrapper_subclass(p)
        and p.storage_offset() == 0
        and p.numel() * p.element_size() == p.untyped_storage().nbytes()
    )


def place_on_host(p: torch.Tensor) -> int:
    """Move a parameter's storage (and its gradient's, if any) into the host tier, in place:
    ``p`` keeps its identity, values, shape and strides, so optimizers and autograd see the same
    object. Returns the device bytes freed (0 if it was already there).

    On CPU the host tier is memory outside torch's allocator and ``p`` stays a CPU tensor. A
    CUDA parameter becomes a pinned CPU tensor (``pinned.py``): its gradient and the optimizer
    step then live on the host, as in ZeRO-Offload.

    Raises:
        ValueError: ``p`` is neither on the CPU nor on a CUDA device, or does not cover its
            storage exactly (a view of a larger buffer, whose other users would keep the device
            copy alive).
    """
    if is_host_placed(p):
        return 0
    if p.device.type not in HOSTABLE_DEVICES:
        raise ValueError(f"host-placed parameters need a CPU or CUDA tensor; got {p.device}")
    if not can_host_place(p):
        raise ValueError("a parameter that is a view of a larger buffer cannot be host-placed")
    if p.device.type == "cuda":
        grad, p.grad = p.grad, None  # a CPU parameter cannot hold a CUDA gradient
        freed = place_pinned(p)  # counts as a move (placement.moved)
        if grad is not None:
            p.grad = pinned_copy(grad) if can_host_place(grad) else grad.cpu()
        return freed
    freed = p.untyped_storage().nbytes()
    with torch.no_grad():
        p.data = _host_copy(p)
    placement.moved()
    _grad_to_host(p)
    if p.requires_grad:
        # The graphs send gradients to the host, but autograd may still make a device one:
        # accumulating into an existing gradient out of place (a parameter used by several
        # fragments), or an eager frame. Move it once accumulated.
        p.register_post_accumulate_grad_hook(_grad_to_host)
    return freed


def _grad_to_host(p: torch.Tensor) -> None:
    g = p.grad
    if g is None or is_host_placed(g) or not can_host_place(g):
        return
    with torch.no_grad():
        p.grad = _host_copy(g)


def _storage_bytes(x: torch.Tensor) -> np.ndarray:
    # The bytes of x's storage, without a copy (a CPU tensor; x covers its storage exactly).
    raw = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage())
    return raw.numpy()


class TieredStore:
    """Host and disk tiers of one compiled model.

    Args:
        disk_path: folder for the disk tier's files (created if missing); ``None``: a temporary
            folder, removed at exit.
        asynchronous: CUDA host-tier copies run on a side stream (else on the current stream,
            blocking the host until done); CPU reloads of swapped tensors on the copy thread.
    """

    def __init__(self, disk_path: str | None = None, *, asynchronous: bool = True) -> None:
        self._disk_path = disk_path
        self.asynchronous = asynchronous
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._lock = threading.Lock()
        self._counter = 0
        self.bytes_out = {"host": 0, "disk": 0}
        self.bytes_in = {"host": 0, "disk": 0}
        self._side: dict[int, torch.cuda.Stream] = {}  # device index -> copy stream
        # Copies in flight on a side stream (CUDA) or the copy thread (CPU), by the
        # destination's data pointer, until ``wait``.
        self._pending: dict[int, torch.cuda.Event | CopyJob] = {}
        #: Prefetched device copies of host-placed parameters (the pilot's, cache.py): ``get``
        #: serves a hit from it. ``None``: every ``get`` copies on demand.
        self.prefetched: PrefetchCache | None = None

    # -- the disk folder ------------------------------------------------------------------------
    def _folder(self) -> str:
        if self._disk_path is not None:
            try:
                os.makedirs(self._disk_path, exist_ok=True)
            except OSError as e:
                raise OffloadError(f"disk tier: cannot create {self._disk_path!r}: {e}") from e
            return self._disk_path
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="memcompile-disk-")
        return self._tmp.name

    # -- put / get / wait -------------------------------------------------------------------------
    def put(self, x: torch.Tensor, tier: Tier) -> torch.Tensor:
        """A copy of ``x`` in ``tier`` (same shape, strides, dtype; CPU device).

        On CUDA the host copy is asynchronous (side stream, pinned buffer); only :meth:`get`,
        which is ordered after it on the same stream, may read the result."""
        nbytes = x.untyped_storage().nbytes()
        if x.device.type == "cuda" and tier == "host":
            out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, pin_memory=True)
            if self.asynchronous:
                side = side_stream(self._side, x.device)
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    out.copy_(x, non_blocking=True)
                x.record_stream(side)
            else:
                out.copy_(x)
        elif tier == "host":
            out = _host_copy(x, swapped=True)
        else:
            out = self._to_disk(x, nbytes)
        with self._lock:
            self.bytes_out[tier] += nbytes
        return out

    def get(self, h: torch.Tensor, device: torch.device, tier: Tier) -> torch.Tensor:
        """A new tensor on ``device`` with ``h``'s values (allocated by torch).

        On CUDA from a pinned buffer, and on the CPU from a swapped tensor with the copy thread
        on, the copy is asynchronous: call :meth:`wait` on the result before any use. A
        host-placed parameter the prefetch cache holds comes from there."""
        cache = self.prefetched
        if cache is not None and tier == "host" and h.device.type == "cpu":
            storage = h.untyped_storage()  # (one read: the storage object is made per call)
            key = storage.data_ptr()
            if cache.watches_key(key):
                return cache.fetch(
                    h, lambda: self._get(h, device, tier), key=key, nbytes=storage.nbytes()
                )
        return self._get(h, device, tier)

    def _get(self, h: torch.Tensor, device: torch.device, tier: Tier) -> torch.Tensor:
        out = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
        try:
            if out.device.type == "cuda" and self.asynchronous and is_pinned_host(h):
                # A host-placed parameter: its fetch has no ``wait`` op (rewrites/params.py), so it
                # copies on the compute stream, ordered before its readers; the host goes on.
                out.copy_(h, non_blocking=True)
            elif out.device.type == "cuda" and h.is_pinned() and self.asynchronous:
                side = side_stream(self._side, out.device)
                side.wait_stream(torch.cuda.current_stream(out.device))
                with torch.cuda.stream(side):
                    out.copy_(h, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(side)
                with self._lock:
                    self._pending[out.data_ptr()] = event
            elif (
                out.device.type == "cpu"
                and self.asynchronous
                and copy_engine.worth(h.numel() * h.element_size())
                and _is_swapped(h)
            ):
                # The CPU's copy engine (copy_engine.py): ``wait`` comes before the first reader.
                job = copy_engine.submit(out, h)
                with self._lock:
                    self._pending[out.data_ptr()] = job
            else:
                out.copy_(h)
        except (OSError, RuntimeError) as e:
            raise OffloadError(f"{tier} tier: reading a swapped tensor back failed: {e}") from e
        with self._lock:
            # The bytes copied: a block of rows of a swapped tensor (rewrites/tiling/build.py) reads
            # a part of its storage.
            self.bytes_in[tier] += h.numel() * h.element_size()
        return out

    def wait(self, y: torch.Tensor) -> None:
        """Make the current stream wait until :meth:`get`'s copy into ``y`` is done (CUDA), or
        block until the copy thread made it (CPU); a no-op for synchronous copies.

        Raises:
            OffloadError: the copy thread's copy failed."""
        if not self._pending:
            return
        with self._lock:
            event = self._pending.pop(y.data_ptr(), None)
        if event is None:
            return
        if isinstance(event, CopyJob):
            try:
                event.wait()
            except (OSError, RuntimeError) as e:
                raise OffloadError(f"reading a swapped tensor back failed: {e}") from e
            return
        torch.cuda.current_stream(y.device).wait_event(event)

    def finish_puts(self, device: torch.device) -> None:
        """Block the host until this store's side-stream copies on the CUDA ``device`` are done:
        the next reader of a ``put`` result is on the host (a gradient autograd sums there)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side.get(index)
        if stream is not None:
            stream.synchronize()

    def in_flight(self) -> int:
        """Reloads issued whose :meth:`wait` has not run yet."""
        with self._lock:
            return len(self._pending)

    def _to_disk(self, x: torch.Tensor, nbytes: int) -> torch.Tensor:
        folder = self._folder()
        with self._lock:
            self._counter += 1
            name = os.path.join(folder, f"swap-{os.getpid()}-{self._counter}.bin")
        # Swap candidates cover their storage exactly, so its bytes are the tensor in its layout.
        src = x.detach() if x.device.type == "cpu" else x.detach().cpu()
        payload = _storage_bytes(src) if nbytes else np.empty(0, np.uint8)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise OffloadError(f"disk tier: cannot create a swap file in {folder!r}: {e}") from e
        try:
            os.unlink(name)  # the mapping keeps the data; the name is not needed
            written = os.write(fd, payload.data) if nbytes else 0
            if written != nbytes:
                raise OSError(errno.ENOSPC, f"short write ({written} of {nbytes} bytes)")
            os.fsync(fd)
            mapped = mmap.mmap(
                fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError as e:
            raise OffloadError(
                f"disk tier: writing {format_bytes(nbytes)} to {folder!r} failed: {e}"
            ) from e
        finally:
            os.close(fd)
        # Written and synced: drop the pages from memory; reading them back faults them in.
        if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)
        # The array references the mapping, which unmaps when the last tensor view is gone.
        buffer = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
        if not nbytes:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        address = buffer.ctypes.data
        with _host_lock:
            _disk_maps[address] = weakref.ref(mapped)
        weakref.finalize(buffer, _forget_disk, address)
        return _as_torch(buffer, x)

    def close(self) -> None:
        """Remove the temporary disk folder (files of live tensors stay until they are freed)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


_stores: dict[int, TieredStore] = {}
_stores_lock = threading.Lock()


def register_store(store: TieredStore) -> int:
    """A process-wide key for ``store`` (graph nodes carry the key, not the object)."""
    with _stores_lock:
        key = len(_stores)
        _stores[key] = store
        return key


def get_store(key: int) -> TieredStore:
    try:
        return _stores[key]
    except KeyError:
        raise OffloadError(f"no memcompile store {key} in this process") from None
