"""Parameters that FSDP2 (``fully_shard``) manages: memcompile leaves them, and the memory FSDP
allocates outside memcompile's graphs, to FSDP.

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    compiled = torch.compile(model, backend="memcompile", options={"budget": "6GiB"})

FSDP2 keeps each parameter as a ``DTensor`` shard. Around each unit's forward and backward it
all-gathers the full parameter into a plain ``nn.Parameter``, swaps that into the module, and
frees it afterwards; its hooks reduce-scatter the gradients back into shards. Dynamo breaks the
graph at those hooks (FSDP wraps them in ``torch._dynamo.disable``), so each unit's compute
reaches memcompile as fragments whose inputs are the *unsharded* parameters:

    F1(x, W_unsharded, b_unsharded)    # FSDP all-gathered W and b before; frees them after

Two consequences, both handled through :func:`sharded_params`:

* memcompile never moves them to its host tier. FSDP resizes their storages and copies the
  all-gather into them; a host-tier storage would be written behind memcompile's back. FSDP2's
  own ``offload_policy=CPUOffloadPolicy()`` is the way to keep such parameters on the host.
* FSDP's buffers live outside memcompile's graphs: the other units' all-gathered parameters,
  the unsharded gradients before their reduce-scatter, and the collectives' flat buffers. The
  plans and the predicted peak do not count them; memcompile says so (a ``MemoryBudgetWarning``
  under a budget, and a line of the report). On CUDA the step check still compares every step's
  measured peak with the budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

__all__ = ["ShardedParams", "sharded_params"]


@dataclass(frozen=True)
class ShardedParams:
    """The parameters FSDP2 manages in one model, as seen at one moment.

    Attributes:
        units: modules ``fully_shard`` was applied to.
        param_ids: ``id`` of each parameter object the units hold now: the sharded ``DTensor``
            of a resharded unit, the unsharded ``nn.Parameter`` of a unit FSDP has all-gathered
            (FSDP2 reuses that object in every step).
        unsharded_bytes: the bytes of every managed parameter at its full (unsharded) size.
    """

    units: int
    param_ids: frozenset[int]
    unsharded_bytes: int


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return None
    return FSDPModule


def sharded_params(model: torch.nn.Module | None) -> ShardedParams | None:
    """The parameters of ``model`` under a ``fully_shard`` unit (``None``: no unit). A
    parameter reachable from several units (a nested unit's, also under the root) counts once."""
    fsdp = _fsdp_module_type()
    if model is None or fsdp is None:
        return None
    units = [m for m in model.modules() if isinstance(m, fsdp)]
    if not units:
        return None
    params = {id(p): p for unit in units for p in unit.parameters()}
    # A DTensor's shape is the global one: every rank counts the full parameter.
    unsharded = sum(p.numel() * p.element_size() for p in params.values())
    return ShardedParams(len(units), frozenset(params), unsharded)
