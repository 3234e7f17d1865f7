"""Parameters of a CUDA model in the host tier: pinned copies, and what Dynamo sees meanwhile.

A host-placed CUDA parameter keeps its identity (optimizers and autograd hold the same object)
but its ``.data`` becomes a pinned CPU tensor with the same values, shape and strides: ZeRO-
Offload's split, in which the parameter, its gradient and the optimizer step live on the host
and the graphs fetch a device copy for each use (``rewrites/params.py``):

    before                              after place_pinned(p)
      p.data: cuda:0, 4 MiB               p.data: cpu (pinned), 4 MiB   registered here
      p.grad: cuda:0 (or None)            p.grad: cpu (pinned)          (and each later one)
      optimizer state: made on cuda       optimizer state: made on the host at its first step
                                          (made on cuda before: moved at the next step)

Two things make that work under ``torch.compile``:

* **Traces see the device.** Dynamo does not re-guard a parameter whose ``.data`` changed (its
  module's parameter dict is unchanged), so compiled graphs keep running. But a frame traced
  again (a new input shape, a re-plan, a second fragment reading a tied weight) would trace the
  model's code with a CPU weight and a CUDA activation and fail. While Dynamo compiles, each
  host-placed parameter therefore holds a *placeholder*: a tensor on its device with its shape
  and strides whose storage has no bytes (``resize_(0)``, as FSDP frees parameters). Tracing
  reads only metadata; the compile-end callback puts the pinned tensor back.

      Dynamo compile start:  p.data = placeholder (cuda:0, 0 bytes)   is_pinned_param(p) holds
      Dynamo compile end:    p.data = pinned host tensor

* **Gradients are complete before they are read.** The backward copies each gradient to a pinned
  buffer on the store's side stream (``TieredStore.put``), asynchronously, and autograd sums a
  parameter's contributions on the host as soon as the graph returns them (a cell called many
  times: one per call). So the compiler's backward wrapper waits for the side stream before
  returning (``TieredStore.finish_puts``: a hook on the parameter would run only after those
  sums). A global optimizer pre-step hook synchronizes too: the fetches copy from the pinned
  parameters asynchronously, and the step must not update them before those copies are done.

Code that changes such a parameter in place outside an optimizer right after a forward should
call ``torch.cuda.synchronize()`` first, for the same reason.

Code that runs eagerly and reads such a parameter (a frame Dynamo gave up on) sees a CPU tensor:
the device mismatch raises torch's usual error rather than computing anything wrong. (Only the
parameters of compiled fragments are placed; ``next(model.parameters()).device`` then says
``cpu``, so user code should take the device from its inputs.)
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from memcompile.runtime import placement
from memcompile.runtime.compile_callbacks import ensure_compile_callbacks

log = logging.getLogger(__name__)

__all__ = [
    "install_hooks",
    "is_pinned_host",
    "is_pinned_param",
    "pinned_copy",
    "place_pinned",
    "side_stream",
    "state_to_host",
]

_lock = threading.Lock()
# Pinned host-tier storages (parameters and their gradients) by address. A weak reference tells
# a live storage from a freed one whose address the host allocator handed out again.
_pinned: dict[int, StorageWeakRef] = {}
# Host-placed CUDA parameters -> their device (a placeholder is made there while tracing).
_params: WeakIdKeyDictionary = WeakIdKeyDictionary()  # (tensors compare elementwise: by id)
# While Dynamo compiles: parameter -> (its pinned tensor, its gradient), put back at the end.
_tracing: WeakIdKeyDictionary = WeakIdKeyDictionary()


def side_stream(streams: dict[int, torch.cuda.Stream], device: torch.device) -> torch.cuda.Stream:
    """The copy stream in ``streams`` for the CUDA ``device`` (by index; made on first use): a
    store and a prefetch cache each keep their own, so their copies overlap compute."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    return stream


def pinned_copy(x: torch.Tensor) -> torch.Tensor:
    """A registered pinned CPU copy of the CUDA tensor ``x``, which covers its storage (same
    shape, strides and dtype). Synchronous: the copy is done when this returns."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, pin_memory=True)
    out.copy_(x)
    storage = out.untyped_storage()
    with _lock:
        _pinned[storage.data_ptr()] = StorageWeakRef(storage)
    return out


def is_pinned_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is a registered pinned host-tier buffer."""
    if t.device.type != "cpu" or isinstance(t, torch._subclasses.FakeTensor):
        return False
    storage = t.untyped_storage()
    with _lock:
        ref = _pinned.get(storage.data_ptr())
        if ref is None:
            return False
        if ref.expired():  # freed; the address was reused
            del _pinned[storage.data_ptr()]
            return False
        return ref.cdata == storage._cdata


