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

Three consequences, the first two handled through :func:`sharded_params`:

* memcompile never moves them to its host tier. FSDP resizes their storages and copies the
  all-gather into them; a host-tier storage would be written behind memcompile's back. FSDP2's
  own ``offload_policy=CPUOffloadPolicy()`` is the way to keep such parameters on the host.
* FSDP's buffers live outside memcompile's graphs: the other units' all-gathered parameters,
  the unsharded gradients before their reduce-scatter, and the collectives' flat buffers. The
  plans and the predicted peak do not count them; memcompile says so (a ``MemoryBudgetWarning``
  under a budget, and a line of the report). On CUDA the step check still compares every step's
  measured peak with the budget.
* Every rank must run the same units in the same order: a rank that skips one (an early exit, an
  expert no token of its batch chose) skips its all-gather, and the others' collectives then
  hang or abort. With ``check_ranks=True`` a :class:`RankCheck` makes the ranks compare, right
  before each unit's forward (a forward pre-hook ahead of FSDP's own), how many units each has
  run and which one comes next, on a gloo group of its own, and raises
  :class:`~memcompile.errors.RankDivergenceError` naming them when they differ:

      rank 0: layers.1 (unit call 3)    rank 1: layers.3 (unit call 3)    -> raised on both
"""

from __future__ import annotations

import datetime
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from memcompile.errors import MemoryBudgetWarning, RankDivergenceError, format_bytes

log = logging.getLogger(__name__)

__all__ = ["RANK_CHECK_TIMEOUT", "RankCheck", "ShardedModel", "ShardedParams", "sharded_params"]

#: How long a rank waits at a unit for the others (a rank that runs no further unit this step
#: never arrives): then it raises, rather than wait on FSDP's collectives for good.
RANK_CHECK_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class ShardedParams:
    """The parameters FSDP2 manages in one model, as seen at one moment.

    Attributes:
        units: modules ``fully_shard`` was applied to.
        param_ids: ``id`` of each parameter object the units hold now: the sharded ``DTensor``
            of a resharded unit, the unsharded ``nn.Parameter`` of a unit FSDP has all-gathered
            (FSDP2 reuses that object in every step).
        param_bytes: by parameter name, its bytes at its full (unsharded) size, in the dtype it
            has now (a unit FSDP has gathered under a ``MixedPrecisionPolicy`` holds its compute
            dtype's copy; ``MemCompiler`` keeps the largest seen, the sharded parameter's).
    """

    units: int
    param_ids: frozenset[int]
    param_bytes: tuple[tuple[str, int], ...] = ()

    @property
    def unsharded_bytes(self) -> int:
        """The bytes of every managed parameter at its full size (see ``param_bytes``)."""
        return sum(n for _, n in self.param_bytes)


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return None
    return FSDPModule


def _is_unit(m: torch.nn.Module, fsdp: type) -> bool:
    return isinstance(m, fsdp)


def sharded_params(model: torch.nn.Module | None) -> ShardedParams | None:
    """The parameters of ``model`` under a ``fully_shard`` unit (``None``: no unit). A
    parameter reachable from several units (a nested unit's, also under the root) counts once."""
    fsdp = _fsdp_module_type()
    if model is None or fsdp is None:
        return None
    units = [m for m in model.modules() if isinstance(m, fsdp)]
    if not units:
        return None
    named = {id(p): (n, p) for unit in units for n, p in unit.named_parameters()}
    # The same parameter under its full name: the model's own names (a unit's are relative).
    full = {id(p): n for n, p in model.named_parameters()}
    # A DTensor's shape is the global one: every rank counts the full parameter.
    by_name = {full.get(i, n): p.numel() * p.element_size() for i, (n, p) in named.items()}
    return ShardedParams(len(units), frozenset(named), tuple(sorted(by_name.items())))


class RankCheck:
    """``check_ranks=True``: before each ``fully_shard`` unit's forward, all ranks exchange
    (units run so far, index of the unit about to run) and raise
    :class:`~memcompile.errors.RankDivergenceError` on every rank when they differ (see the
    module docstring). Construct it on every rank at the same point (it creates a process
    group, a collective call); :meth:`remove` takes the hooks off.

    Args:
        model: the model; its units are its ``FSDPModule`` submodules, in module order.
        timeout: how long a rank waits for the others at a unit.
    """

    def __init__(
        self, model: torch.nn.Module, *, timeout: datetime.timedelta = RANK_CHECK_TIMEOUT
    ) -> None:
        import torch.distributed as dist

        fsdp = _fsdp_module_type()
        assert fsdp is not None, "RankCheck needs torch.distributed"
        self._dist = dist
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.timeout = timeout
        units = [(name or "<root>", m) for name, m in model.named_modules() if _is_unit(m, fsdp)]
        self.names = tuple(name for name, _ in units)
        self._index = {id(m): i for i, (_, m) in enumerate(units)}
        #: Unit forwards this rank has run (checked) since the check was installed.
        self.calls = 0
        hook = torch._dynamo.disable(self._before_unit)  # FSDP's hooks break the graph too
        self._handles = [m.register_forward_pre_hook(hook, prepend=True) for _, m in units]
        log.info("memcompile: checking %d fully_shard units across ranks", len(units))

    def _before_unit(self, module: torch.nn.Module, args: Any) -> None:
        dist = self._dist
        mine = torch.tensor([self.calls, self._index[id(module)]], dtype=torch.int64)
        seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        try:
            dist.all_gather(seen, mine, group=self.group)
        except RuntimeError as e:  # gloo's timeout: another rank never came to a unit
            name = self.names[int(mine[1])]
            raise RankDivergenceError(
                f"memcompile: rank {dist.get_rank()} waited {self.timeout} before fully_shard unit "
                f"{name!r} (unit call {self.calls}) for the other ranks, which ran no unit: the "
                "ranks took different paths through the model (an early exit, experts no token "
                f"chose), so FSDP's all-gathers cannot match ({e})",
                tuple(name if r == dist.get_rank() else "<none>" for r in range(len(seen))),
            ) from e
        self.calls += 1
        if any(not torch.equal(t, mine) for t in seen):
            units = tuple(self.names[int(t[1])] for t in seen)
            where = ", ".join(
                f"rank {r}: {u} (unit call {int(t[0])})"
                for r, (u, t) in enumerate(zip(units, seen, strict=True))
            )
            raise RankDivergenceError(
                f"memcompile: the ranks are about to run different fully_shard units ({where}): "
                "FSDP2 needs every rank to run the same units in the same order (their "
                "all-gathers must match); make the control flow agree across ranks (e.g. "
                "all-reduce the exit or routing decision) or keep such blocks out of FSDP units",
                units,
            )

    def remove(self) -> None:
        """Take the hooks off the units."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ShardedModel:
    """What one compiler knows of its model's FSDP2 units, gathered over its compiles, and what
    it says about them (once each).

    Attributes:
        sharded: the model's parameters FSDP2 manages, as of the latest compile that found any.
        rank_check: ``check_ranks=True`` on an FSDP2 model: the ranks compare units.
    """

    def __init__(self, *, check_ranks: bool) -> None:
        self._check_ranks = check_ranks
        self.sharded: ShardedParams | None = None
        self.rank_check: RankCheck | None = None
        # Ids of the managed parameters over all compiles: each unit's unsharded parameters
        # are in the module only while FSDP has all-gathered them.
        self._ids: set[int] = set()
        self._bytes: dict[str, int] = {}
        self._paths_warned = False

    def is_sharded(self, t: torch.Tensor) -> bool:
        """Whether FSDP2 manages ``t`` (a parameter memcompile must leave in place)."""
        return id(t) in self._ids

    @property
    def param_bytes(self) -> int:
        """The FSDP2-managed parameters' unsharded bytes, each at the largest size a compile saw
        (the sharded parameter's dtype, not a mixed-precision compute copy); 0: no FSDP2."""
        return sum(self._bytes.values())

    def note(
        self,
        model: torch.nn.Module | None,
        *,
        index: int,
        first_compile: bool,
        offload_params: bool | str,
        budget: int | None,
        peak_watched: bool,
        dynamic: str,
    ) -> None:
        """Find the parameters FSDP2 manages in ``model`` (compiling F{index}) and, at the first
        compile that sees them, say what memcompile leaves to FSDP (and start ``check_ranks``).
        ``dynamic``: why the model counts as dynamic (``""``: not seen to be)."""
        found = sharded_params(model)
        if found is None:
            if self._check_ranks and first_compile:
                warnings.warn(
                    "memcompile: check_ranks=True, but the model has no FSDP2 fully_shard units "
                    "(found at its first compile): there is nothing to check",
                    UserWarning,
                    stacklevel=3,
                )
            return
        first = self.sharded is None
        self.sharded = found
        self._ids.update(found.param_ids)
        for name, n in found.param_bytes:  # the sharded dtype's size, where a compile saw it
            self._bytes[name] = max(n, self._bytes.get(name, 0))
        if not first:
            return
        if self._check_ranks and model is not None:
            # Every rank compiles its first fragment at the same point of the first step.
            self.rank_check = RankCheck(model)
        self.warn_paths(dynamic)
        size = format_bytes(self.param_bytes)
        if offload_params is True:
            warnings.warn(
                f"memcompile: F{index}: the model's parameters ({size} unsharded, "
                f"{found.units} fully_shard units) are managed by FSDP2 and stay with it "
                "(offload_params=True moves none of them); FSDP2's "
                "offload_policy=CPUOffloadPolicy() keeps them on the host",
                MemoryBudgetWarning,
                stacklevel=3,
            )
        if budget is not None:
            warnings.warn(
                f"memcompile: the model is sharded by FSDP2 ({found.units} fully_shard units, "
                f"{size} of parameters unsharded): the parameters FSDP all-gathers, the "
                "gradients before their reduce-scatter and the collectives' buffers are "
                "allocated outside memcompile's graphs, and neither the plans nor the predicted "
                "peak count them, so the budget can be exceeded there"
                + (" (each step's measured peak is checked against it)" if peak_watched else ""),
                MemoryBudgetWarning,
                stacklevel=3,
            )

    def warn_paths(self, dynamic: str) -> None:
        """FSDP2 with control flow (another path recompiles a frame; one graph serves several
        experts): a rank that skips a unit skips its all-gather. Said once, unless checked."""
        if (
            self.sharded is None
            or self.rank_check is not None
            or self._paths_warned
            or not dynamic
            or "symbolic shapes" in dynamic
        ):
            return
        self._paths_warned = True
        warnings.warn(
            f"memcompile: the model is sharded by FSDP2 and takes different paths ({dynamic}"
            "): every rank must run the same fully_shard units in the same order, or FSDP's "
            "collectives hang or abort; check_ranks=True makes memcompile compare them before "
            "each unit and raise RankDivergenceError instead (one small collective per unit)",
            UserWarning,
            stacklevel=3,
        )
