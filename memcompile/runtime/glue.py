"""The eager glue's saved tensors in the host tier (``saved_tensors_hooks``).

When Dynamo runs a frame eagerly (an MoE's routing loop, an early exit's ``if``), the tensor
ops between the compiled fragments — the glue — save activations for backward that no plan
sees. With :class:`GlueOffload` on, a model call runs under a pair of saved-tensor hooks: each
tensor an eager op saves goes to the host tier as it is saved, and comes back to the device
when its backward node reads it, as ``torch.autograd.graph.save_on_cpu`` does::

    model call                                  (GlueOffload.enter ... leave)
      x = hidden[idx]                           glue
      y = F.linear(x, w)                        glue: saves x, w
                                                  x -> pack: host copy; x's device bytes go
                                                  when the glue drops x
                                                  w -> kept (a parameter: on the device anyway)
      z = fragment(y)                           paused: the fragment's saves are its plan's
    backward
      linear's node                             x <- unpack: a device copy, freed after the node

A fragment's call runs with the hooks paused (:meth:`GlueOffload.paused`, around each compiled
callable): AOTAutograd's saves are what its plan decided. Parameters, buffers, tensors already
off the device, fake tensors (Dynamo tracing inside the call) and tensors under ``MIN_BYTES``
pass through unchanged. A tensor saved several times while its storage is alive and unchanged
is copied once. A view of a glue-read parameter's fetched copy (``runtime/glue_params.py``) is
kept as the parameter and the view's geometry, and read back from the parameter. Values are
copied exactly, so gradients stay bit-identical; only where the bytes live changes.

The compiler turns it on when a measured step through the backward is over the budget with
eager frames in the model (``step/checks.py``), or when glue-read parameters go to the host tier
(unless ``swap=False``: then the hooks keep only the parameters' views), and reports what it
moved (``report().glue``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch._subclasses import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memcompile.runtime.glue_params import GlueParams
from memcompile.runtime.store import TieredStore, is_off_device

__all__ = ["MIN_BYTES", "GlueOffload", "GlueStats"]

log = logging.getLogger(__name__)

#: Saved tensors smaller than this stay on the device: the host copy's fixed cost (a buffer
#: and its bookkeeping, a few microseconds) buys nothing there.
MIN_BYTES = 1024


@dataclass(frozen=True)
class GlueStats:
    """What the glue's hooks did in the last model call.

    Attributes:
        on: whether the glue's saved tensors go to the host tier.
        why: why it was turned on ("" while off).
        tensors: saved tensors copied to the host tier in the last call.
        bytes: their bytes (the device bytes the glue's autograd graph no longer holds).
        kept: saved tensors left on the device (parameters, buffers, small ones).
    """

    on: bool = False
    why: str = ""
    tensors: int = 0
    bytes: int = 0
    kept: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Packed:
    """A saved tensor's host copy (a distinct type: on the CPU device both tiers are "cpu")."""

    __slots__ = ("host",)

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host


class _ParamView:
    """A saved view of a glue-read parameter's fetched copy: the parameter (in the host tier)
    and the view's geometry; read back from the parameter, never copied to the host again."""

    __slots__ = ("offset", "param", "size", "stride", "version")

    def __init__(self, param: torch.Tensor, t: torch.Tensor) -> None:
        self.param = param
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self.version = param._version

    def fetch(self, device: torch.device) -> torch.Tensor:
        if self.param._version != self.version:
            # What autograd says of a saved tensor changed in place before its backward.
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a parameter of shape {tuple(self.param.shape)} that only "
                "eager code reads (memcompile keeps it in the host tier) is at version "
                f"{self.param._version}; expected version {self.version} instead"
            )
        view = self.param.detach().as_strided(self.size, self.stride, self.offset)
        out = torch.empty_strided(self.size, self.stride, dtype=view.dtype, device=device)
        # CUDA: from pinned memory on the compute stream, before its readers; the optimizer
        # step waits for such copies (runtime/pinned.py).
        out.copy_(view, non_blocking=out.device.type == "cuda")
        return out