def is_pinned_param(t: torch.Tensor) -> bool:
    """Whether ``t`` is a host-placed CUDA parameter holding its placeholder while Dynamo
    compiles (outside a compile its pinned tensor answers :func:`is_pinned_host`)."""
    return t in _tracing if isinstance(t, torch.nn.Parameter) else False


def place_pinned(p: torch.Tensor) -> int:
    """Move the CUDA parameter ``p`` to pinned host memory, in place (see the module docstring).
    Returns the device bytes freed. The caller has checked that ``p`` covers its storage."""
    device = p.device
    freed = p.untyped_storage().nbytes()
    with torch.no_grad():
        p.data = pinned_copy(p)
    placement.moved()
    install_hooks()
    if isinstance(p, torch.nn.Parameter):
        _params[p] = device
    log.debug("parameter %s of %s moved to pinned host memory", tuple(p.shape), device)
    return freed


def _placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    ph = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
    ph.untyped_storage().resize_(0)  # metadata only: no device bytes
    return ph


def _is_dynamo(args: Any) -> bool:
    trigger = getattr(args, "callback_trigger", None)
    return trigger is None or getattr(trigger, "name", "") == "DYNAMO"


def _on_compile_start(args: Any = None) -> None:
    if not _is_dynamo(args) or not _params:
        return
    with torch.no_grad():
        for p, device in list(_params.items()):
            if p.device.type == "cpu" and p not in _tracing:
                # A CUDA placeholder cannot hold the host gradient: it waits beside the data.
                _tracing[p] = (p.data, p.grad)
                p.grad = None
                p.data = _placeholder(p, device)
    if _tracing:
        placement.moved()


def _on_compile_end(args: Any = None) -> None:
    if not _tracing:
        return
    with torch.no_grad():
        for p, (host, grad) in list(_tracing.items()):
            p.data = host
            p.grad = grad
    _tracing.clear()
    placement.moved()


def _before_optimizer_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    # The forward's and backward's fetches copy from the pinned parameters asynchronously: an
    # optimizer must not update them in place before those copies are done.
    if _params and torch.cuda.is_available():
        torch.cuda.synchronize()
        state_to_host(optimizer)


# Optimizer -> the placement epoch its state was last walked at (a loop's steps walk it once).
_walked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def state_to_host(optimizer: torch.optim.Optimizer) -> int:
    """Move the state ``optimizer`` holds on the device for host-placed parameters to the host,
    where their step runs. A parameter placed after the optimizer's first step (an early exit's
    head, placed when the exit is first taken) has state made on the device, and torch's step
    refuses the mix ("Expected all tensors to be on the same device"). The values are copied
    exactly. Returns the device bytes freed; walks the state only after a placement changed."""
    now = placement.epoch()
    if _walked.get(optimizer) == now:
        return 0
    freed = 0
    for p, state in optimizer.state.items():
        if not isinstance(p, torch.nn.Parameter) or p not in _params:
            continue
        for key, t in list(state.items()):
            if isinstance(t, torch.Tensor) and t.device != p.device:
                state[key] = t.to(p.device)
                freed += t.untyped_storage().nbytes()
    if freed:
        log.info(
            "memcompile: %s's state of host-placed parameters (%d bytes) moved to the host",
            type(optimizer).__name__,
            freed,
        )
        placement.moved()
    _walked[optimizer] = placement.epoch()
    return freed


_optimizer_hooked = False


def install_hooks() -> None:
    """Register the Dynamo compile start/end callbacks (placeholders) unless they are there, and,
    once per process, a global optimizer pre-step hook (finish in-flight copies from the pinned
    parameters). The callbacks stay across ``torch._dynamo.reset()``
    (runtime/compile_callbacks.py)."""
    global _optimizer_hooked
    ensure_compile_callbacks(_on_compile_start, _on_compile_end)
    if not _optimizer_hooked:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_optimizer_step)
        _optimizer_hooked = True
