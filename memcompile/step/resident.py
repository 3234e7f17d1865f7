"""What a step holds on the device besides the graphs' own memory, and the host tier's share.

A fragment's plan gets ``budget - resident`` to spend; the step's replay starts from the same
figure::

    resident = its inputs (parameters, buffers, user inputs; not those on the host tier)
             + the model's parameters and buffers no fragment takes (eager frames read them)
             + other fragments' parameters, and what the other training fragments save
             + the optimizers' state, and the gradients a micro-batch begins with
             + (CUDA) what was on the device at the first plan and is not memcompile's

Parameters moved to the host tier (``offload_params``) leave it: :meth:`ResidentSet.move_to_host`
places one and forgets its device storage, so records made before the move do not count it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from memcompile.config import MemConfig
from memcompile.errors import format_bytes
from memcompile.records import FragmentRecord
from memcompile.runtime import placement
from memcompile.runtime.measure import storage_sizes
from memcompile.runtime.store import can_host_place, place_on_host

__all__ = ["Planned", "ResidentSet"]

log = logging.getLogger(__name__)


class Planned(Protocol):
    """What :meth:`ResidentSet.resident_bytes` reads of the fragment being planned
    (``pipeline/env.py``'s ``FragmentSpec``)."""

    @property
    def index(self) -> int: ...

    @property
    def example_inputs(self) -> Sequence[Any]: ...

    @property
    def device(self) -> torch.device | None: ...

    @property
    def replan_resident(self) -> int | None: ...

    @property
    def code(self) -> str: ...

    @property
    def inner_excess(self) -> int: ...


class ResidentSet:
    """The device's resident bytes and the host tier's accounting for one compiler.

    Args:
        config: the compiler's options.
        records: the compiled fragments (``MemCompiler.records``).
        model: the compiled module, when known.
        is_sharded: whether FSDP2 manages a tensor (FSDP's parameters stay where FSDP keeps
            them).
        loop: the training loop's share of every step (``step/iteration.py``): (the optimizers'
            state, the gradients a micro-batch may begin with), bytes.

    Attributes:
        host_param_bytes: bytes of parameters this compiler moved to the host tier.
        host_params_pinned: whether host-placed parameters are a CUDA model's pinned ones
            (runtime/pinned.py).
        device_other_bytes: CUDA: device bytes allocated at the first plan that belong to none
            of memcompile's inputs (other models, optimizer state, cuBLAS workspaces); ``None``
            until measured.
        host_step: ``offload_params="auto"`` decided for the whole step: a step that re-planning
            its saved sets did not fit put every fragment's parameters on the host (one
            fragment's alone leave the others' on the device, so none fit: the MoE at 0.6x its
            unplanned peak). Every plan from then on also tries the host tier, and takes it
            where that fits or peaks lower, as when its own plan does not fit.
        max_block_host_bytes: the largest host-placed parameter bytes of one block planned so
            far (the pilot's reserve).
        max_block_host_tensors: the most host-placed parameters of one block planned so far
            (each is one copy).
    """

    def __init__(
        self,
        config: MemConfig,
        records: Callable[[], list[FragmentRecord]],
        model: Callable[[], torch.nn.Module | None],
        is_sharded: Callable[[torch.Tensor], bool],
        loop: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self._config = config
        self._loop = loop
        self._records = records
        self._model = model
        self._is_sharded = is_sharded
        # Device storage addresses of parameters moved to the host tier (``move_to_host``).
        self._moved: set[int] = set()
        # step_storages' answer and what it was read from
        self._step_storages: tuple[tuple[object, ...], dict[int, int]] | None = None
        self.host_param_bytes = 0
        self.host_params_pinned = False
        self.device_other_bytes: int | None = None
        self.host_step = False
        self.max_block_host_bytes = 0
        self.max_block_host_tensors = 0

    def reset(self) -> None:
        """Forget the moved storages and the step-wide host decision (the fragments are gone;
        parameters stay where they are, and so do their counts)."""
        self._moved.clear()
        self.host_step = False

    # -- the host tier -----------------------------------------------------------------------
    def may_host(self, t: Any) -> bool:
        """Whether ``t`` is a parameter the host tier may take (``store.can_host_place``) and
        no one else manages (FSDP2's are FSDP's)."""
        return isinstance(t, torch.nn.Parameter) and can_host_place(t) and not self._is_sharded(t)

    def move_to_host(self, t: torch.Tensor) -> int:
        """:func:`place_on_host` for ``t``, and forget its device storage: records made before
        the move (a frame compiled again since) would count it as resident."""
        address = t.untyped_storage().data_ptr()
        freed = place_on_host(t)
        if freed:
            self._moved.add(address)
        return freed

    def note_fetched(self, inputs: Sequence[Any], fetched: Sequence[int]) -> None:
        """A fragment with ``inputs`` fetches those at ``fetched`` from the host tier: the
        largest block so far sizes the pilot's reserve."""
        own = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for i in fetched
            if isinstance(t := inputs[i], torch.Tensor)
        }
        self.max_block_host_bytes = max(self.max_block_host_bytes, sum(own.values()))
        self.max_block_host_tensors = max(self.max_block_host_tensors, len(own))

    def hostable_on_device(
        self, used: set[int], records: dict[int, FragmentRecord]
    ) -> dict[int, int]:
        """Storage address -> bytes of the parameters of the fragments ``used`` that the host
        tier may take and that are still on the device (once each: fragments share parameters,
        a tree's cells)."""
        moved = self._moved
        return {
            a: n
            for i in sorted(used)
            if i in records
            for a, n in records[i].static_storages
            if a in records[i].hostable and a not in moved
        }

    # -- resident bytes ----------------------------------------------------------------------
    def static_storages(self, r: FragmentRecord) -> Iterator[tuple[int, int]]:
        """``r``'s parameter and buffer storages at compile time, less those moved to the host
        tier since."""
        moved = self._moved
        return ((a, n) for a, n in r.static_storages if a not in moved)

    def step_storages(self) -> dict[int, int]:
        """Storage address -> bytes of what every step holds: the parameters and buffers of
        every block that ran and of the compiled module (less those on the host tier). Kept
        while the records, their blocks, the moves and memcompile's placements are the same
        (the optimizer step asks at every step; walking the model costs milliseconds)."""
        records = self._records()
        key = (
            tuple((id(r), len(r.blocks)) for r in records),
            len(self._moved),
            id(self._model()),
            placement.epoch(),
        )
        if self._step_storages is not None and self._step_storages[0] == key:
            return dict(self._step_storages[1])
        static = self._walk_step_storages(records)
        self._step_storages = (key, static)
        return dict(static)

    def _walk_step_storages(self, records: list[FragmentRecord]) -> dict[int, int]:
        static: dict[int, int] = {}
        moved = self._moved
        for r in records:
            static.update(self.static_storages(r))
            for storages in list(r.blocks.values()):
                static.update((a, n) for a, n in storages.items() if a not in moved)
        static.update(storage_sizes(self.model_tensors()))
        return static

    def model_tensors(self) -> tuple[torch.Tensor, ...]:
        """The compiled model's parameters and buffers, when the model is known: resident
        whether or not a fragment takes them (eager frames read some)."""
        model = self._model()
        return (*model.parameters(), *model.buffers()) if model is not None else ()

    def untaken_bytes(self, inputs: Sequence[Any]) -> int:
        """Bytes of the model's parameters and buffers that neither a fragment with ``inputs``
        nor a recorded fragment takes as an input (read by eager frames, or by fragments not
        compiled yet)."""
        taken = set(storage_sizes(t for t in inputs if isinstance(t, torch.Tensor)))
        for r in self._records():
            taken.update(address for address, _ in self.static_storages(r))
        model = storage_sizes(self._untaken_resident(set(), False))
        return sum(size for address, size in model.items() if address not in taken)

    def _untaken_resident(self, hosted: set[int], hosting: bool) -> list[torch.Tensor]:
        """The model's parameters and buffers a plan counts as resident, but those with ids in
        ``hosted``: with ``offload_params=True``, or when the plan moves parameters to the host
        (``hosting``), not the parameters later fragments will move too."""
        assume = self._config.offload_params is True or hosting
        return [
            t
            for t in self.model_tensors()
            if id(t) not in hosted and not (assume and self.may_host(t))
        ]

    def resident_bytes(self, fragment: Planned, *, host: Sequence[int] = ()) -> int:
        """What counts against the budget besides ``fragment``'s own graphs: its inputs
        (parameters, buffers, user inputs; not those at positions ``host``, or already in the
        host tier), other fragments' parameters, and (an upper bound, for multi-fragment models)
        what the other training fragments save. Recompiles of the same frame (new shapes)
        replace each other in a step and are not counted.

        A re-plan (``fragment.replan_resident``) takes the step prediction's figure instead,
        less the inputs at ``host`` that would leave the device now. Either way the bytes its
        inner compiler's code was measured to need beyond an earlier plan
        (``fragment.inner_excess``) count as resident too."""
        inputs, replan_resident = fragment.example_inputs, fragment.replan_resident
        skip = set(host)
        if replan_resident is not None:
            moved = storage_sizes(inputs[i] for i in skip)
            return max(0, replan_resident - sum(moved.values())) + fragment.inner_excess
        storages = storage_sizes(t for i, t in enumerate(inputs) if i not in skip)
        # The model's parameters no fragment takes (read by eager frames, or by fragments not
        # compiled yet) count too; but for those the later fragments will move to the host
        # tier as this one does (the step's check re-plans if they do not).
        hosted = {id(t) for i, t in enumerate(inputs) if i in skip}
        storages.update(storage_sizes(self._untaken_resident(hosted, bool(skip))))
        others = 0
        for r in self._others(fragment):
            # A plan on the host tier for the whole step: the others' parameters move too (the
            # step's check re-plans if they do not).
            gone = r.hostable if skip and self.host_step else frozenset()
            storages.update((a, n) for a, n in self.static_storages(r) if a not in gone)
            if r.profile is not None and r.profile.training:
                others += r.profile.saved_bytes + r.profile.saved_input_bytes
        known = sum(storages.values())
        device_other = self._device_other(fragment.device, lambda: self._known_on_device(fragment))
        return known + others + sum(self._loop()) + device_other + fragment.inner_excess

    def _known_on_device(self, fragment: Planned) -> int:
        """What the tensors memcompile knows of hold on the device now, whatever a plan will
        move to the host: the fragment's inputs, the other fragments' parameters, the model's
        parameters and buffers (those in the host tier hold nothing here). Counting only what
        a plan leaves resident made a first plan on the host tier count the model's own
        parameters as someone else's memory, on top of themselves (GPT, 6 layers, d 1024 on an
        H200: 373.6 MB predicted too much, and plans that fit were refused)."""
        now = storage_sizes(t for t in fragment.example_inputs if isinstance(t, torch.Tensor))
        for r in self._others(fragment):
            now.update(self.static_storages(r))
        now.update(storage_sizes(self.model_tensors()))
        return sum(now.values())

    def _others(self, fragment: Planned) -> Iterator[FragmentRecord]:
        """The records of the step's other fragments, as :meth:`resident_bytes` counts them.

        Not ``fragment`` itself: a fragment compiled again keeps its index (its old record is
        there until the new one replaces it). Nor another compile of its frame: recompiles (new
        shapes) replace each other in a step. That skips the other pieces DDP's graph splitter
        cuts from one compile too: counted, their saved bytes (an upper bound) made the first
        step's pieces miss budgets the step fits once the step check re-plans them (zoo GPT
        small at 0.3x eager DDP's peak: two pieces warned). Recompiles of one code count as one
        frame too, also once a re-plan had Dynamo compile the frame anew (a new frame id)."""
        compile_id = torch._guards.CompileContext.current_compile_id()
        frame = str(compile_id).split("/")[0] if compile_id is not None else None
        for r in self._records():
            same_code = bool(fragment.code) and r.code == fragment.code
            if r.compile_id.split("/")[0] == frame or r.index == fragment.index or same_code:
                continue
            yield r

    def movable_bytes(self, fragment: Planned, *, host: Sequence[int] = ()) -> int:
        """Of :meth:`resident_bytes` (with the same ``host``), what the step's own re-planning
        may still take off the device once the whole step is known (planning/replan.py): what
        the other fragments save (an upper bound there), the parameters of other fragments
        that the host tier may take, and the loop's optimizer state and starting gradients
        where they may move. Not the parameters no fragment reads so far: those of fragments
        not compiled yet may move, but an eager frame's stay on the device, and which they are
        is not known yet. A plan that misses the budget by no more than this does so because of the
        rest of the step as it is counted now: the step decides, not the fragment. 0 for a
        re-plan (its resident is the step's prediction)."""
        if fragment.replan_resident is not None:
            return 0
        inputs = fragment.example_inputs
        own = set(storage_sizes(t for t in inputs if isinstance(t, torch.Tensor)))
        hostable = self._config.offload_params is not False
        movable: dict[int, int] = {}
        saved = 0
        for r in self._others(fragment):
            if hostable and not (host and self.host_step):  # (else not counted there)
                movable.update((a, n) for a, n in self.static_storages(r) if a in r.hostable)
            if r.profile is not None and r.profile.training:
                saved += r.profile.saved_bytes + r.profile.saved_input_bytes
        state, grads = self._loop()
        loop = (state if self._config.offload_optimizer is not False else 0) + (
            grads if hostable else 0
        )
        return sum(n for a, n in movable.items() if a not in own) + saved + loop

    def _device_other(self, device: torch.device | None, known: Callable[[], int]) -> int:
        # The budget is what max_memory_allocated sees, so on CUDA it covers device memory that
        # memcompile does not own: other tensors, optimizer state, cuBLAS workspaces (32 MiB per
        # handle on Hopper; the workspace probes have just created the one for this stream).
        # Measured once, at the first plan: later compiles would see this model's activations.
        if device is None or device.type != "cuda":
            return 0
        if self.device_other_bytes is None:
            _prime_backward_workspaces(device)
            self.device_other_bytes = max(0, torch.cuda.memory_allocated(device) - known())
            if self.device_other_bytes:
                log.info(
                    "memcompile: %s already allocated on %s besides the model's inputs; counted "
                    "against the budget",
                    format_bytes(self.device_other_bytes),
                    device,
                )
        return self.device_other_bytes


class _PrimeWorkspaces(torch.autograd.Function):
    # Its backward runs on autograd's device thread, whose cuBLAS handle is not the main
    # thread's: the matmuls there create that handle's cuBLAS and cuBLASLt workspaces (32 MiB +
    # 1 MiB on an H100, kept for the process's life) now rather than in the first step's backward
    # (a recomputed addmm with bias does it), so the memory measured at planning includes them.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        a = torch.ones(16, 16, device=grad.device)
        torch.addmm(a[0], a, a)  # cuBLASLt (gemm with a bias epilogue)
        torch.mm(a, a)  # cuBLAS
        return grad


def _prime_backward_workspaces(device: torch.device) -> None:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        x = torch.zeros(2, device=device, requires_grad=True)
        _PrimeWorkspaces.apply(x).sum().backward()
    torch.cuda.synchronize(device)
