"""Prefetch for dynamic networks: the pilot predicts the next blocks, their parameters are copied
to the device before the graphs ask.

Each call wrapper (``backends/call_wrapper.py``) calls the :class:`Prefetcher` around every
fragment call:

    before(...)   forward call of block b: name it, score the earlier predictions of it, let the
                  predictor observe it, trim the cache to the fragment's reserve (keeping b's
                  copies), count b's fetches (hit: served from the cache; miss: fetched on demand).
                  First backward call of a step: free every copy left (the optimizer step will
                  change the parameters), stop counting.
    in_graph()    inside the forward graph (``memcompile::pilot_prefetch``, placed by
                  rewrites/pilot_prefetch.py where the copy overlaps the rest of the graph, after
                  the values the predictor reads): show the predictor those values (a router's
                  counts), predict the next ``prefetch_depth`` blocks; free the copies of
                  blocks no longer predicted (a misprediction; the running block's own copies,
                  which its graph may not have fetched yet, stay); copy the host-placed
                  parameters of the predicted blocks into the cache, nearest first, while they
                  fit the running fragment's reserve (its plan left that much beside its peak),
                  except the running block's own (a prediction that it runs again: its graph
                  would take the copy now; the tail copies them).
                  Predictions from a block that starts a step on are kept for the optimizer
                  step (it comes in between and changes the parameters).
    after()       tail of a forward call (the only hook before the next fragment's guards,
                  research/04 §Q1). After ``in_graph`` ran: no second prediction; free what
                  the prediction does not name (the block's unfetched copies) and copy what did
                  not fit the fragment's reserve while it fit the largest. Else (a graph built
                  without the op: its observed values on a CUDA device, or the compiler's
                  ``pilot_in_graph`` feature off) the same work as ``in_graph``, here, with the
                  call's outputs.
    optimizer step (a global ``torch.optim`` step post-hook, only for an optimizer that steps
                  host-placed parameters the prefetcher has seen): the parameters are final
                  now; copy those of the first prediction kept at the last forward call's
                  tail (the next step's first block: its fragment's reserve holds them, so the
                  trim before its call keeps them). A forward that starts elsewhere wastes them.

**Waste control.** Each copy is tagged ``source@j`` (the prediction's source, ``"rule"``,
``"lightgbm"``, ``"markov"`` or another predictor's, and ``j`` blocks ahead; ``source@step`` for
the optimizer-step copy) and the cache counts its bytes used and wasted per tag; a copy that a
later prediction keeps is re-tagged with it (a 2-ahead copy that the next 1-ahead prediction
names counts as 1-ahead: the hedge's own worth is what it alone kept). A prediction
more than one block ahead is a hedge (on the CPU the copies are synchronous, so the next block's
prediction alone decides hits; 2 ahead covers a wrong 1-ahead, e.g. an expert that got no tokens,
and gives a GPU copy time to overlap). Such a tag is *muted* while, over the last
``WASTE_WINDOW`` steps, more than ``MAX_WASTE`` of its settled bytes were wasted: its predictions
are not copied, except every ``PROBE_EVERY``-th one (a probe, so the ratio stays measured and the
tag can come back). The rule's predictions and 1-ahead ones are never muted.

**Simulated stall** (a GPU estimate, the device profile's; ``PilotReport.sim_stall_us``): the
copies are synchronous on the CPU, so where a copy is issued changes no measured time here. The
cache replays the forward on a simulated device clock (runtime/cache.py): each forward call
takes its graph's predicted compute time (``PilotPrefetchPlan.graph_seconds``), a copy is issued
at the in-graph op's point of its call (or at the call's end, from the tail) and runs on a FIFO
copy stream, a fetch served from the cache waits until the copy is done, and a miss copies on
demand. The same predictions issued at the tail instead of in the graph stall for the copy time
the graph's remaining compute would have hidden.

Correctness never depends on a prediction: a fetch the cache cannot serve copies on demand, as
with ``pilot="off"``, and a stale copy (its parameter's version counter moved) is dropped.

The **reserve**. Fragments are planned against ``budget − reserve``, so the cache fits beside any
fragment's peak. A fragment's reserve is ``prefetch_depth ×`` the largest host-placed parameter
bytes of one block known when it is planned (its own included): the cache holds at most the next
``prefetch_depth`` blocks' parameters. Before each call the cache is trimmed to that fragment's
reserve; prefetches stop at the largest reserve of any plan (the next fragment, not known yet,
trims again). A fragment planned with no reserve runs with an empty cache. With
``offload_params="auto"``, a fragment whose plan fits with its parameters on the host but not
beside the full reserve gets what its plan leaves under the budget instead (the host tier is
what fits; the cache only saves time). Between a step's optimizer step and the next forward the
cache holds the next step's first block (within that block's fragment's reserve); a CPU
measurement started in between (``measure_peak``) does not see that copy, which was made before
it started.

Predictors (``pilot`` option): ``"markov"`` (last successor, markov.py), ``"lightgbm"`` (the
online :class:`~memcompile.dynamic.pilot.Pilot`, Markov below its confidence threshold), ``"auto"``
(the Pilot where its prefetches pay: once the model is dynamic and has parameters in the host
tier, a trial times steps with it against steps fetching on demand and keeps the faster,
``trial.py``; :meth:`Prefetcher._auto`), ``"off"`` (no prefetcher: every fetch on demand).
Any object with ``observe``/``predict``/``end_step`` and an ``active`` name can replace
:attr:`Prefetcher.predictor` (tests inject an adversarial one).

**Devices.** On the CPU device a prefetch copies at once, on the computing thread (the time is
spent inside the graph, where a GPU's copy would overlap compute; ``runtime/copy_engine.py``'s
copy thread, off by default, was measured slower there: ``benchmarks/results/copy_thread.md``).
A prefetch hides nothing there and the pilot's work is added step time, so ``pilot="auto"``
runs no trial on the CPU with the copy thread off (the compiler's gate says why; an explicit
pilot runs, e.g. for its simulated GPU stall).
On CUDA, host-placed parameters are pinned CPU
tensors (``runtime/pinned.py``): a prefetch copies on the cache's side stream and records an
event, and a hit makes the compute stream wait for that event (runtime/cache.py), so a copy
issued by the in-graph op overlaps the rest of the graph. The report then gives, beside the
simulated stall, what the GPU measured: the compute stream's waits for late copies
(``gpu_wait_us``) and its on-demand copies (``gpu_miss_us``). CUDA small integer outputs (a
router's counts) are read at their graph's tail, never inside it (the host would wait for the
device there; rewrites/pilot_prefetch.py places such a graph's prediction at its tail). Issuing
a copy costs the host tens of microseconds of CUDA calls, which a step the host cannot keep
ahead of pays in full (benchmarks/results/dynamic_prefetch_cuda.md, a host-bound small MoE):
``pilot="auto"``'s trial measures whether the copies it hides are worth that on the model at
hand; an explicit ``"markov"``/``"lightgbm"`` runs regardless.

"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from memcompile.analysis.costmodel import DeviceProfile
from memcompile.dynamic.idioms import IdiomVector, graph_idioms
from memcompile.dynamic.markov import UNKNOWN, MarkovPredictor
from memcompile.dynamic.trace import MAX_SIZES, _BlockNamer
from memcompile.dynamic.trial import PilotTrial
from memcompile.records import FragmentRecord, RecordIndex
from memcompile.rewrites.pilot_prefetch import PilotPrefetchPlan
from memcompile.runtime.cache import PrefetchCache
from memcompile.runtime.ops import register_hook
from memcompile.runtime.small_ints import small_int_outputs
from memcompile.runtime.store import is_host_placed

if TYPE_CHECKING:  # pilot.py imports LightGBM: only when the Pilot is used
    from memcompile.dynamic.pilot import PilotStats, Prediction

log = logging.getLogger(__name__)

__all__ = [
    "PILOT_KNOBS",
    "BlockPredictor",
    "MarkovBlocks",
    "PilotReport",
    "Prefetcher",
    "make_predictor",
]

#: Waste control (see the module doc): a ``source@j`` tag (``j`` >= 2, not the rule's) is muted
#: while over the last ``WASTE_WINDOW`` steps more than ``MAX_WASTE`` of its settled bytes were
#: wasted; a muted tag still copies every ``PROBE_EVERY``-th prediction.
MAX_WASTE = 0.5
WASTE_WINDOW = 4
PROBE_EVERY = 4

#: Keyword arguments for the ``"lightgbm"``/``"auto"`` :class:`Pilot` (besides ``horizon`` and
#: ``seed``): tests and benchmarks shorten the warm-up or train inline.
PILOT_KNOBS: dict[str, Any] = {}

_CPU = torch.device("cpu")

#: What a forward call's prediction wants copied: (block, host-placed tensor, the tag its copy
#: is counted under, the tensor's cache key), the key read once per prediction.
_Wanted = list[tuple[str, torch.Tensor, str, int]]


class BlockPredictor(Protocol):
    """What the prefetcher needs from a predictor (the Pilot has it)."""

    @property
    def active(self) -> str: ...

    def observe(
        self,
        block: str,
        fragment: str,
        sizes: Sequence[int] = (),
        idioms: IdiomVector | None = None,
    ) -> None: ...

    def predict(self) -> Prediction: ...

    def end_step(self) -> None: ...


class MarkovBlocks:
    """The Markov (last-successor) predictor over block labels."""

    active = "markov"

    def __init__(self, horizon: int) -> None:
        self.markov = MarkovPredictor(horizon)
        self.horizon = horizon
        self._ids: dict[str, int] = {}
        self._labels: list[str] = []
        self._nan = (math.nan,) * horizon

    def observe(
        self,
        block: str,
        fragment: str,
        sizes: Sequence[int] = (),
        idioms: IdiomVector | None = None,
    ) -> None:
        i = self._ids.get(block)
        if i is None:
            i = self._ids[block] = len(self._labels)
            self._labels.append(block)
        self.markov.observe(i)

    def predict(self) -> Prediction:
        from memcompile.dynamic.pilot import Prediction

        labels = self._labels
        return Prediction(
            blocks=tuple(labels[i] if i != UNKNOWN else None for i in self.markov.predict()),
            sources=("markov",) * self.horizon,
            confidence=self._nan,
        )

    def end_step(self) -> None:
        pass


def make_predictor(kind: str, horizon: int, *, seed: int = 0) -> BlockPredictor:
    """The predictor of ``pilot=kind`` (``"auto"`` is the Pilot)."""
    if kind == "markov":
        return MarkovBlocks(horizon)
    if kind in ("lightgbm", "auto"):
        from memcompile.dynamic.pilot import Pilot

        return Pilot(**{"horizon": horizon, "seed": seed, **PILOT_KNOBS})
    raise ValueError(f"no predictor for pilot={kind!r}")


@dataclass(frozen=True)
class PilotReport:
    """The pilot in the report (``memcompile.report(compiled).pilot``).

    Attributes:
        mode: the ``pilot`` option.
        enabled: the prefetcher runs now (``"auto"``: in its trial's steps with the pilot, and
            after a trial that kept it; trial.py).
        reason: why it is not running (empty while it runs).
        active: the predictor in use: ``"lightgbm"``, ``"markov"`` (also the Pilot before its
            first model), another predictor's name, or ``"none"`` (not running).
        horizon: blocks predicted ahead (``prefetch_depth``).
        accuracy: fraction of next-block predictions that were right (``None``: none scored).
        k_ahead_accuracy: the same ``horizon`` blocks ahead.
        predictions: predictions scored at ``horizon``.
        predict_us_p50: median prediction time, microseconds.
        hit_rate: prefetched bytes used / host-parameter bytes the forward fetched (``None``:
            nothing fetched yet). The first block of a step is prefetched after the optimizer
            step (see :meth:`Prefetcher.after_optimizer_step`); without an optimizer step in
            between (e.g. evaluation loops) its bytes are misses.
        needed_bytes, hit_bytes: those two byte counts.
        prefetched_bytes: bytes copied ahead of use.
        wasted_bytes: prefetched copies freed unused (mispredictions, stale copies, copies
            trimmed to a fragment's reserve, leftovers at the end of the forward).
        stall_us: microseconds the forward spent in on-demand fetches (misses), measured on the
            CPU; on a GPU this is time the compute stream would wait.
        misses: fetches served on demand.
        reserve_bytes: the largest prefetch reserve any fragment was planned with.
        cache_peak_bytes: the most bytes the cache held.
        models_trained, fallback_rate: the Pilot's (``None`` for other predictors).
        muted_predictions: predicted blocks not copied because their kind of guess (e.g. Markov
            two blocks ahead) wasted more than it saved lately (see the module doc).
        in_graph_predictions: predictions made inside a forward graph (``pilot_prefetch``).
        tail_predictions: predictions made at a forward call's tail (graphs without the op).
        read_predictions: predictions made again when the model's Python read a number from a
            tensor after a forward call (``int(router(x).argmax())``: runtime/scalar_reads.py).
        sim_stall_us: simulated device stall of the training forwards, microseconds: the
            copies on the device profile's host link, issued where they were (see the module
            doc; ``None`` before any fragment was placed). A GPU estimate with a GPU profile.
        sim_late_us: the part of ``sim_stall_us`` spent waiting for prefetched copies (issued
            too late to hide; the rest is misses, copied on demand).
        sim_profile: the device profile of ``sim_stall_us``.
        gpu_wait_us: CUDA, measured with events: microseconds the compute stream waited for
            prefetched copies that were not done when it reached their fetch (``None``: no
            CUDA copy was timed, e.g. on the CPU device).
        gpu_late_bytes: bytes of those late copies.
        gpu_miss_us: CUDA, measured: microseconds of on-demand copies (misses) on the compute
            stream, which it waits for.
        placements: where each forward graph predicts (rewrites/pilot_prefetch.py), by fragment.
        decision: ``"auto"``: what its trial measured and decided (trial.py; empty while it
            runs, or before it began).
    """

    mode: str
    enabled: bool
    active: str
    horizon: int
    accuracy: float | None
    k_ahead_accuracy: float | None
    predictions: int
    predict_us_p50: float | None
    hit_rate: float | None
    needed_bytes: int
    hit_bytes: int
    prefetched_bytes: int
    wasted_bytes: int
    stall_us: float
    misses: int
    reserve_bytes: int
    cache_peak_bytes: int
    models_trained: int | None = None
    fallback_rate: float | None = None
    muted_predictions: int = 0
    in_graph_predictions: int = 0
    tail_predictions: int = 0
    read_predictions: int = 0
    sim_stall_us: float | None = None
    sim_late_us: float | None = None
    sim_profile: str | None = None
    gpu_wait_us: float | None = None
    gpu_late_bytes: int = 0
    gpu_miss_us: float | None = None
    placements: tuple[PilotPrefetchPlan, ...] = ()
    reason: str = ""
    decision: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Prefetcher:
    """Runs a predictor on the forward block stream and keeps the prefetch cache; see above.

    Args:
        mode: the ``pilot`` option (not ``"off"``).
        horizon: ``prefetch_depth``.
        records: the compiler's fragment records (``MemCompiler.records``).
        model: the compiled module, when known (block names, as in trace.py).
        gate: ``"auto"``: whether the model qualifies now (dynamic, parameters on the host);
            once it does, a trial decides (trial.py).
        compiles: the compiler's count of fragment compiles (a trial step with one is not
            timed).
        iterations: the training loop's iterations ended (optimizer steps of the model,
            step/iteration.py): the trial times iterations once one is seen, so a loop
            accumulating gradients compares whole iterations.
    """

    def __init__(
        self,
        mode: str,
        horizon: int,
        *,
        records: Callable[[], Sequence[FragmentRecord]],
        model: Callable[[], torch.nn.Module | None] = lambda: None,
        gate: Callable[[], bool] | None = None,
        compiles: Callable[[], int] = lambda: 0,
        iterations: Callable[[], int] = lambda: 0,
    ) -> None:
        self.mode = mode
        self.horizon = horizon
        # "auto": made when the gate opens (no LightGBM for a static model)
        self._predictor: BlockPredictor | None = (
            None if gate is not None else make_predictor(mode, horizon)
        )
        self.cache = PrefetchCache()
        self.enabled = gate is None
        self._gate = gate
        #: ``"auto"``: the trial of the pilot against fetching on demand (``None``: not begun)
        self.trial: PilotTrial | None = None
        self._trial_step: tuple[str, int] | None = None
        self._compiles = compiles
        self._iterations = iterations
        #: the trial's clock (seconds; tests replace it)
        self.clock: Callable[[], float] = time.perf_counter
        #: Why ``"auto"`` runs no trial although the model is dynamic with parameters on the
        #: host (the compiler's gate sets it; the report says it instead of the rule).
        self.blocked: str | None = None
        self._record = RecordIndex(records)
        self._namer = _BlockNamer(model)
        self._idioms: dict[str, IdiomVector] = {}
        # block label -> its host-placed parameters (weak: the model owns them)
        self._params: dict[str, list[weakref.ref[torch.Tensor]]] = {}
        self._step_starts: set[str] = set()
        self._step: int | None = None
        self._in_forward = False
        # where the copies go: the running (last) forward call's device
        self._device = _CPU
        #: the largest reserve any fragment was planned with: prefetches stop there
        self.capacity = 0
        # scoring (independent of the predictor, so every predictor is scored alike)
        self._t = 0
        self._made: deque[tuple[int, tuple[str | None, ...]]] = deque()
        self._hits = [0] * horizon
        self._scored = [0] * horizon
        self._latency_ns: deque[int] = deque(maxlen=10_000)
        # the predictions past a step start at the last forward tail: for the optimizer step
        self._next_step: tuple[str, str] | None = None  # (block, tag)
        # waste control: per-step snapshots of the cache's per-tag (hit, wasted) bytes
        self._tag_history: deque[dict[str, tuple[int, int]]] = deque(maxlen=WASTE_WINDOW + 1)
        self._muted: set[str] = set()
        self._probe: dict[str, int] = {}
        #: predictions not copied because their tag was muted
        self.muted_predictions = 0
        #: optimizer steps after which the next step's first blocks were prefetched
        self.step_start_prefetches = 0
        # The forward call running now (before() -> in_graph() -> after()): its fragment index
        # while in_graph() has not run for it, its reserve, its block's own parameter keys, its
        # fragment's placement, and what in_graph() predicted (None: not yet).
        self._pending: int | None = None
        self._reserve_now = 0
        self._own: set[int] = set()
        self._placement: PilotPrefetchPlan | None = None
        self._wanted: _Wanted | None = None
        #: The small integer values the running call's graph showed the predictor (None: no
        #: in-graph prediction in this call); see take_in_graph_small_ints.
        self.in_graph_small_ints: tuple[tuple[int, ...], ...] | None = None
        #: The cache's bytes, and its ``taken`` count, right after the running call's in-graph
        #: prediction copied (``None``: none in this call), for the step's replay.
        self.in_graph_cached: tuple[int, int] | None = None
        #: fragment index -> where its forward graph predicts (the compiler's decisions)
        self.placements: dict[int, PilotPrefetchPlan] = {}
        self._sim_profile: str | None = None
        self.in_graph_predictions = 0
        self.tail_predictions = 0
        self.read_predictions = 0
        #: the key the graphs' ``memcompile::pilot_prefetch`` nodes carry (runtime/ops.py)
        self.key = register_hook(self)
        # A weak reference: the hook must not keep the prefetcher (and its cache) alive.
        ref = weakref.ref(self)

        def hook(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            prefetcher = ref()
            if prefetcher is not None:
                prefetcher.after_optimizer_step(optimizer)

        handle = register_optimizer_step_post_hook(hook)
        weakref.finalize(self, handle.remove)

    @property
    def predictor(self) -> BlockPredictor:
        """The predictor (settable: tests inject one)."""
        if self._predictor is None:
            self._predictor = make_predictor(self.mode, self.horizon)
        return self._predictor

    @predictor.setter
    def predictor(self, value: BlockPredictor) -> None:
        self._predictor = value

    # -- planning ------------------------------------------------------------------------------
    def add_reserve(self, nbytes: int) -> None:
        """A fragment was planned with ``nbytes`` reserved for the cache."""
        self.capacity = max(self.capacity, nbytes)

    def place(self, index: int, plan: PilotPrefetchPlan, profile: DeviceProfile) -> None:
        """Fragment ``index``'s forward graph predicts where ``plan`` says (in the graph or at
        its tail), timed on ``profile`` (the simulated stall's copies use its host link)."""
        self.placements[index] = plan
        if self._sim_profile is None:
            self._sim_profile = profile.name
            self.cache.copy_seconds = lambda n: profile.launch_overhead + profile.copy_time(n)

    # -- the compiler's hooks ------------------------------------------------------------------
    def before(
        self,
        step: int,
        index: int,
        kind: str,
        block: int,
        args: Sequence[Any],
        hosted: Sequence[int],
        reserve: int,
        device: torch.device | None = None,
    ) -> bool:
        """A fragment call is about to run (``args``: its inputs, before the boxed call clears
        them) on ``device`` (where its copies go; ``None``: the CPU). Returns whether
        :meth:`after` should run at its tail."""
        self._pending, self._wanted = None, None
        self.in_graph_cached = None
        if self._gate is not None and not self._auto(step, kind):
            return False
        cache = self.cache
        if kind != "forward":
            if self._in_forward:  # the forward is over: the optimizer will change parameters
                self._end_forward()
            return False
        record = self._record(index)
        if record is None:
            return False
        if step != self._step:
            if self._step is not None:
                self.predictor.end_step()
            self._update_muted()
            self._step = step
            self._step_starts.add(self._namer.label(record, block, kind))
        label = self._namer.label(record, block, kind)
        params = self._params.get(label)
        if params is None:
            held = [args[i] for i in hosted if i < len(args) and is_host_placed(args[i])]
            cache.watch(held)
            params = self._params[label] = [weakref.ref(t) for t in held]
        own = {PrefetchCache.key(t) for t in _alive(params)}
        cache.trim(reserve, prefer=own)
        cache.counting = True
        self._in_forward = True
        self._score(label)
        static = record.static_inputs
        sizes = tuple(
            a.numel() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in static
        )[:MAX_SIZES]
        self.predictor.observe(label, record.id, sizes, self._fragment_idioms(record))
        self._pending, self._reserve_now = index, reserve
        self._device = device if device is not None else _CPU
        self._own = own
        self._placement = self.placements.get(index)
        return True

    def _auto(self, step: int, kind: str) -> bool:
        """``pilot="auto"``: whether the prefetcher runs in this call. Shut until the gate
        opens (the model is dynamic with parameters on the host); then a trial times steps
        with the pilot against steps fetching on demand (trial.py), switching at each step's
        first forward call, and its decision stands."""
        trial = self.trial
        if trial is None:
            assert self._gate is not None
            if not self._gate():
                return False
            self.trial = trial = PilotTrial()
            log.info(
                "memcompile pilot: the model is dynamic with parameters on the host: timing the "
                "pilot against fetching on demand (%d steps)",
                len(trial.schedule),
            )
        # The trial's unit: the loop's iteration once an optimizer step was seen (its
        # micro-batches differ: the last one ends with the optimizer step), else the step.
        ended = self._iterations()
        unit = ("iteration", ended) if ended else ("step", step)
        if kind == "forward" and unit != self._trial_step:
            self._trial_step = unit
            decided = trial.decided
            on = trial.begin_step(self.clock(), self._compiles())
            if trial.decided and not decided:
                log.info("memcompile pilot: %s", trial.reason)
            if on != self.enabled:
                self._switch(on)
        return self.enabled

    def _switch(self, on: bool) -> None:
        """Run the prefetcher from now on, or stop it: its copies are freed (a step that
        starts fetching on demand must not find the last one's)."""
        self.enabled = on
        if not on:
            self._end_forward()
            self._next_step = None

    def in_graph(self, fragment: int, observed: Sequence[torch.Tensor]) -> None:
        """Inside fragment ``fragment``'s forward graph (``memcompile::pilot_prefetch``): show
        the predictor the ``observed`` values, predict, free mispredicted copies, prefetch what
        fits the fragment's reserve. Nothing unless this is the forward call :meth:`before`
        announced (an inference call, or the pilot not running yet)."""
        if self._pending != fragment:
            return
        self._pending = None
        self.in_graph_predictions += 1
        # The graph's observed values are the outputs the tail would read, in the same order
        # (rewrites/pilot_prefetch.py): kept for the compiler's block observers (read once).
        self.in_graph_small_ints = small_int_outputs(list(observed))
        self._wanted = wanted = self._predict(self.in_graph_small_ints)
        plan = self._placement
        issue = self.cache.sim_clock + (plan.issue_seconds if plan is not None else 0.0)
        # The running block's own copies stay: its graph may fetch them after this point. A
        # prediction of the running block itself (its next call) is copied at the tail: here,
        # its graph would take the copy now.
        own = self._own
        limit = min(self.capacity, self._reserve_now)
        later = [w for w in wanted if w[3] not in own]
        self._copy(later, limit, keep=own | {w[3] for w in wanted}, issue_s=issue)
        self.in_graph_cached = (self.cache.bytes, self.cache.taken)

    def take_in_graph_small_ints(self) -> tuple[tuple[int, ...], ...] | None:
        """The small integer values the running call's graph showed the predictor (``None``: no
        in-graph prediction in this call), handed over once."""
        values, self.in_graph_small_ints = self.in_graph_small_ints, None
        return values

    def after(
        self, outputs: Any = None, *, small_ints: tuple[tuple[int, ...], ...] | None = None
    ) -> None:
        """Tail of a forward call: after :meth:`in_graph`, free what its prediction does not
        name and copy what did not fit the fragment's reserve; else show the predictor the
        call's small integer outputs (a router's counts: which experts run next, see
        rules.py), predict, free mispredicted copies, prefetch. ``small_ints``: those values,
        when the compiler read them already for its block observers (read once per call)."""
        self._pending = None
        plan = self._placement
        cache = self.cache
        cache.sim_advance(plan.graph_seconds if plan is not None else 0.0)
        wanted = self._wanted
        if wanted is not None:  # predicted in the graph: not again
            self._wanted = None
            self._copy(wanted, self.capacity, issue_s=cache.sim_clock)
            return
        self.tail_predictions += 1
        if small_ints is None and outputs is not None:
            small_ints = small_int_outputs(outputs)
        wanted = self._predict(small_ints)
        self._copy(wanted, self.capacity, issue_s=cache.sim_clock)

    def takes_reads(self) -> bool:
        """Whether :meth:`read` would use a read now (running, with a predictor that learns
        from reads: the Pilot's rule)."""
        return self.enabled and hasattr(self.predictor, "observe_read")

    def read(self, values: tuple[int | float, ...]) -> None:
        """The model's Python read ``values`` from a tensor after the latest forward call's tail
        (runtime/scalar_reads.py: the expert an ``int(router(x).argmax())`` names, an exit's
        confidence): show the predictor; when that may change its prediction (its rule made a
        new plan, a float was read), predict again, free mispredicted copies, prefetch. Nothing
        outside a forward or when the predictor takes no reads (Markov)."""
        observe_read = getattr(self.predictor, "observe_read", None)
        if not self.enabled or not self._in_forward or observe_read is None:
            return
        if not observe_read(values):
            return  # the prediction made at the call's tail stands
        self.read_predictions += 1
        self._copy(self._predict(None), self.capacity, issue_s=self.cache.sim_clock)

    def _predict(self, outputs: tuple[tuple[int, ...], ...] | None) -> _Wanted:
        """Show the predictor ``outputs`` (``None``: none known), predict; the host-placed
        parameters to copy, nearest block first, muted tags left out."""
        observe_outputs = getattr(self.predictor, "observe_outputs", None)
        if observe_outputs is not None and outputs is not None:
            observe_outputs(outputs)
        start = time.perf_counter_ns()
        prediction = self.predictor.predict()
        self._latency_ns.append(time.perf_counter_ns() - start)
        blocks = tuple(prediction.blocks)[: self.horizon]
        sources = tuple(prediction.sources)
        made = self._made
        if made and made[-1][0] == self._t - 1:
            made.pop()  # predicted again after a read: the latest prediction is scored
        made.append((self._t - 1, blocks))
        wanted: _Wanted = []
        key = PrefetchCache.key
        self._next_step = None
        for j, b in enumerate(blocks, 1):
            if b is None:
                continue
            source = sources[j - 1] if j <= len(sources) else "none"
            if b in self._step_starts:
                # The next step: the optimizer step comes first (after_optimizer_step).
                self._next_step = (b, f"{source}@step")
                break
            tag = f"{source}@{j}"
            if tag in self._muted:
                n = self._probe[tag] = self._probe.get(tag, 0) + 1
                if n % PROBE_EVERY:
                    self.muted_predictions += 1
                    continue
            wanted.extend((b, t, tag, key(t)) for t in _alive(self._params.get(b, ())))
        return wanted

    def _copy(
        self, wanted: _Wanted, limit: int, *, keep: Collection[int] = (), issue_s: float
    ) -> None:
        """Free the copies neither ``wanted`` nor in ``keep``; copy ``wanted`` in order while
        the cache holds at most ``limit`` bytes (issued at ``issue_s`` on the simulated
        clock)."""
        cache = self.cache
        cache.evict(keep={w[3] for w in wanted} | set(keep))
        # A block's tensors go together: one copy call for those not cached yet.
        for (b, tag), items in itertools.groupby(wanted, key=lambda w: (w[0], w[2])):
            todo: list[torch.Tensor] = []
            keys: list[int] = []
            for _, t, _, k in items:
                if cache.has_key(k):
                    cache.retag_key(k, tag)  # counted under the prediction that keeps it now
                else:
                    todo.append(t)
                    keys.append(k)
            if not todo:
                continue
            cache.prefetch_many(todo, self._device, b, tag, issue_s=issue_s, limit=limit)
            if not all(cache.has_key(k) for k in keys):
                break  # the limit: nothing further

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped: if it steps host-placed parameters of this model, copy the
        parameters of the block predicted to start the next step (kept by :meth:`after`)."""
        if not self.enabled or self._in_forward or self._next_step is None:
            return
        cache = self.cache
        if not any(cache.watches(p) for g in optimizer.param_groups for p in g["params"]):
            return  # another model's optimizer
        label, tag = self._next_step
        copied = cache.prefetch_many(  # (it skips the copies cached already)
            _alive(self._params.get(label, ())),
            self._device,
            label,
            tag,
            issue_s=cache.sim_clock,
            limit=self.capacity,
        )
        if copied:
            self.step_start_prefetches += 1

    def reset(self) -> None:
        """The compiler forgot its fragments: forget blocks and free the cache."""
        self._end_forward()
        self._record.clear()
        self._params.clear()
        self._next_step = None
        self._namer.reset()
        self._idioms.clear()
        self._pending, self._wanted = None, None
        self.placements.clear()

    def wait(self) -> None:
        """Wait for a predictor's background training (the Pilot's), for deterministic tests."""
        wait = getattr(self._predictor, "wait", None)
        if callable(wait):
            wait()

    # -- results -------------------------------------------------------------------------------
    def report(self) -> PilotReport:
        c = self.cache.counters()
        lat = sorted(self._latency_ns)
        predictor = self._predictor
        stats: PilotStats | None = None
        if type(predictor).__name__ == "Pilot":  # not imported unless in use
            stats = predictor.stats()  # type: ignore[union-attr]

        def acc(j: int) -> float | None:
            return self._hits[j] / self._scored[j] if self._scored[j] else None

        return PilotReport(
            mode=self.mode,
            enabled=self.enabled,
            reason="" if self.enabled else self._why_not(),
            active=(
                "none"
                if predictor is None
                else str(getattr(predictor, "active", type(predictor).__name__))
            ),
            horizon=self.horizon,
            accuracy=acc(0),
            k_ahead_accuracy=acc(self.horizon - 1),
            predictions=self._scored[self.horizon - 1],
            predict_us_p50=lat[len(lat) // 2] / 1000 if lat else None,
            hit_rate=c.hit / c.needed if c.needed else None,
            needed_bytes=c.needed,
            hit_bytes=c.hit,
            prefetched_bytes=c.prefetched,
            wasted_bytes=c.wasted,
            stall_us=c.stall_ns / 1000,
            misses=c.misses,
            reserve_bytes=self.capacity,
            cache_peak_bytes=c.peak_bytes,
            models_trained=stats.models_trained if stats is not None else None,
            fallback_rate=stats.fallback_rate if stats is not None else None,
            muted_predictions=self.muted_predictions,
            in_graph_predictions=self.in_graph_predictions,
            tail_predictions=self.tail_predictions,
            read_predictions=self.read_predictions,
            sim_stall_us=c.sim_stall_s * 1e6 if self._sim_profile is not None else None,
            sim_late_us=c.sim_late_s * 1e6 if self._sim_profile is not None else None,
            sim_profile=self._sim_profile,
            gpu_wait_us=None if c.gpu_wait_s is None else c.gpu_wait_s * 1e6,
            gpu_late_bytes=c.gpu_late_bytes,
            gpu_miss_us=None if c.gpu_miss_s is None else c.gpu_miss_s * 1e6,
            placements=tuple(self.placements[i] for i in sorted(self.placements)),
            decision=self.trial.reason if self.trial is not None else "",
        )

    # -- internals -----------------------------------------------------------------------------
    def _end_forward(self) -> None:
        # No forward of a step is counting any more: free every copy (the optimizer will change
        # the parameters, or the prefetcher stops).
        self.cache.clear()
        self.cache.counting = False
        self._in_forward = False

    def _why_not(self) -> str:
        if self.blocked:
            return self.blocked
        trial = self.trial
        if trial is not None:
            if trial.decided:
                return trial.reason
            return (
                "pilot='auto' is timing the pilot against fetching on demand; this step fetches "
                "on demand"
            )
        return "the model was not seen to be dynamic with parameters on the host"

    def _update_muted(self) -> None:
        """A step began: mute the hedging tags that wasted too much over the last steps."""
        now = {t: (c.hit, c.wasted) for t, c in self.cache.by_tag.items()}
        history = self._tag_history
        history.append(now)
        old = history[0]
        muted: set[str] = set()
        for tag, (hit, wasted) in now.items():
            source, _, ahead = tag.rpartition("@")
            if source == "rule" or not ahead.isdigit() or int(ahead) < 2:
                continue
            hit0, wasted0 = old.get(tag, (0, 0)) if len(history) > 1 else (0, 0)
            used, lost = hit - hit0, wasted - wasted0
            if used + lost and lost > MAX_WASTE * (used + lost):
                muted.add(tag)
        if muted != self._muted:
            log.debug("memcompile pilot: muted prefetch tags %s", sorted(muted))
        self._muted = muted

    def _score(self, label: str) -> None:
        t = self._t
        made = self._made
        while made and t - made[0][0] > self.horizon:
            made.popleft()
        for when, predicted in made:
            j = t - when
            if 1 <= j <= self.horizon and j <= len(predicted):
                self._scored[j - 1] += 1
                self._hits[j - 1] += predicted[j - 1] == label
        self._t = t + 1

    def _fragment_idioms(self, record: FragmentRecord) -> IdiomVector:
        vec = self._idioms.get(record.id)
        if vec is None:
            profile = record.profile
            vec = self._idioms[record.id] = graph_idioms(profile.forward if profile else None)
        return vec


def _alive(refs: Sequence[weakref.ref[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for t in (r() for r in refs) if t is not None]