class GlueOffload:
    """The saved-tensor hooks of one compiler's model calls.

    Args:
        store: the compiler's tiered store (its host tier takes the copies).
        device: the compute device, read when a call begins (``None``: not known yet).
        resident: the tensors whose storages stay on the device anyway (the model's parameters
            and buffers), read when a call begins.
    """

    def __init__(
        self,
        store: TieredStore,
        device: Callable[[], torch.device | None],
        resident: Callable[[], Iterable[torch.Tensor]],
    ) -> None:
        self.params = GlueParams(store)
        self._store = store
        self._device = device
        self._resident = resident
        self._local = threading.local()
        #: the glue's saved tensors go to the host tier
        self.on = False
        self.why = ""
        self.stats = GlueStats()

    def turn_on(self, why: str) -> bool:
        """Send the glue's saved tensors to the host tier from the next model call; returns
        False when it was on already."""
        if self.on:
            return False
        self.on, self.why = True, why
        self.stats = GlueStats(on=True, why=why)
        log.info("memcompile: the eager glue's saved tensors go to the host tier: %s", why)
        return True

    def reset(self) -> None:
        """Off again, as before the first measured step (the fragments are gone). The
        parameters only eager code reads stay in the host tier, fetched as before."""
        self.on, self.why = False, ""
        self.stats = GlueStats()

    @property
    def hooked(self) -> bool:
        """A model call runs under the hooks: the glue's saved tensors go to the host tier, or
        saved views of glue-read parameters' fetched copies are kept as the parameters'."""
        return self.on or bool(self.params.params)

    # -- a model call --------------------------------------------------------------------------
    def enter(self) -> None:
        """A model call begins: push the hooks (when on, on a known device, and the caller has
        no saved-tensor hooks of its own: those are the user's and win)."""
        stack: list[Any] = self._stack()
        device = self._device() if self.hooked else None
        if device is None or torch._C._autograd._top_saved_tensors_default_hooks(True):
            stack.append(None)
            return
        call = _Call(self._store, device, self._resident(), self.params, activations=self.on)
        # The hooks run inside the model's frames, which Dynamo evaluates: never traced.
        hooks = torch.autograd.graph.saved_tensors_hooks(
            torch._dynamo.disable(call.pack, reason="memcompile: the glue's pack hook"),
            torch._dynamo.disable(call.unpack, reason="memcompile: the glue's unpack hook"),
        )
        hooks.__enter__()
        stack.append((hooks, call))

    def leave(self) -> None:
        """The call ends: pop its hooks (the saved tensors' host copies live on in the autograd
        graph until its backward reads them)."""
        stack = self._stack()
        if not stack:
            return
        top = stack.pop()
        if top is None:
            return
        hooks, call = top
        hooks.__exit__(None, None, None)
        call.done()
        if self.on:
            self.stats = GlueStats(
                on=True, why=self.why, tensors=call.tensors, bytes=call.bytes, kept=call.kept
            )

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    # -- fragments ------------------------------------------------------------------------------
    def paused(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """``compiled`` (a fragment's callable) run with the hooks paused: its saves are its
        plan's. (Dynamo calls it through its own ``disable``: this frame is never traced.)"""

        @functools.wraps(
            compiled
        )  # a boxed callable's _boxed_call too: the arguments pass as given
        def run(*args: Any) -> Any:
            if not self.hooked:
                return compiled(*args)
            with pause():
                return compiled(*args)

        return run


class pause:
    """Saved-tensor hooks off on this thread (Dynamo's own switch, used while it traces)."""

    def __enter__(self) -> None:
        self._prior = torch._C._autograd._saved_tensors_hooks_set_tracing(True)

    def __exit__(self, *exc: object) -> None:
        torch._C._autograd._saved_tensors_hooks_set_tracing(self._prior)


class _Call:
    """The hooks of one model call."""

    def __init__(
        self,
        store: TieredStore,
        device: torch.device,
        resident: Iterable[torch.Tensor],
        params: GlueParams,
        *,
        activations: bool,
    ) -> None:
        self._store = store
        self._params = params
        self._activations = activations
        self._device = device
        self._resident = {t.untyped_storage().data_ptr() for t in resident}
        # (storage, offset, shape, strides, dtype, version) -> the storage's weak reference and
        # its packed copy: a tensor saved by several ops is copied once while it lives unchanged.
        self._seen: dict[tuple[Any, ...], tuple[StorageWeakRef, _Packed]] = {}
        self.tensors = 0
        self.bytes = 0
        self.kept = 0

    def done(self) -> None:
        """The call ended: no more saves (its packed copies live on in the autograd graph)."""
        self._seen.clear()
        self._resident.clear()

    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, FakeTensor) or is_traceable_wrapper_subclass(t):
            # Dynamo tracing a frame inside the call (fake tensors), or a subclass (DTensor)
            # whose storage is its owner's: not glue memory.
            return t
        param = self._params.source(t)
        if param is not None:
            return _ParamView(param, t)
        if not self._activations:
            self.kept += 1
            return t
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if (
            t.device != self._device
            or t.layout != torch.strided
            or storage.nbytes() < MIN_BYTES
            or address in self._resident
            or is_off_device(t)
        ):
            self.kept += 1
            return t
        key = (address, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        hit = self._seen.get(key)
        if hit is not None and not hit[0].expired():
            return hit[1]
        packed = _Packed(self._store.put(t, "host"))
        self._seen[key] = (StorageWeakRef(storage), packed)
        self.tensors += 1
        self.bytes += storage.nbytes()
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _ParamView):
            return packed.fetch(self._device)
        if not isinstance(packed, _Packed):
            return packed
        y = self._store.get(packed.host, self._device, "host")
        self._store.wait(y)
        return y
