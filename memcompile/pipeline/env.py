"""What the pipeline is given about one fragment (:class:`FragmentSpec`) and by the compiler
(:class:`FragmentEnv`): everything a plan depends on, handed down, never looked up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.config import MemConfig
from memcompile.step.resident import ResidentSet

__all__ = ["FragmentEnv", "FragmentSpec"]


@dataclass(frozen=True)
class FragmentSpec:
    """One fragment as the pipeline plans it.

    Attributes:
        index: the fragment's index (``F{index}`` in logs and pass contexts).
        example_inputs: its inputs, one per placeholder (an input several ops read comes once
            per read: rewrites/input_uses.py).
        alias_sources: position of each input that is an alias of another input -> that
            input's position. An alias of a host-placed parameter is fetched like it; only the
            parameter itself moves to the host tier.
        device: the fragment's device, read before any of its parameters moved to the host.
        dropped_outputs: positions among the forward's outputs of user outputs a step showed
            the caller drops before the backward: planned and profiled as not held.
        released_tangents: names of incoming gradients a step showed no one else holds
            through the backward: planned and profiled as freed after their last reader.
        replan_resident: a re-plan (planning/replan.py): what the rest of the step holds at
            this fragment's worst call; ``None``: planned as a new fragment.
        replan_saved_cap: a re-plan's cap on the bytes the plan holds from forward to
            backward; ``None``: no cap.
        replan_start: tensors the previous plan of this graph kept (a re-plan for dropped
            outputs): the search starts from them too, so the new plan is no worse.
        host_replan: re-planned by the round that put the step's parameters on the host:
            planned as a new fragment, but the step's check says whether the step fits.
        code: where its frame begins, ``function (file:line)``: fragments compiled from one
            code (recompiles for new shapes) replace each other in a step.
        inner_excess: bytes by which the inner compiler's code was measured to peak above
            the graphs' profile of an earlier plan of this fragment that it put over the
            budget (Inductor: ``backends/inner_peak.py``): planned as if that much more were
            resident, as the prefetch reserve is (``plan.resident_bytes`` includes it).
        inner: the inner compiler its graphs run on (``inner="auto"`` resolved for its
            device): the rewrites that rely on eager's kernels and order apply only to
            ``"eager"``.
    """

    index: int
    example_inputs: tuple[Any, ...]
    alias_sources: Mapping[int, int]
    device: torch.device | None
    dropped_outputs: frozenset[int] = frozenset()
    released_tangents: frozenset[str] = frozenset()
    replan_resident: int | None = None
    replan_saved_cap: int | None = None
    replan_start: tuple[str, ...] = ()
    host_replan: bool = False
    code: str = ""
    inner_excess: int = 0
    inner: Literal["eager", "inductor"] = "eager"

    @property
    def name(self) -> str:
        return f"F{self.index}"

    def with_aliases(self, positions: Sequence[int]) -> list[int]:
        """``positions`` and the positions of the aliases of those inputs."""
        chosen = set(positions)
        return [*positions, *(j for j, i in self.alias_sources.items() if i in chosen)]

    def own_inputs(self, positions: Sequence[int]) -> tuple[int, ...]:
        """``positions`` without the aliases (the tensors that move to the host tier)."""
        return tuple(i for i in positions if i not in self.alias_sources)


@dataclass(frozen=True)
class FragmentEnv:
    """What the compiler hands each fragment's pipeline.

    Attributes:
        config: the options.
        cost_profile: the cost model for graphs whose tensors look like the values given.
        resident: the device's resident bytes and the host tier's accounting.
        store_key: the tiered store's key in the graphs' swap and fetch ops.
        auto_pilot: with ``pilot="auto"``, whether its plans should reserve for the cache now
            (the model was seen to be dynamic, and a prefetch can overlap compute there).
    """

    config: MemConfig
    cost_profile: Callable[[Sequence[Any]], DeviceProfile]
    resident: ResidentSet
    store_key: int
    auto_pilot: Callable[[], bool] = lambda: False

    @property
    def pilot_plans(self) -> bool:
        """Whether plans leave a prefetch reserve (and forward graphs a prediction op): an
        explicit pilot, or ``"auto"`` once ``auto_pilot()`` says so (its trial needs them; a
        static model reserves nothing)."""
        pilot = self.config.pilot
        return pilot in ("markov", "lightgbm") or (pilot == "auto" and self.auto_pilot())
