"""What ``MemCompiler`` hands each fragment's build: the narrow view of the compiler that a
build and its call wrappers may use (``fragment_build.py``, ``call_wrapper.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memcompile.backends.sharded import ShardedModel
from memcompile.backends.unplanned import UnplannedWatch
from memcompile.dynamic.prefetch import Prefetcher
from memcompile.pipeline.env import FragmentEnv
from memcompile.runtime.store import TieredStore
from memcompile.step.budget import StepBudget
from memcompile.step.monitor import StepMonitor

__all__ = ["BuildEnv"]


@dataclass(frozen=True)
class BuildEnv:
    """What ``MemCompiler`` hands each fragment's build.

    Attributes:
        pipeline: what the pipeline is given (config, cost model, resident set, store key).
        store: the tiered store (host-placed gradients' copies are waited for).
        monitor: told of every call of the fragment's graphs (but in the direct mode).
        unplanned: whether calls run in the direct mode (``backends/unplanned.py``).
        budget: the step's budget (the pilot's reserve per fragment; a call over its plan).
        prefetcher: the pilot (``None``: ``pilot="off"``).
        fsdp: the model's FSDP2 units (their parameters stay FSDP's).
        note_dynamic: tells the compiler the model is dynamic, and why.
    """

    pipeline: FragmentEnv
    store: TieredStore
    monitor: StepMonitor
    unplanned: UnplannedWatch
    budget: StepBudget
    prefetcher: Prefetcher | None
    fsdp: ShardedModel
    note_dynamic: Callable[[str], None]
