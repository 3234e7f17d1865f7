"""Tiered storage for swapped tensors: host memory and disk, outside the device allocator.

    store = TieredStore(disk_path=None)          # a temporary folder for the disk tier
    h = store.put(x, "host")                     # a tensor in host memory (copy of x)
    h = store.put(x, "disk")                     # a tensor backed by a file; its pages are dropped
    y = store.get(h, device)                     # a new device tensor with x's values

The tensors ``put`` returns own their memory: it is released when the last reference goes (for
a saved activation, when the backward has read it), so nothing needs an explicit free and
nothing leaks if a backward never runs.

    device   tier "host"                              tier "disk"
    CPU      numpy buffer (not torch's allocator,     file in disk_path, memory-mapped; written,
             so the CPU profiler sees the saving)     flushed and its pages dropped (a real RAM
                                                      saving); read back on get
    CUDA     pinned CPU tensor                         same as CPU

Failures (disk full, I/O errors) raise :class:`OffloadError` naming the tier and path; they
happen in the forward, before any parameter is updated.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import tempfile
import threading
from typing import Literal

import numpy as np
import torch

from memcompile.errors import MemcompileError, format_bytes

log = logging.getLogger(__name__)

__all__ = ["OffloadError", "Tier", "TieredStore", "get_store", "register_store"]

Tier = Literal["host", "disk"]


class OffloadError(MemcompileError):
    """Moving a tensor to or from a tier failed (for example, the disk is full)."""


def _as_torch(buffer: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    # A byte buffer viewed as a tensor with ``like``'s shape, strides and dtype.
    return torch.from_numpy(buffer).view(like.dtype).as_strided(like.shape, like.stride(), 0)


def _storage_bytes(x: torch.Tensor) -> np.ndarray:
    # The bytes of x's storage, without a copy (a CPU tensor; x covers its storage exactly).
    raw = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage())
    return raw.numpy()


class TieredStore:
    """Host and disk tiers of one compiled model.

    Args:
        disk_path: folder for the disk tier's files (created if missing); ``None``: a temporary
            folder, removed at exit.
    """

    def __init__(self, disk_path: str | None = None) -> None:
        self._disk_path = disk_path
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._lock = threading.Lock()
        self._counter = 0
        self.bytes_out = {"host": 0, "disk": 0}
        self.bytes_in = {"host": 0, "disk": 0}

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

    # -- put / get --------------------------------------------------------------------------------
    def put(self, x: torch.Tensor, tier: Tier) -> torch.Tensor:
        """A copy of ``x`` in ``tier`` (same shape, strides, dtype; CPU device)."""
        nbytes = x.untyped_storage().nbytes()
        if x.device.type == "cuda" and tier == "host":
            out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, pin_memory=True)
            out.copy_(x, non_blocking=False)
        elif tier == "host":
            out = _as_torch(np.empty(nbytes, dtype=np.uint8), x)
            out.copy_(x)
        else:
            out = self._to_disk(x, nbytes)
        with self._lock:
            self.bytes_out[tier] += nbytes
        return out

    def get(self, h: torch.Tensor, device: torch.device, tier: Tier) -> torch.Tensor:
        """A new tensor on ``device`` with ``h``'s values (allocated by torch)."""
        out = torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)
        try:
            out.copy_(h)
        except (OSError, RuntimeError) as e:
            raise OffloadError(f"{tier} tier: reading a swapped tensor back failed: {e}") from e
        with self._lock:
            self.bytes_in[tier] += h.untyped_storage().nbytes()
        return out

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
        return (
            _as_torch(buffer, x)
            if nbytes
            else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        )

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
