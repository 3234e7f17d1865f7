"""What a ``torch.optim`` optimizer's step holds on the device, and what it allocates and frees.

The iteration's last phase is the optimizer step (``step/iteration.py``)::

    peak = parameters + buffers + gradients + optimizer state + the step's transient

The state (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum buffers) is read off the
optimizer after a step. The transient is priced from the optimizer's kind and implementation,
per parameter group (the groups step one after the other), as measured with the CPU allocator on
torch 2.13 (``tests/test_iteration.py`` checks each row against the profiler)::

    Adam, AdamW   fused: 0      foreach: the group's parameters (one sqrt per tensor, at once)
                  for-loop: 2 x the largest parameter (sqrt, then the division), + 1 x with
                  Adam's coupled weight decay or maximize (a new gradient)
    SGD           fused: 0      foreach: the group's parameters with weight decay, else 0
                  for-loop: 1 x the largest parameter for weight decay, 1 x for Nesterov
    others        2 x the largest parameter, an estimate (``exact=False``)

Which implementation runs is the optimizer's own choice: ``fused`` or ``foreach`` as given, else
torch's default for the parameters' device (foreach on CUDA, the for-loop on the CPU).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memcompile.errors import format_bytes
from memcompile.runtime import placement
from memcompile.runtime.store import is_disk_placed, is_host_placed, is_off_device

__all__ = ["OptimizerCost", "cost_key", "on_device", "plain", "price_optimizer", "state_bytes"]

_ADAM = frozenset({"Adam", "AdamW"})


@dataclass(frozen=True)
class OptimizerCost:
    """One optimizer's step, as far as it steps the compiled model's parameters.

    Attributes:
        kind: the optimizer's class name (``"AdamW"``).
        implementation: ``"fused"``, ``"foreach"`` or ``"for-loop"`` (the largest group's).
        param_bytes: bytes of the parameters it steps.
        state_bytes: bytes of its state on the device (after a step; 0 before the first).
        host_state_bytes: bytes of its state in the host tier (``offload_optimizer``).
        disk_state_bytes: bytes of its state in the disk tier (``offload_optimizer`` with
            ``offload_to="disk"``).
        transient: bytes its step allocates and frees again, at most.
        exact: the transient is priced for this kind (else an estimate).
    """

    kind: str
    implementation: str
    param_bytes: int
    state_bytes: int
    transient: int
    exact: bool
    host_state_bytes: int = 0
    disk_state_bytes: int = 0

    def describe(self) -> str:
        """``AdamW (for-loop) state 41.80 MiB`` (``... on the host`` / ``on disk`` where it is
        there)."""
        tiers = [
            f"{format_bytes(n)} {name}"
            for n, name in (
                (self.host_state_bytes, "on the host"),
                (self.disk_state_bytes, "on disk"),
            )
            if n
        ]
        where = f" ({', '.join(tiers)})" if tiers else ""
        return f"{self.kind} ({self.implementation}) state {format_bytes(self.state_bytes)}{where}"


def plain(t: torch.Tensor) -> torch.Tensor | None:
    """``t``, or the local shard of a ``DTensor`` (FSDP2's parameters, gradients and optimizer
    state: their memory is the shard); ``None`` for another wrapper subclass."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return None if is_traceable_wrapper_subclass(t) else t


def _shard(t: torch.Tensor) -> torch.Tensor:
    local = plain(t)
    return t if local is None else local


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        local = plain(t)
        if local is not None:
            storage = local.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _implementation(group: dict, params: list[torch.Tensor]) -> str:
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:
        _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return "foreach" if foreach else "for-loop"


def _group_transient(kind: str, group: dict, sizes: list[int], impl: str) -> tuple[int, bool]:
    """The transient of one parameter group's step, and whether the kind is priced."""
    if not sizes or impl == "fused":
        return 0, kind in _ADAM or kind == "SGD"
    largest, total = max(sizes), sum(sizes)
    decay = group.get("weight_decay", 0) != 0
    if kind in _ADAM:
        if impl == "foreach":
            return total, True
        coupled = decay and kind == "Adam" and not group.get("decoupled_weight_decay", False)
        return largest * (2 + int(coupled or bool(group.get("maximize")))), True
    if kind == "SGD":
        if impl == "foreach":
            return (total if decay and not group.get("maximize") else 0), True
        return largest * (int(decay) + int(bool(group.get("nesterov")))), True
    return 2 * largest, False


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` is memory of the compute ``device`` (a CUDA model's CPU tensors are not;
    nor, on either, the host tier's)."""
    local = plain(t)
    return local is not None and local.device.type == device.type and not is_off_device(local)


def _computes_on(p: torch.Tensor, device: torch.device) -> bool:
    # What a step computes from ``p`` is new memory on ``p``'s device: the compute device's for
    # a host-placed parameter of a CPU model (the host tier is outside the allocator; torch's
    # ops allocate inside it), the host's for a CUDA model's pinned one.
    return p.device.type == device.type


def state_bytes(
    optimizer: torch.optim.Optimizer, params: Collection[int], device: torch.device
) -> int:
    """``device`` bytes of ``optimizer``'s state for the parameters with ids in ``params``
    (each storage once)."""
    return _state_tiers(optimizer, params, device)[0]


def _state_tiers(
    optimizer: torch.optim.Optimizer, params: Collection[int], device: torch.device
) -> tuple[int, int, int]:
    """Bytes of the state of the parameters with ids in ``params`` on ``device``, in the host
    tier and in the disk tier (each storage once), in one pass: a loop prices its optimizer
    step at every step, over every state tensor."""
    seen: list[dict[int, int]] = [{}, {}, {}]  # device, host, disk: address -> bytes
    for p, state in optimizer.state.items():
        if id(p) not in params:
            continue
        for t in state.values():
            if not isinstance(t, torch.Tensor):
                continue
            local = plain(t)
            if local is None:
                continue
            if is_disk_placed(local):
                where = 2
            elif is_host_placed(local):
                where = 1
            elif local.device.type == device.type:
                where = 0
            else:
                continue
            storage = local.untyped_storage()
            seen[where][storage.data_ptr()] = storage.nbytes()
    device_bytes, host_bytes, disk_bytes = (sum(s.values()) for s in seen)
    return device_bytes, host_bytes, disk_bytes


#: Group settings the transient's price reads (a scheduler changing ``lr`` changes no price).
_PRICED_SETTINGS = (
    "fused",
    "foreach",
    "weight_decay",
    "decoupled_weight_decay",
    "maximize",
    "nesterov",
    "amsgrad",
    "capturable",
    "differentiable",
)


def cost_key(
    optimizer: torch.optim.Optimizer, params: frozenset[int], device: torch.device
) -> tuple[object, ...]:
    """What :func:`price_optimizer`'s answer depends on, read cheaply: the state dict (a new
    one after ``load_state_dict``), its entries and their tensors' count (state made lazily by
    a first step, or for a parameter's first gradient), the groups and their priced settings,
    and memcompile's placements (``runtime/placement.py``). Equal keys: the same price, short
    of the loop replacing state tensors by hand with ones of other sizes or devices."""
    state = optimizer.state
    groups = tuple(
        (id(g["params"]), len(g["params"]), *(repr(g.get(k)) for k in _PRICED_SETTINGS))
        for g in optimizer.param_groups
    )
    entries = sum(len(s) for s in state.values())
    return (params, str(device), id(state), len(state), entries, groups, placement.epoch())


def price_optimizer(
    optimizer: torch.optim.Optimizer, params: Collection[int], device: torch.device
) -> OptimizerCost:
    """The cost of ``optimizer``'s step over the parameters with ids in ``params`` (those of the
    compiled model, whose compute device is ``device``), with the state it holds now. A CUDA
    model's parameters in the host tier (``offload_params``) step on the host: their transient
    is not the device's."""
    kind = type(optimizer).__name__
    transient, exact, impls = 0, True, []
    mine: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        stepped = [p for p in group["params"] if id(p) in params]
        mine += stepped
        stepped = [p for p in stepped if _computes_on(p, device)]
        if not stepped:
            continue
        impl = _implementation(group, stepped)
        sizes = [_nbytes(_shard(p)) for p in stepped]  # a DTensor's shard is stepped
        t, priced = _group_transient(kind, group, sizes, impl)
        transient, exact = max(transient, t), exact and priced
        impls.append((sum(sizes), impl))
    implementation = max(impls)[1] if impls else "for-loop"
    on_device_bytes, host_bytes, disk_bytes = _state_tiers(optimizer, params, device)
    return OptimizerCost(
        kind=kind,
        implementation=implementation,
        param_bytes=sum(_storages(mine).values()),
        state_bytes=on_device_bytes,
        host_state_bytes=host_bytes,
        disk_state_bytes=disk_bytes,
        transient=transient,
        exact=exact,
    )
