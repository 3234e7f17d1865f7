"""The training iteration as the user's loop runs it: micro-batches, then the optimizer step.

The budget is the device peak of the whole iteration, not of one forward and backward::

    micro-batch 1        the step the fragments were planned for, + the optimizer's state
    micro-batches 2..k   the same, + the gradients accumulated so far (resident throughout)
    optimizer step       parameters + buffers + gradients + state + the step's transient
                         (analysis/optimizer_cost.py)

Nothing in the loop changes: ``torch.optim``'s global step hooks say which optimizers step the
compiled model's parameters, what their state holds and when an iteration ends (the steps begun
since the last optimizer step are its micro-batches); a step that begins with gradients present
is a later micro-batch (``StepMonitor``'s ``present_grads``). At each optimizer step of this
model the watch tells its listener (the compiler), which checks the iteration against the budget
and re-plans the fragments once the optimizer's state and the gradients are known.

Offloaded state (``offload_optimizer``) lives in the host tier, or the disk tier's file mappings
(``offload_to="disk"``), and the step updates it in place there::

    pre-hook    Adam/AdamW, first step: their state made in the tier (torch's values)
    step        torch.optim, unchanged
    post-hook   state made on the device -> the tier; disk state's pages written back, dropped
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim.optimizer import (
    _get_scalar_dtype,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memcompile.analysis.optimizer_cost import (
    OptimizerCost,
    cost_key,
    on_device,
    plain,
    price_optimizer,
)
from memcompile.errors import format_bytes
from memcompile.runtime import placement
from memcompile.runtime.store import (
    Tier,
    TieredStore,
    can_host_place,
    host_empty,
    host_tier_copy,
    is_disk_placed,
    is_host_placed,
    is_tier_address,
    release_pages,
)
from memcompile.step.monitor import StepMonitor

__all__ = ["DISK_MIN_BYTES", "IterationWatch", "grad_bytes"]

# Every live IterationWatch, in creation order. torch.optim's global step hooks are registered
# once for all of them and never removed: removing a dead watch's hook from a finalizer could run
# inside torch.optim's loop over those hooks (a collection during a step), which then raises
# "OrderedDict mutated during iteration".
_watches: weakref.WeakValueDictionary[int, IterationWatch] = weakref.WeakValueDictionary()
_next_watch = 0
_hooked = False


def _each_watch() -> list[IterationWatch]:
    return list(_watches.values())  # a dict: in creation order


def _pre_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    for watch in _each_watch():
        watch._before(optimizer)


def _post_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    for watch in _each_watch():
        watch._after(optimizer)


def _watch(watch: IterationWatch) -> None:
    global _next_watch, _hooked
    _watches[_next_watch] = watch
    _next_watch += 1
    if not _hooked:
        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _hooked = True


log = logging.getLogger(__name__)

#: Optimizer state smaller than a page (Adam's ``step`` counters) stays in the host tier with
#: ``offload_to="disk"``: a file per scalar would cost more than it saves.
DISK_MIN_BYTES = 4096


def grad_bytes(params: Collection[torch.Tensor], device: torch.device) -> dict[int, int]:
    """Parameter storage address -> bytes of its ``.grad`` on the compute ``device``, for the
    parameters that have one (a host-tier gradient is not device memory)."""
    out: dict[int, int] = {}
    plain_types = (torch.Tensor, torch.nn.Parameter)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if type(g) is torch.Tensor and type(p) in plain_types:
            # The common case, without the general checks (every parameter, every step).
            if g.device.type != device.type:
                continue
            storage = g.untyped_storage()
            if device.type == "cpu" and is_tier_address(storage.data_ptr()):
                continue
            out[p.untyped_storage().data_ptr()] = storage.nbytes()
            continue
        if not on_device(g, device):
            continue
        local, grad = plain(p), plain(g)
        if local is not None and grad is not None:
            out[local.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return out


class IterationWatch:
    """The optimizers that step one compiled model, seen through ``torch.optim``'s step hooks.

    Args:
        params: the compiled model's parameters (the model's, when known, else the fragments'
            parameter inputs).
        device: the model's compute device.
        offload: the ``offload_optimizer`` option.
        store: the model's tiers; ``tier``: where offloaded state goes (``offload_to``). The
            disk tier's state is a file mapping the step updates in place; after each step its
            pages are written back and dropped (tensors under :data:`DISK_MIN_BYTES` go to the
            host tier).
        first_step_over: ``offload_optimizer="auto"``: whether a first step that makes this
            many bytes of state on the device, with this transient, would pass the budget.
        monitor: the model's steps (the micro-batches are counted by the steps it began).
        on_step: called after each step of an optimizer of this model.
        paused: whether the optimizers' steps are not watched now (:attr:`paused`).

    Attributes:
        optimizers: each live optimizer of this model and its last step's cost.
        micro_batches: steps begun between the last two optimizer steps (1 until accumulation
            is seen).
        iterations: iterations ended so far (the first optimizer step of this model after its
            steps), never reset.
        grads_at_step: device bytes of the model's gradients when its last optimizer step began.
        grads_at_start: the most device bytes of gradients a step of the last iteration began
            with (a later micro-batch; ``zero_grad(set_to_none=False)``): what plans count as
            resident beside the state.
    """

    def __init__(
        self,
        params: Callable[[], Collection[torch.Tensor]],
        device: Callable[[], torch.device],
        monitor: StepMonitor,
        on_step: Callable[[OptimizerCost], None],
        *,
        offload: bool | str = "auto",
        store: TieredStore | None = None,
        tier: Tier = "host",
        first_step_over: Callable[[int, int], bool] | None = None,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        self._paused = paused
        self._offload_option = offload
        self._first_step_over = first_step_over
        self._store = store
        self._tier: Tier = tier if store is not None else "host"
        #: The optimizers' state goes to the host (or disk) tier after each of their steps
        #: (``offload_optimizer=True``, or ``"auto"`` once the budget needed it).
        self.offloading = offload is True
        self._params = params
        self._device = device
        self._monitor = monitor
        self._on_step = on_step
        self.optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerCost] = (
            weakref.WeakKeyDictionary()
        )
        self.micro_batches = 1
        #: iterations ended (their first optimizer step of this model), since creation
        self.iterations = 0
        self.grads_at_step = 0
        self.grads_at_start = 0
        self._grads_seen = 0
        self._started_at_step = 0
        # The optimizers of this model that stepped since the iteration's first optimizer step.
        self._stepped_now: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        # Optimizer -> (cost_key, its price): the price while nothing it depends on changed.
        self._prices: weakref.WeakKeyDictionary[
            torch.optim.Optimizer, tuple[tuple[object, ...], OptimizerCost]
        ] = weakref.WeakKeyDictionary()
        # Optimizer -> (its parameter count when decided, the ids of this model's among them).
        self._mine: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, frozenset[int]]] = (
            weakref.WeakKeyDictionary()
        )
        _watch(self)

    def reset(self, monitor: StepMonitor | None = None) -> None:
        """Forget the optimizers seen (the fragments are gone); ``monitor``: the steps to count
        from now on (the compiler started over: ``step/fraction.py``). It keeps its hooks:
        this may run inside one, while ``torch.optim`` iterates over them."""
        if monitor is not None:
            self._monitor = monitor
        self.optimizers.clear()
        self._mine.clear()
        self._prices.clear()
        self.micro_batches = 1
        self.grads_at_step = 0
        self.grads_at_start = 0
        self._grads_seen = 0
        self._started_at_step = self._monitor.steps_started
        self._stepped_now = weakref.WeakSet()

    @property
    def begins_iteration(self) -> bool:
        """The step just begun is an iteration's first: an optimizer of the model has stepped,
        and this is the first step begun since its last step."""
        return bool(self.optimizers) and self._monitor.steps_started == self._started_at_step + 1

    @property
    def iteration_done(self) -> bool:
        """Every live optimizer of this model stepped since the iteration's steps ended."""
        return all(o in self._stepped_now for o in list(self.optimizers))

    def step_began(self, grads: int) -> None:
        """A step of the model began with ``grads`` device bytes of gradients present."""
        self._grads_seen = max(self._grads_seen, grads)
        self.grads_at_start = max(self.grads_at_start, grads)

    @property
    def state_bytes(self) -> int:
        """Device bytes of the state of every live optimizer of this model."""
        return sum(c.state_bytes for c in list(self.optimizers.values()))

    @property
    def transient(self) -> int:
        """The largest transient of one optimizer step of this model (they step in turn)."""
        return max((c.transient for c in list(self.optimizers.values())), default=0)

    def offload_state(self) -> int:
        """Move the state of this model's optimizers into the host tier (the disk tier with
        ``offload_to="disk"``), now and after each of their steps from then on (state made
        anew: a first step, ``load_state_dict``). Returns the device bytes it freed (0: none
        there, or a CUDA model, whose host-placed parameters' state is host memory already).

        Raises:
            OffloadError: a tier failed; each state entry is whole, moved or still on the
                device (the step that made it is done)."""
        self.offloading = True
        freed = 0
        for optimizer in list(self.optimizers):
            freed += self._offload(optimizer, self._stepped(optimizer))
            self.optimizers[optimizer] = self._price(optimizer, self._stepped(optimizer))
        if freed:
            log.info(
                "memcompile: optimizer state (%s) moved to the %s tier",
                format_bytes(freed),
                self._tier,
            )
        return freed

    def _offload(self, optimizer: torch.optim.Optimizer, mine: frozenset[int]) -> int:
        device = self._device()
        if device.type != "cpu":
            return 0
        freed = 0
        for p, state in optimizer.state.items():
            if id(p) not in mine:
                continue
            for key, t in list(state.items()):
                if not isinstance(t, torch.Tensor):
                    continue
                if is_disk_placed(t):
                    release_pages(t)  # the step updated it in place: back to its file
                elif on_device(t, device) and can_host_place(t):
                    # One entry at a time: a tier failing (OffloadError) leaves each entry
                    # whole, moved or not.
                    state[key] = self._put(t)
                    freed += t.untyped_storage().nbytes()
        if freed:
            placement.moved()
        return freed

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.untyped_storage().nbytes()
        if self._tier == "disk" and self._store is not None and nbytes >= DISK_MIN_BYTES:
            return self._store.put(t, "disk")
        return t if is_host_placed(t) else host_tier_copy(t)

    @property
    def paused(self) -> bool:
        """The model's calls run in the direct mode (no budget, the step seen:
        backends/unplanned.py): the optimizers' steps are not watched either."""
        return self._paused()

    def _stepped(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """Ids of the parameters of this model ``optimizer`` steps (empty: another model's)."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        found = self._mine.get(optimizer)
        if found is None or found[0] != count:  # new, or a parameter group was added
            ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
            model = {id(p) for p in self._params()}
            found = (count, frozenset(i for i in ids if i in model))
            self._mine[optimizer] = found
        return found[1]

    def _before(self, optimizer: torch.optim.Optimizer) -> None:
        if self.paused:
            return
        mine = self._stepped(optimizer)
        if not mine:
            return
        device = self._device()
        if self._offload_option is True:
            _check_offloadable(optimizer, device, mine)
        self.grads_at_step = sum(grad_bytes(list(self._params()), device).values())
        if device.type != "cpu":
            return
        if (
            not self.offloading
            and self._offload_option == "auto"
            and self._first_step_over
            # Else every parameter the optimizer steps has its state already (a loop's steps
            # after the first: not walked again).
            and len(optimizer.state) < self._mine[optimizer][0]
        ):
            # "auto" decides before a first step that would make its state on the device:
            # known for Adam/AdamW, whose state torch makes lazily from the parameters alone.
            lazy = _lazy_adam_state(optimizer, mine)
            new = sum(len(keys) * p.untyped_storage().nbytes() for p, keys in lazy)
            if new and self._first_step_over(new, self._price(optimizer, mine).transient):
                log.info(
                    "memcompile: %s's first step would make %s of state on the device, over the "
                    "budget: it is made in the %s tier (offload_optimizer='auto')",
                    type(optimizer).__name__,
                    format_bytes(new),
                    self._tier,
                )
                self.offloading = True
        if self.offloading:
            self._make_state_in_tier(optimizer, mine)

    def _price(self, optimizer: torch.optim.Optimizer, mine: frozenset[int]) -> OptimizerCost:
        """:func:`price_optimizer`, kept while its :func:`cost_key` holds: a loop's steps after
        the first find the same state in the same places, and pricing walks every state
        tensor (4 ms a step for Adam over the zoo MoE's 170 parameters on this CPU)."""
        device = self._device()
        key = cost_key(optimizer, mine, device)
        known = self._prices.get(optimizer)
        if known is not None and known[0] == key:
            return known[1]
        cost = price_optimizer(optimizer, mine, device)
        self._prices[optimizer] = (key, cost)
        return cost

    def _make_state_in_tier(self, optimizer: torch.optim.Optimizer, mine: frozenset[int]) -> None:
        """Adam's and AdamW's state, made in the tier before their first step does it on the
        device (its peak would hold all of it): the same values torch's lazy initialization
        gives, so the step finds it and uses it. Other optimizers' state moves after their
        step."""
        made = 0
        for p, keys in _lazy_adam_state(optimizer, mine):
            # torch.optim.adam's _init_group, with the moments in the tier; a parameter's
            # state is set whole or not at all (a tier failing leaves it to torch).
            new = {"step": torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")}
            new.update((key, self._put(_host_zeros(p))) for key in keys)
            optimizer.state[p].update(new)
            made += len(keys) * p.untyped_storage().nbytes()
        if made:
            placement.moved()
            log.info(
                "memcompile: %s state (%s) made in the %s tier before its first step",
                type(optimizer).__name__,
                format_bytes(made),
                self._tier,
            )

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.load_state_dict`` made its state anew: into the tier now, if state goes
        there (``offloading``)."""
        if self.paused or not self.offloading:
            return
        mine = self._stepped(optimizer)
        if not mine:
            return
        freed = self._offload(optimizer, mine)
        self.optimizers[optimizer] = self._price(optimizer, mine)
        if freed:
            log.info(
                "memcompile: %s's loaded state (%s) moved to the %s tier",
                type(optimizer).__name__,
                format_bytes(freed),
                self._tier,
            )

    def _after(self, optimizer: torch.optim.Optimizer) -> None:
        if self.paused:
            return
        mine = self._stepped(optimizer)
        if not mine:
            return
        if self.offloading:
            self._offload(optimizer, mine)
        cost = self._price(optimizer, mine)
        new = optimizer not in self.optimizers
        self.optimizers[optimizer] = cost
        if new:
            # State loaded from a checkpoint (``load_state_dict``: torch makes it anew, where
            # the parameters are) goes back to the tier at once, not after the next step: the
            # iteration before it would run with the whole state on the device.
            watch = weakref.ref(self)
            optimizer.register_load_state_dict_post_hook(
                lambda opt: None if (w := watch()) is None else w._loaded(opt)
            )
        started = self._monitor.steps_started
        if started > self._started_at_step:  # the first optimizer of this iteration
            self.iterations += 1
            self.micro_batches = started - self._started_at_step
            self._started_at_step = started
            self.grads_at_start, self._grads_seen = self._grads_seen, 0
            self._stepped_now = weakref.WeakSet()
        self._stepped_now.add(optimizer)
        if new:
            log.info(
                "memcompile: %s steps the model: %s, its step's transient %s%s; %d micro-batch(es) "
                "an iteration",
                cost.kind,
                cost.describe(),
                format_bytes(cost.transient),
                "" if cost.exact else " (estimated)",
                self.micro_batches,
            )
        self._on_step(cost)


def _check_offloadable(
    optimizer: torch.optim.Optimizer, device: torch.device, mine: frozenset[int]
) -> None:
    """``offload_optimizer=True`` before ``optimizer``'s step: refuse, with the reason, what it
    cannot do (the step has run nothing yet)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"memcompile option offload_optimizer=True: {type(optimizer).__name__}.step needs a "
            "closure that evaluates the model again (several forwards in one step), which "
            "memcompile does not plan for; use offload_optimizer='auto' or False with it"
        )
    if device.type == "cuda":
        on_gpu = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if id(p) in mine and p.device.type == "cuda"
        ]
        if on_gpu:
            raise ValueError(
                "memcompile option offload_optimizer=True on CUDA steps the optimizer on the "
                "host, ZeRO-Offload's way: its parameters must be there too "
                f"(offload_params=True); {len(on_gpu)} of them are on {device}"
            )


def _host_zeros(p: torch.Tensor) -> torch.Tensor:
    """``zeros_like(p, memory_format=torch.preserve_format)``, in the host tier where ``p`` is
    dense and contiguous (no device memory at all), else made on the device."""
    if p.is_contiguous() and p.layout == torch.strided:
        return host_empty(tuple(p.shape), p.dtype).zero_()
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _lazy_adam_state(
    optimizer: torch.optim.Optimizer, mine: frozenset[int]
) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
    """The parameters of this model whose state an ``Adam``/``AdamW`` step is about to make
    (a gradient, no state yet), each with the keys of its moments; empty for other optimizers
    and for fused, capturable or differentiable groups (their step counter lives on the device:
    left to torch)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return []
    out = []
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable") or group.get("differentiable"):
            continue
        keys = ("exp_avg", "exp_avg_sq") + ("max_exp_avg_sq",) * bool(group["amsgrad"])
        for p in group["params"]:
            if id(p) not in mine or p.grad is None or p.grad.is_sparse:
                continue
            if not can_host_place(p):  # a DTensor (FSDP2): its state is a DTensor too
                continue
            if len(optimizer.state.get(p, ())) == 0:
                out.append((p, keys))
    return out
