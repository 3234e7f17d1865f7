"""memcompile's graph ops: swap a tensor out to a tier and back.

    host = torch.ops.memcompile.offload(x, store, tier)    # copy x to the store's tier
    y    = torch.ops.memcompile.reload(host, device, store, tier)  # copy back to the device
    torch.ops.memcompile.wait(y, store)                    # before the first use of y
    torch.ops.memcompile.pilot_prefetch(hook, fragment, [counts])  # dynamic/prefetch.py


Real custom ops (``torch.library.custom_op``, functional, with fake kernels), so they survive
AOTAutograd, FX codegen and Inductor, and the analysis can recognise them. ``offload`` returns a
CPU tensor whose memory is outside the device allocator (see ``store.py``); ``reload`` returns a
new device tensor. Neither returns (a view of) its input. On CUDA both copies run on a side
stream (see ``store.py``), so a reload can be issued early; ``wait`` makes the compute stream wait
for it. ``wait`` is declared to mutate ``y`` so that no compiler moves a reader of ``y`` above it
or drops it (it returns nothing); it does not change ``y``'s values.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

import memcompile.runtime.linearce  # registers the loss head's ops by blocks
import memcompile.runtime.losshead  # registers the loss head's in-place ops
import memcompile.runtime.rng  # noqa: F401 - registers the dropout replay ops
from memcompile.runtime.store import get_store

__all__ = [
    "DIRECT",
    "HOST_RESULTS",
    "TIERS",
    "InGraphHook",
    "offload",
    "pilot_prefetch",
    "register_hook",
    "reload",
    "wait",
]

#: Tier codes carried by the graph nodes.
TIERS: tuple[str, ...] = ("host", "disk")


def offload_impl(x: torch.Tensor, store: int, tier: int) -> torch.Tensor:
    """What ``offload`` runs (also called directly by the eager inner compiler, see DIRECT)."""
    return get_store(store).put(x, TIERS[tier])  # type: ignore[arg-type]


def reload_impl(h: torch.Tensor, device: torch.device, store: int, tier: int) -> torch.Tensor:
    """What ``reload`` runs."""
    return get_store(store).get(h, device, TIERS[tier])  # type: ignore[arg-type]


def wait_impl(y: torch.Tensor, store: int) -> None:
    """What ``wait`` runs."""
    get_store(store).wait(y)


@torch.library.custom_op("memcompile::offload", mutates_args=())
def offload(x: torch.Tensor, store: int, tier: int) -> torch.Tensor:
    """Copy ``x`` to tier ``TIERS[tier]`` of store ``store``; returns the tier's tensor."""
    return offload_impl(x, store, tier)


@offload.register_fake
def _(x: torch.Tensor, store: int, tier: int) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.custom_op("memcompile::reload", mutates_args=())
def reload(h: torch.Tensor, device: torch.device, store: int, tier: int) -> torch.Tensor:
    """A new tensor on ``device`` with the values of the swapped tensor ``h``."""
    return reload_impl(h, device, store, tier)


@reload.register_fake
def _(h: torch.Tensor, device: torch.device, store: int, tier: int) -> torch.Tensor:
    return torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device)


@torch.library.custom_op("memcompile::wait", mutates_args=("y",))
def wait(y: torch.Tensor, store: int) -> None:
    """The current stream waits until ``reload``'s copy into ``y`` is done."""
    wait_impl(y, store)


@wait.register_fake
def _(y: torch.Tensor, store: int) -> None:
    return None


#: Graph ops whose results (by index; 0 for an op with one) are host-tier memory, not the
#: device's: a swapped-out copy, and the log-softmax a loss head by blocks keeps on the host
#: (``runtime/linearce.py``). The analyses count them as held outside the device.
HOST_RESULTS: dict[object, tuple[int, ...]] = {
    torch.ops.memcompile.offload.default: (0,),
    torch.ops.memcompile.linear_ce_forward_host.default: (2,),
}


class InGraphHook(Protocol):
    """What ``pilot_prefetch`` calls (the pilot's prefetcher has it)."""

    def in_graph(self, fragment: int, observed: Sequence[torch.Tensor]) -> None: ...


# Weak: a graph outliving its compiler (and prefetcher) must not keep them alive.
_hooks: dict[int, weakref.ref[InGraphHook]] = {}
_hook_keys = itertools.count()
_hooks_lock = threading.Lock()


def register_hook(hook: InGraphHook) -> int:
    """A process-wide key for ``hook`` (graph nodes carry the key, not the object)."""
    with _hooks_lock:
        key = next(_hook_keys)

        def forget(_: object, key: int = key) -> None:
            _hooks.pop(key, None)

        _hooks[key] = weakref.ref(hook, forget)
        return key


def pilot_prefetch_impl(hook: int, fragment: int, observed: list[torch.Tensor]) -> None:
    """What ``pilot_prefetch`` runs: the hook's ``in_graph`` (nothing once it is gone)."""
    ref = _hooks.get(hook)
    target = ref() if ref is not None else None
    if target is not None:
        target.in_graph(fragment, observed)


@torch.library.custom_op("memcompile::pilot_prefetch", mutates_args=())
def pilot_prefetch(hook: int, fragment: int, observed: list[torch.Tensor]) -> None:
    """Fragment ``fragment``'s forward reached the point where the pilot predicts and prefetches
    the next blocks, reading ``observed``."""
    pilot_prefetch_impl(hook, fragment, observed)


@pilot_prefetch.register_fake
def _(hook: int, fragment: int, observed: list[torch.Tensor]) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.memcompile.pilot_prefetch.default)

#: The plain functions behind the ops. A graph run node by node (the eager inner compiler) calls
#: these instead: going through the dispatcher costs ~20 us per call on a GPU host, three calls
#: per swapped tensor. Graphs keep the ops (the analysis and Inductor recognise them).
DIRECT: dict[object, object] = {
    torch.ops.memcompile.offload.default: offload_impl,
    torch.ops.memcompile.reload.default: reload_impl,
    torch.ops.memcompile.wait.default: wait_impl,
    torch.ops.memcompile.pilot_prefetch.default: pilot_prefetch_impl,
}
