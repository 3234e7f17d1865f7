"""The pipeline's internal switches: which rewrites a plan may use.

Not user options (``MemConfig`` holds those): every switch is on in the product, and tests and
benchmarks turn one off to compare against the ops it replaces::

    from memcompile.pipeline import features

    with features.patch(row_tiling=False):      # a benchmark run without row tiling
        ...
    monkeypatch.setattr(features, "FEATURES", features.FEATURES.replace(row_tiling=False))
    features.current().row_tiling               # what the pipeline reads, at each compile

One frozen object, :data:`FEATURES`, read where a stage is decided (never copied at import).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FEATURES", "Features", "current", "patch"]


@dataclass(frozen=True)
class Features:
    """Which rewrites planned fragments may use.

    Attributes:
        dropout_rewrite: when a budgeted plan uses the dropout rewrite (rewrites/dropout.py):
            ``"auto"`` when the plan without it misses the budget and the one with it fits or
            peaks lower, first with saved masks, then (CPU) with masks replayed from the
            generator's state; ``"always"`` (saved masks), ``"replay"`` and ``"never"`` are for
            tests and benchmarks ("auto" is the contract).
        loss_head_in_place: planned fragments compute cross-entropy heads in place
            (rewrites/losshead.py).
        elementwise_in_place: planned fragments compute dying gradients' elementwise ops in
            place (rewrites/inplace.py), with the eager inner compiler (Inductor reuses such
            buffers itself).
        built_in_place: a plan over its budget writes elementwise results into values of the
            built graphs' own that die there (rewrites/inplace.py, ``built=True``) where that
            lowers the exact profile.
        row_tiling: a plan still over its budget makes elementwise results a block of rows at
            a time from operands that then exist a block at a time (rewrites/tiling/) where that
            lowers the exact profile and each distinct chain probes bit-identical.
        rematerialize: a plan over its budget makes backward values again for their late
            readers where that lowers the backward's exact profile (rewrites/rematerialize.py).
        fixed_peak: a plan over its budget whose predicted peak holds no saved or recomputed
            value (``JointModel.decided_at_peak``: only the backward's own values, incoming
            gradients, held outputs), where the late rewrites left it there, gets no other
            saved sets searched (recompute only, swap only, the floors): none lowers that
            moment; ``False`` searches them anyway (tests and benchmarks that compare).
        linear_ce_blocks: a fragment no plan fits makes its cross-entropy heads by blocks, the
            logits never whole (rewrites/linearce.py), where the blocks probe bit-identical; it
            costs two more matmuls of the head's size, so only then.
        pilot_in_graph: the pilot predicts and prefetches inside each forward graph
            (rewrites/pilot_prefetch.py); ``False`` leaves the prediction at the fragment's
            tail.
        fast_no: a budget below every plan's lower bound raises ``MemoryBudgetError`` with
            that bound before any search (pipeline/fragment.py); ``False`` searches anyway, so
            the error's ``min_feasible`` is the smallest peak found (tests and benchmarks
            that need that floor).
        regional: the ``torch.nn`` modules called from a model frame Dynamo runs eagerly are
            compiled as fragments of their own (backends/regions.py); ``False`` leaves them
            eager (tests and benchmarks that compare).
        inner_measure: with ``inner="inductor"``, a fragment's graphs are compiled and run
            once at compile time, and its predictions carry what Inductor's code peaks beside
            the graphs' profile; a plan that puts over the budget is planned again
            (backends/inner_peak.py); ``False``: the eager profile alone (tests that compare).
        direct_unplanned: without a budget, once the steps since the last compile are seen,
            regions call their modules directly and the fragments' calls and optimizer steps
            are not watched (backends/unplanned.py); ``False`` watches every step (tests that
            count calls or steps, benchmarks that compare).
        plan_cache: what a fragment's search decided is kept in the user's cache directory
            and replayed by the next process instead of searching (pipeline/plan_cache.py);
            off where the environment sets ``MEMCOMPILE_PLAN_CACHE=0``.
    """

    dropout_rewrite: Literal["auto", "always", "replay", "never"] = "auto"
    loss_head_in_place: bool = True
    elementwise_in_place: bool = True
    built_in_place: bool = True
    row_tiling: bool = True
    rematerialize: bool = True
    fixed_peak: bool = True
    linear_ce_blocks: bool = True
    pilot_in_graph: bool = True
    fast_no: bool = True
    regional: bool = True
    inner_measure: bool = True
    direct_unplanned: bool = True
    plan_cache: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("MEMCOMPILE_PLAN_CACHE", "1") != "0"
    )

    def replace(self, **changes: Any) -> Features:
        """These switches with ``changes`` (``TypeError`` for an unknown name)."""
        return dataclasses.replace(self, **changes)


#: The switches in force. Tests and benchmarks replace the whole object (``monkeypatch``, or
#: :func:`patch`); the pipeline reads it through :func:`current` at each compile.
FEATURES = Features()


def current() -> Features:
    """The switches in force (read at each compile)."""
    return FEATURES


@contextlib.contextmanager
def patch(**changes: Any) -> Iterator[Features]:
    """Run the ``with`` block with some switches changed (tests and benchmarks); restored on
    exit, also on an error. Unknown names raise ``TypeError`` naming them."""
    global FEATURES
    old = FEATURES
    FEATURES = old.replace(**changes)
    try:
        yield FEATURES
    finally:
        FEATURES = old
