"""The pilot: a LightGBM model predicting the next ``k`` blocks of a dynamic network, online.

It sees the forward block stream (the backward order is the reverse of the forward's, known at
the end of the forward: DESIGN.md), one :meth:`Pilot.observe` per block, and after each one can
predict the next ``horizon`` blocks:

    pilot = Pilot(horizon=2, warmup_steps=4, retrain_every=4, seed=0)
    for step in trace:                                   # list[StepTrace], see trace.py
        idioms = dict(step.idioms)
        for e in step.events:
            if e.phase != "backward":
                pilot.observe(e.block, e.fragment, e.sizes, idioms.get(e.fragment),
                              outputs=e.outputs)         # or observe_outputs() once it returned
                for r in e.reads:                        # numbers Python read after it
                    pilot.observe_read(r)
                nxt = pilot.predict()                    # Prediction(blocks=(b1, b2), ...)
        pilot.end_step()                                 # may start retraining (a thread)
    pilot.stats()                                        # PilotStats: accuracies, latency
    pilot.save("pilot/")                                 # LightGBM text + meta.json, no pickle

Features of the row after block ``t`` (:data:`FEATURES`): the last ``history`` block ids
(categorical), the position in the step's forward, the block's fragment idioms (idioms.py), the
element counts of its non-parameter inputs (an expert's token count: the router's decision,
observed for free), how many calls in a row its fragment has made (which expert of a layer) and
the sums of those counts over the run (tokens routed so far in the layer: how many are left), and
the blocks that followed this position in the previous step (categorical), and what the block's
small integer outputs say (below). Targets: the block ``j`` calls ahead, one multiclass booster
per ``j`` (direct, not recursive: errors do not compound).

Observed outputs (runtime/small_ints.py's ``small_int_outputs``, given to ``observe(outputs=...)``
or to :meth:`observe_outputs` after the block returned; predictions made after them are made at the
block's end): the output rule (rules.py) learns online which output of which block lists the next
blocks, one per nonzero entry in entry order (an MoE router's per-expert counts: the experts that
run next), validates it on every emission, and once trusted predicts the blocks it covers exactly
(source ``"rule"``): within a layer, and the next router. Its predictions are features too
(``rule_j``, ``rule_left``), with the values of the output behind the current plan (``plan_out_*``:
the router's counts) and of the step's first output (``step_out_*``: e.g. the input token ids).
Ints the model's Python reads from tensors after a block (:meth:`observe_read`;
runtime/scalar_reads.py: an expert's index from ``int(router(x).argmax())``) teach the rule the
same way, as indices of the blocks that run next (rules.py); a float it reads (an exit's
confidence, ``conf.item()``) is the row's ``read`` feature.
LightGBM is trained, per horizon, on the rows the rule did not cover (all rows while fewer than 16
are left): the cross-layer predictions, where the next router has not run.

Online: nothing is trained before ``warmup_steps`` steps; then every ``retrain_every`` steps a
background thread trains on the last ``window`` rows (``num_threads=1``, ``deterministic=True``,
seeded: the same rows give the same model) and swaps the models in when done; :meth:`wait` joins
it (tests and benchmarks, for a deterministic swap point). A prediction whose probability is
below ``threshold``, or made before any model exists, is the Markov predictor's (markov.py),
unless the rule covers it. Predictions go through LightGBM's C single-row fast path
(fastpredict.py), and only for the horizons the rule does not cover: the feature row is packed
once into bytes (``struct.pack``) that every horizon's booster reads in place, and the boosters'
answers are kept per packed row for the models that gave them (a row seen again is answered
without running them; identical rows give identical answers, so predictions do not change;
``PilotStats.reuse_rate``).
:meth:`save` writes the rule's votes into ``meta.json`` and :meth:`load` restores them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import lightgbm as lgb
import numpy as np

from memcompile.dynamic.fastpredict import FastBooster
from memcompile.dynamic.idioms import IDIOMS, IdiomVector
from memcompile.dynamic.markov import UNKNOWN, MarkovPredictor
from memcompile.dynamic.rules import RoutingRule
from memcompile.dynamic.trace import MAX_SIZES
from memcompile.errors import PilotWarning

log = logging.getLogger(__name__)

__all__ = ["FEATURES", "Pilot", "PilotStats", "Prediction", "feature_names"]

Outputs = Sequence[Sequence[int]]

_FORMAT = 2  # meta.json version (2: rule features and the rule's state)
#: Values of the output vector behind the current rule plan, and of the step's first output.
PLAN_OUTPUTS = 16
STEP_OUTPUTS = 8
_NAN = float("nan")
_perf_ns = time.perf_counter_ns
_ZERO_IDIOMS: IdiomVector = (0, 0, 0, 0, 0, 0)
#: Feature rows whose boosters' answers are kept (then the store starts over).
_MAX_ANSWERS = 1 << 14
#: Pilot.predict times one call in this many (PilotStats.predict_us_p50).
_TIME_EVERY = 8


def feature_names(history: int, horizon: int) -> tuple[str, ...]:
    """Column names of a feature row (``hist_0`` is the current block)."""
    return (
        *(f"hist_{i}" for i in range(history)),
        "position",
        *(f"idiom_{name}" for name in IDIOMS),
        *(f"size_{i}" for i in range(MAX_SIZES)),
        "run",
        *(f"run_size_{i}" for i in range(MAX_SIZES)),
        *(f"prev_step_{j}" for j in range(1, horizon + 1)),
        *(f"rule_{j}" for j in range(1, horizon + 1)),
        "rule_left",
        *(f"plan_out_{i}" for i in range(PLAN_OUTPUTS)),
        *(f"step_out_{i}" for i in range(STEP_OUTPUTS)),
        "read",
    )


#: Feature names with the default ``history=4``, ``horizon=2``.
FEATURES = feature_names(4, 2)


class Prediction(NamedTuple):
    """The next blocks, as the pilot predicts them after the last observed block.

    A named tuple, not a frozen dataclass: as immutable, and built in ~0.15 µs instead of
    ~0.6 µs (a frozen dataclass sets each field through ``object.__setattr__``), once per
    forward block.

    Attributes:
        blocks: block ids ``1..horizon`` calls ahead (``None``: no prediction).
        sources: ``"rule"``, ``"lightgbm"`` or ``"markov"`` for each.
        confidence: LightGBM's class probability (``nan`` for Markov predictions, 1.0 for the
            rule's).
    """

    blocks: tuple[str | None, ...]
    sources: tuple[str, ...]
    confidence: tuple[float, ...]


#: Builds a :class:`Prediction` from its three fields without the named tuple's Python
#: ``__new__`` (the hot path).
_new_prediction = partial(tuple.__new__, Prediction)
#: Prediction sources, as digits of the base-3 source code of a prediction (one per horizon).
_SOURCE_NAMES = ("markov", "rule", "lightgbm")
_MARKOV, _RULE, _LIGHTGBM = 0, 1, 2


@dataclass(frozen=True)
class PilotStats:
    """How well the pilot predicts, for the report.

    Attributes:
        accuracy: fraction of next-block predictions that were right (``None``: none scored).
        k_ahead_accuracy: the same ``horizon`` blocks ahead.
        predictions: predictions scored at ``horizon``.
        predict_us_p50: median :meth:`Pilot.predict` time, microseconds (features built in
            observe; one call in 8 timed).
        active: ``"lightgbm"`` once a model is trained or loaded, else ``"markov"``.
        fallback_rate: of the predictions made once a model existed, the fraction in which at
            least one horizon fell back to Markov (``None``: no model yet).
        models_trained: completed trainings.
        rule_rate: fraction of the per-horizon predictions the output rule made (``None``:
            no prediction yet).
        reuse_rate: of the predictions that needed the boosters, the fraction whose feature row
            had been seen before with the same models, answered without running them again
            (``None``: none needed them).
    """

    accuracy: float | None
    k_ahead_accuracy: float | None
    predictions: int
    predict_us_p50: float | None
    active: str
    fallback_rate: float | None
    models_trained: int
    rule_rate: float | None = None
    reuse_rate: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Horizon:
    """The model for one horizon: a booster over the classes seen, or a constant."""

    def __init__(self, classes: np.ndarray, booster: lgb.Booster | None) -> None:
        self.classes = classes  # class index -> block id
        self.booster = booster
        self.fast = FastBooster(booster) if booster is not None else None
        self.labels = [int(c) for c in classes]  # class index -> block id, as ints
        self.constant = self.labels[0]  # the block, when there is no booster
        # what Pilot.predict reads per booster call, in one tuple (one unpacking instead of
        # six attribute loads): FastBooster's C call pieces, its output and the class labels
        fast = self.fast
        self.call = (
            (fast.c_predict, fast.c_config, fast.c_out_len, fast.c_out, fast.out, self.labels)
            if fast is not None
            else None
        )

    def best_of(self, key: bytes) -> tuple[int, float]:
        """The most probable block for the feature row packed in ``key`` (the pilot's
        ``struct.pack`` of it: the booster reads those bytes), and its probability.
        (:meth:`Pilot.predict` inlines this.)"""
        if self.fast is None:
            return self.constant, 1.0
        i, p = self.fast.best_of(key)
        return self.labels[i], p

    def predict(self, row: Sequence[float]) -> tuple[int, float]:
        """The most probable block for ``row``, and its probability."""
        return self.best_of(struct.pack(f"{len(row)}d", *row))


def _train(
    x: np.ndarray,
    y: np.ndarray,
    categorical: list[int],
    params: dict[str, Any],
    rounds: int,
    rule_at: int,
) -> tuple[_Horizon, ...]:
    models = []
    for j in range(y.shape[1]):
        # Rows where the rule predicted horizon j are not LightGBM's to predict: train on the
        # others (fewer classes, so fewer trees; all rows while there are too few of them).
        xj, yj = x, y[:, j]
        open_ = np.isnan(x[:, rule_at + j])
        if open_.sum() >= 16 and not open_.all():
            xj, yj = x[open_], yj[open_]
        classes = np.unique(yj)  # sorted: deterministic class order
        if len(classes) == 1:
            models.append(_Horizon(classes, None))
            continue
        labels = np.searchsorted(classes, yj)
        data = lgb.Dataset(
            xj, labels, categorical_feature=categorical, params={"verbose": -1}, free_raw_data=True
        )
        booster = lgb.train({**params, "num_class": len(classes)}, data, num_boost_round=rounds)
        models.append(_Horizon(classes, booster))
    return tuple(models)


class Pilot:
    """Online next-blocks predictor; see the module docstring.

    Args:
        horizon: blocks predicted ahead (``k``, >= 1; memcompile prefetches ``prefetch_depth``).
        history: recent block ids in a feature row.
        warmup_steps: steps observed before the first training.
        retrain_every: steps between trainings.
        window: most recent rows trained on.
        threshold: below this class probability, predict with Markov instead.
        rounds, num_leaves: LightGBM size (trees = rounds x blocks seen, per horizon). Fewer
            trees predict faster: a C call walks every tree, and with the caches cold (the
            model ran since the last prediction) each costs ~40-70 ns.
        learning_rate: LightGBM's shrinkage (5 rounds at 0.4 predict the zoo's streams as
            accurately as 10 at 0.2, in half the time: benchmarks/results/pilot_latency.md).
        seed: LightGBM's seed.
        background: train on a thread (``False``: inline in :meth:`end_step`).
        rule: use the output rule (rules.py) where it has a plan, and its plan as features
            (``False``: the rule features stay missing and LightGBM / Markov predict all).
    """

    def __init__(
        self,
        *,
        horizon: int = 2,
        history: int = 4,
        warmup_steps: int = 5,
        retrain_every: int = 5,
        window: int = 4096,
        threshold: float = 0.5,
        rounds: int = 5,
        learning_rate: float = 0.4,
        num_leaves: int = 7,
        seed: int = 0,
        background: bool = True,
        rule: bool = True,
    ) -> None:
        for name, value, least in (
            ("horizon", horizon, 1),
            ("history", history, 1),
            ("warmup_steps", warmup_steps, 1),
            ("retrain_every", retrain_every, 1),
            ("window", window, 16),
            ("rounds", rounds, 1),
            ("num_leaves", num_leaves, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Pilot: {name} must be an int >= {least}; got {value!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"Pilot: threshold must be in [0, 1]; got {threshold!r}")
        if not 0.0 < learning_rate <= 1.0:
            raise ValueError(f"Pilot: learning_rate must be in (0, 1]; got {learning_rate!r}")
        self.horizon, self.history = horizon, history
        self.warmup_steps, self.retrain_every, self.window = warmup_steps, retrain_every, window
        self.threshold, self.rounds = threshold, rounds
        self.background = background
        self.features = feature_names(history, horizon)
        self._categorical = [
            i
            for i, n in enumerate(self.features)
            if n.startswith(("hist_", "prev_step_", "rule_")) and n != "rule_left"
        ]
        self._rule_at = self.features.index("rule_1")  # the rule's columns follow
        self._read_at = self.features.index("read")
        self._params: dict[str, Any] = {
            "objective": "multiclass",
            "num_leaves": num_leaves,
            "learning_rate": learning_rate,
            "lambda_l2": 1.0,
            "min_data_in_leaf": 5,
            "min_data_per_group": 3,
            "cat_smooth": 1.0,
            "max_cat_to_onehot": 64,
            "seed": seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": 1,
            "verbose": -1,
        }
        self._labels: list[str] = []
        # label of each block id, then None: ``_names[UNKNOWN]`` (-1) is no prediction
        self._names: list[str | None] = [None]
        self._ids: dict[str, int] = {}
        self.markov = MarkovPredictor(horizon)
        self.rule = RoutingRule() if rule else None
        self._models: tuple[_Horizon, ...] | None = None
        self._thread: threading.Thread | None = None
        self.models_trained = 0
        self.steps = 0
        # stream state
        self._recent: deque[int] = deque(maxlen=history)
        self._fragment = ""
        self._run = 0
        self._run_sizes = [0.0] * MAX_SIZES
        self._step_seq: list[int] = []
        self._prev_seq: list[int] = []
        self._row: list[float] | None = None
        self._plan_out: tuple[float, ...] = (_NAN,) * PLAN_OUTPUTS
        self._reads = 0  # reads observed since the last block (observe_read)
        self._step_out: tuple[float, ...] | None = None
        self._t = 0  # forward blocks observed
        # training rows: (row, targets); the last ``horizon`` rows still wait for targets
        self._rows: deque[tuple[list[float], list[int]]] = deque(maxlen=window + horizon)
        # scoring: (time, predicted ids) of predictions not yet fully scored
        self._made: deque[tuple[int, Sequence[int]]] = deque()
        self._hits = [0] * horizon
        self._scored = [0] * horizon
        # [predictions, their source names] per source code (see predict) x 2 + whether a
        # model existed: one dict lookup per prediction, the rates are derived in stats()
        self._by_code: dict[int, list[Any]] = {}
        self._calls = 0  # predict calls
        self._digit = [_LIGHTGBM * 3**j for j in range(horizon)]  # LightGBM's, per horizon
        # the code and confidences of a rule plan covering the first n horizons
        self._rule_code = [sum(_RULE * 3**j for j in range(n)) for n in range(horizon + 1)]
        self._rule_conf = [1.0] * horizon
        self._no_conf = [_NAN] * horizon
        self._latency_ns: deque[int] = deque(maxlen=2_000)  # of the timed calls
        # prediction: the feature row packed into bytes, which every booster reads (ctypes
        # passes the bytes' buffer: no copy into an array) and which keys the answers
        # per feature row (rows repeat: a static stretch of the network; identical rows give
        # identical answers), for the models they came from
        self._pack = struct.Struct(f"{len(self.features)}d").pack
        self._answers: dict[bytes, list[tuple[int, float] | None]] = {}
        self._answers_for: tuple[_Horizon, ...] | None = None
        self._answer_hits = 0
        self._answer_lookups = 0
        # feature building: constant pieces of the row
        self._no_hist = [_NAN] * history
        self._no_prev = [_NAN] * horizon
        self._rule_blank = [_NAN] * (len(self.features) - self._rule_at)
        self._sizes_floats: dict[tuple[int, ...], list[float]] = {}
        self._idiom_floats: dict[IdiomVector | None, list[float]] = {}

    # -- the stream ---------------------------------------------------------------------------
    def block_id(self, label: str) -> int:
        """The int id of a block label (new labels get the next id)."""
        i = self._ids.get(label)
        if i is None:
            i = self._ids[label] = len(self._labels)
            self._labels.append(label)
            self._names.insert(-1, label)
        return i

    def observe(
        self,
        block: str,
        fragment: str,
        sizes: Sequence[int] = (),
        idioms: IdiomVector | None = None,
        *,
        outputs: Outputs | None = None,
    ) -> None:
        """The next forward (or inference) block ran: learn from it and prepare the features.

        ``outputs``: the block's small integer outputs (runtime/small_ints.py's
        ``small_int_outputs``), when known already; else pass them to :meth:`observe_outputs`
        once the block returned.
        """
        b = self._ids.get(block)
        if b is None:
            b = self.block_id(block)
        t = self._t
        h = self.horizon
        # score earlier predictions of this block, and fill in earlier rows' targets
        made = self._made
        while made and t - made[0][0] > h:
            made.popleft()
        if made:
            scored, hits = self._scored, self._hits
            for when, predicted in made:
                j = t - when - 1
                if 0 <= j < h:
                    scored[j] += 1
                    hits[j] += predicted[j] == b
        rows = self._rows
        n = len(rows)
        for j in range(1, (h if h < n else n) + 1):
            rows[-j][1][j - 1] = b
        self.markov.observe(b)
        self._reads = 0
        if self.rule is not None:
            self.rule.observe(b)
        if type(sizes) is not tuple:
            sizes = tuple(sizes)
        if fragment == self._fragment:
            self._run += 1
            run_sizes = self._run_sizes
        else:
            self._run = 1
            run_sizes = self._run_sizes = [0.0] * MAX_SIZES
            self._fragment = fragment
        for i in range(min(len(sizes), MAX_SIZES)):
            run_sizes[i] += sizes[i]
        recent = self._recent
        recent.appendleft(b)
        step_seq = self._step_seq
        pos = len(step_seq)
        step_seq.append(b)
        # the row: hist_*, position, idiom_*, size_*, run, run_size_*, prev_step_*, then the
        # rule's columns (filled by _rule_features)
        row: list[float] = list(recent)
        if len(row) < self.history:
            row += self._no_hist[len(row) :]
        row.append(pos)
        floats = self._idiom_floats.get(idioms)
        if floats is None:
            floats = self._idiom_floats[idioms] = [float(x) for x in (idioms or _ZERO_IDIOMS)]
        row += floats
        floats = self._sizes_floats.get(sizes)
        if floats is None:
            if len(self._sizes_floats) >= 4096:
                self._sizes_floats.clear()  # bounded: sizes may vary without end
            floats = self._sizes_floats[sizes] = [
                float(sizes[i]) if i < len(sizes) else 0.0 for i in range(MAX_SIZES)
            ]
        row += floats
        row.append(self._run)
        row += run_sizes
        prev = self._prev_seq[pos + 1 : pos + h + 1]
        row += prev
        if len(prev) < h:
            row += self._no_prev[len(prev) :]
        row += self._rule_blank
        self._row = row
        rows.append((row, [UNKNOWN] * h))
        self._t = t + 1
        if outputs:
            self.observe_outputs(outputs)
        else:
            self._rule_features(row)

    def observe_outputs(self, outputs: Outputs) -> None:
        """The last observed block returned these small integer outputs (e.g. a router's
        per-expert counts): update the rule's plan and the features of the next prediction."""
        row = self._row
        if row is None or not self._recent:
            return
        if self._step_out is None and outputs and outputs[0]:
            first = outputs[0]
            self._step_out = tuple(
                float(first[i]) if i < len(first) else _NAN for i in range(STEP_OUTPUTS)
            )
        self._emitted(row, outputs, indices=False)

    def observe_read(self, values: Sequence[int | float]) -> bool:
        """After the last observed block returned, the model's Python read these numbers from a
        tensor (runtime/scalar_reads.py). Ints (``int(router(x).argmax())``, an expert's index)
        teach the rule which blocks they name (rules.py; each read after a block is its own
        rule slot, in order); a float (``conf.item()``, an exit's confidence) is the ``read``
        feature of the next prediction. Returns whether the next prediction may differ from the
        one made before the read (the rule made a new plan, or a float was read)."""
        row = self._row
        if row is None or not self._recent or not values:
            return False
        self._reads += 1
        if all(type(v) is int for v in values):
            rule = self.rule
            plans = rule.plans if rule is not None else 0
            ints = tuple(int(v) for v in values)
            self._emitted(row, (ints,), indices=True, first=self._reads - 1)
            return rule is not None and rule.plans != plans
        # Only floats: a prediction made at the block's tail never has them, so no row is
        # trained on a value its prediction did not see (the read predicts again).
        row[self._read_at] = float(values[0])
        return True

    def _emitted(
        self, row: list[float], outputs: Outputs, *, indices: bool, first: int = 0
    ) -> None:
        rule = self.rule
        if rule is not None:
            plans = rule.plans
            rule.emitted(self._recent[0], outputs, indices=indices, first=first)
            if rule.plans != plans:
                vec = rule.plan_values
                self._plan_out = tuple(
                    float(vec[i]) if i < len(vec) else _NAN for i in range(PLAN_OUTPUTS)
                )
        self._rule_features(row)

    def _rule_features(self, row: list[float]) -> None:
        at, rule, h = self._rule_at, self.rule, self.horizon
        if rule is not None:
            for j in range(1, h + 1):
                r = rule.ahead(j)
                row[at + j - 1] = float(r) if r != UNKNOWN else _NAN
            row[at + h] = float(rule.left)
        at += h + 1
        row[at : at + PLAN_OUTPUTS] = self._plan_out
        if self._step_out is not None:
            row[at + PLAN_OUTPUTS : at + PLAN_OUTPUTS + STEP_OUTPUTS] = self._step_out

    def end_step(self) -> None:
        """The step's forward is over; retrain when it is time."""
        self._prev_seq, self._step_seq = self._step_seq, []
        self.steps += 1
        if self.rule is not None:
            self.rule.end_step()
        self._plan_out = (_NAN,) * PLAN_OUTPUTS
        self._step_out = None
        due = self.steps >= self.warmup_steps and (
            (self.steps - self.warmup_steps) % self.retrain_every == 0
        )
        if due:
            self._retrain()

    def predict(self) -> Prediction:
        """The next ``horizon`` blocks after the last observed one."""
        # The hot path (once per forward block; budget 10 µs, of which each booster's C call
        # takes ~1.4 µs): the boosters' C call and the answer store are inlined, sources are
        # kept as one int (a base-3 digit per horizon: _SOURCE_NAMES) that also keys the
        # counts, and the Prediction is built as a plain tuple.
        # timed one call in _TIME_EVERY (the median of a sample; a clock read costs ~0.1 µs)
        self._calls = calls = self._calls + 1
        start = _perf_ns() if calls % _TIME_EVERY == 0 else 0
        models, row, h = self._models, self._row, self.horizon
        ids = self.markov.successors()  # Markov's until something better is found
        conf = self._no_conf[:]
        code = 0  # every horizon Markov's
        rule = self.rule
        n = 0
        if rule is not None:
            plan = rule.plan_ahead(h)
            n = len(plan)
            if n:
                ids[:n] = plan
                conf[:n] = self._rule_conf[:n]
                code = self._rule_code[n]
        if n < h and models is not None and row is not None:
            key = self._pack(*row)  # the boosters read these bytes; they key the answers too
            if models is not self._answers_for:
                self._answers.clear()
                self._answers_for = models
            self._answer_lookups += 1
            answers = self._answers.get(key)
            if answers is None:
                if len(self._answers) >= _MAX_ANSWERS:
                    self._answers.clear()
                answers = self._answers[key] = [None] * h
            else:
                self._answer_hits += 1
            threshold, digit = self.threshold, self._digit
            for j in range(n, h):
                a = answers[j]
                if a is None:
                    m = models[j]
                    call = m.call
                    if call is None:
                        a = (m.constant, 1.0)
                    else:  # FastBooster.best_of, inlined
                        c_predict, config, out_len, out_ptr, out, labels = call
                        if c_predict(config, key, out_len, out_ptr):
                            FastBooster.raise_last_error()
                        i = int(out.argmax())  # the first on ties, as best_of
                        a = (labels[i], out.item(i))
                    answers[j] = a
                b, p = a
                if p >= threshold or ids[j] == UNKNOWN:
                    ids[j] = b
                    conf[j] = p
                    code += digit[j]
        made = self._made
        if made and made[-1][0] == self._t - 1:
            made.pop()  # predicted again after a read: the latest prediction is scored
        made.append((self._t - 1, ids))
        counted = self._by_code.get(code + code + (models is not None))
        if counted is None:
            counted = self._count_code(code + code + (models is not None))
        counted[0] += 1
        prediction = _new_prediction(
            (tuple(map(self._names.__getitem__, ids)), counted[1], tuple(conf))
        )
        if start:
            self._latency_ns.append(_perf_ns() - start)
        return prediction

    def _count_code(self, counted: int) -> list[Any]:
        """The [count, source names] entry of ``counted`` (a prediction's source code x 2 +
        whether a model existed), new."""
        entry = self._by_code[counted] = [0, self._sources_of(counted // 2)]
        return entry

    def _sources_of(self, code: int) -> tuple[str, ...]:
        """The source names of a prediction's source code (a base-3 digit per horizon)."""
        return tuple(_SOURCE_NAMES[code // 3**j % 3] for j in range(self.horizon))

    # -- training -----------------------------------------------------------------------------
    def _retrain(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            log.debug("pilot: training still running; skipping this retrain")
            return
        done = list(self._rows)[: max(0, len(self._rows) - self.horizon)]
        done = done[-self.window :]
        if len(done) < 16:
            return
        x = np.array([r for r, _ in done], dtype=np.float64)
        y = np.array([t for _, t in done], dtype=np.int64)
        if self.background:
            self._thread = threading.Thread(
                target=self._train_job, args=(x, y), name="memcompile-pilot", daemon=True
            )
            self._thread.start()
        else:
            self._train_job(x, y)

    def _train_job(self, x: np.ndarray, y: np.ndarray) -> None:
        try:
            models = _train(x, y, self._categorical, self._params, self.rounds, self._rule_at)
        except Exception as e:  # a failed training keeps the previous model
            log.warning("memcompile pilot: training failed (%s); keeping the previous model", e)
            return
        self._models = models  # one assignment: the predicting thread sees old or new
        self.models_trained += 1
        log.debug("pilot: trained on %d rows", len(x))

    def wait(self) -> None:
        """Wait for a training in progress to finish."""
        if self._thread is not None:
            self._thread.join()

    # -- results ------------------------------------------------------------------------------
    @property
    def active(self) -> str:
        return "lightgbm" if self._models is not None else "markov"

    def stats(self) -> PilotStats:
        """Accuracy of the predictions made so far, latency, and which predictor is active."""

        def acc(j: int) -> float | None:
            return self._hits[j] / self._scored[j] if self._scored[j] else None

        lat = sorted(self._latency_ns)
        counts = [
            ((counted % 2 == 1, sources), n)
            for counted, (n, sources) in sorted(self._by_code.items())
        ]
        model_predictions = sum(n for (model, _), n in counts if model)
        fallbacks = sum(n for (model, srcs), n in counts if model and "markov" in srcs)
        horizon_predictions = sum(n * len(srcs) for (_, srcs), n in counts)
        rule_predictions = sum(n * srcs.count("rule") for (_, srcs), n in counts)
        return PilotStats(
            accuracy=acc(0),
            k_ahead_accuracy=acc(self.horizon - 1),
            predictions=self._scored[self.horizon - 1],
            predict_us_p50=lat[len(lat) // 2] / 1000 if lat else None,
            active=self.active,
            fallback_rate=fallbacks / model_predictions if model_predictions else None,
            models_trained=self.models_trained,
            rule_rate=rule_predictions / horizon_predictions if horizon_predictions else None,
            reuse_rate=(self._answer_hits / self._answer_lookups if self._answer_lookups else None),
        )

    # -- files --------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the models as LightGBM text (``h1.txt`` …) and ``meta.json`` (block labels,
        classes, features) into ``directory``.

        Raises:
            RuntimeError: no model has been trained or loaded yet.
        """
        models = self._models
        if models is None:
            raise RuntimeError("Pilot.save: no model yet (train past warmup_steps, or load one)")
        os.makedirs(directory, exist_ok=True)
        meta = {
            "format": _FORMAT,
            "features": list(self.features),
            "horizon": self.horizon,
            "blocks": list(self._labels),
            "classes": [m.classes.tolist() for m in models],
            "rules": self.rule.to_json(self._labels) if self.rule is not None else [],
        }
        for j, m in enumerate(models, 1):
            path = os.path.join(directory, f"h{j}.txt")
            if m.booster is not None:
                m.booster.save_model(path)
            elif os.path.exists(path):
                os.remove(path)  # a constant horizon: no stale booster beside it
        with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)

    def load(self, directory: str | os.PathLike[str]) -> bool:
        """Use the models saved in ``directory``. A missing or corrupt file, or one made for
        other features, warns (:class:`~memcompile.errors.PilotWarning`) and leaves the pilot on
        its current predictor (Markov if none). Returns whether the models were loaded."""
        try:
            models, rules = self._read(os.fspath(directory))
            if self.rule is not None:
                self.rule.load_json(rules, self._ids.__getitem__)
        except (OSError, ValueError, KeyError, TypeError, lgb.basic.LightGBMError) as e:
            warnings.warn(
                f"memcompile pilot: cannot load {os.fspath(directory)!r} ({e}); predicting with "
                f"the {self.active} predictor until a model is trained",
                PilotWarning,
                stacklevel=2,
            )
            return False
        self._models = models
        return True

    def _read(self, directory: str) -> tuple[tuple[_Horizon, ...], Any]:
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format") != _FORMAT:
            raise ValueError(f"meta.json format {meta.get('format')!r}, expected {_FORMAT}")
        if tuple(meta["features"]) != self.features or meta["horizon"] != self.horizon:
            raise ValueError("the model was trained for other features or another horizon")
        # Block ids are features: the saved ones must mean the same blocks here.
        labels = [str(label) for label in meta["blocks"]]
        for i, label in enumerate(labels):
            known = self._labels[i] if i < len(self._labels) else None
            if (known is not None and known != label) or (known is None and label in self._ids):
                raise ValueError(f"block id {i} is {label!r} in the file, {known!r} here")
        for label in labels:
            self.block_id(label)
        models = []
        for j, classes in enumerate(meta["classes"], 1):
            ids = np.asarray(classes, dtype=np.int64)
            if len(ids) == 0 or ids.min() < 0 or ids.max() >= len(labels):
                raise ValueError(f"classes of horizon {j} are not block ids")
            if len(classes) == 1:
                models.append(_Horizon(ids, None))
                continue
            with open(os.path.join(directory, f"h{j}.txt"), encoding="utf-8") as f:
                text = f.read()
            booster = lgb.Booster(model_str=text)
            if booster.num_feature() != len(self.features):
                raise ValueError(f"h{j}.txt has {booster.num_feature()} features")
            models.append(_Horizon(ids, booster))
        if len(models) != self.horizon:
            raise ValueError(f"{len(models)} horizons saved, expected {self.horizon}")
        rules = meta.get("rules", [])
        if not isinstance(rules, list):
            raise ValueError("meta.json rules must be a list")
        return tuple(models), rules
