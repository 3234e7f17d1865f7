"""Per-prediction latency of the pilot: LightGBM's C fast path vs ``Booster.predict``.

    OMP_NUM_THREADS=1 python benchmarks/pilot_latency.py [--steps 60] [--calls 5000] [--size small]
        [--out DIR]

Collects a block trace of the zoo MoE (``benchmarks/dynamic.py``'s setup: ``small``, batch 1,
8 tokens), trains a :class:`memcompile.dynamic.pilot.Pilot` (horizon 2, default size, with the
blocks' small integer outputs, so the output rule too) on it once, then times:

* ``FastBooster.predict``: ``LGBM_BoosterPredictForMatSingleRowFast`` through ctypes on a
  preallocated row (the pilot's path), each horizon's booster, over the trace's feature rows;
* ``Booster.predict(row, num_threads=1)``: LightGBM's Python API on a 1-row array, horizon 1;
* ``Pilot.predict()``: everything the pilot does per block (rule, both horizons' boosters where
  the rule has no plan, threshold, Markov fallback, labels), live: the trace is replayed a second
  time through the trained pilot (``observe`` with outputs, then a timed ``predict``), so the
  rule's plans are as in use; split into the calls that the rule answered alone and those that
  ran a booster;
* ``MarkovPredictor.predict()``;
* the same live replay for the zoo's early-exit and TreeLSTM (``tiny``, ``--extra-steps`` steps
  each; no output rule applies there, so every call runs the boosters): ``predict()``,
  ``observe()``, and the two together (the pilot's real cost per forward block); then
  ``predict()`` again, interleaved block by block with a pilot of twice the trees (10 rounds
  at learning rate 0.2, the default before 2026-11-23): the machine's speed drifts between
  runs, so compare within one.

Median and p90 of ``time.perf_counter_ns`` per call, after 200 warm-up calls (the live replay:
over every call of the second pass). Writes
``benchmarks/results/pilot_latency.md`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dynamic import collect_trace, forward_stream  # noqa: E402
from machine import describe_machine  # noqa: E402

from memcompile import zoo  # noqa: E402
from memcompile.dynamic.fastpredict import FastBooster  # noqa: E402
from memcompile.dynamic.pilot import Pilot  # noqa: E402


def _time(fn: Callable[[int], object], calls: int) -> tuple[float, float]:
    for i in range(200):
        fn(i)
    ts = np.empty(calls)
    for i in range(calls):
        t = time.perf_counter_ns()
        fn(i)
        ts[i] = time.perf_counter_ns() - t
    return float(np.median(ts)) / 1000, float(np.percentile(ts, 90)) / 1000


def _live(pilots: list[Pilot], stream: list, *, train: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Replay ``stream`` through each of ``pilots``, interleaved block by block (the first to
    go alternates, so a slower or faster stretch of the shared machine falls on all of them;
    ``train``: then join the trainings at the end); per pilot, microseconds per ``observe``
    and per ``predict``."""
    obs: list[list[int]] = [[] for _ in pilots]
    pred: list[list[int]] = [[] for _ in pilots]
    order = list(range(len(pilots)))
    for t, (step, block, fragment, sizes, idioms, outs, *_) in enumerate(stream):
        for k in order if t % 2 == 0 else order[::-1]:
            pilot = pilots[k]
            a = time.perf_counter_ns()
            pilot.observe(block, fragment, sizes, idioms, outputs=outs)
            b = time.perf_counter_ns()
            pilot.predict()
            obs[k].append(b - a)
            pred[k].append(time.perf_counter_ns() - b)
        if t + 1 == len(stream) or stream[t + 1][0] != step:
            for pilot in pilots:
                pilot.end_step()
    if train:
        for pilot in pilots:
            pilot.wait()
    return [
        (np.array(o, dtype=np.float64) / 1000, np.array(q, dtype=np.float64) / 1000)
        for o, q in zip(obs, pred, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--size", default="small", help="zoo MoE size (default: small)")
    ap.add_argument("--extra-steps", type=int, default=60, help="early_exit, treelstm (0: skip)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # "progress I/N TEXT" on stderr: `memcompile bench --suite dynamic` draws its bar from them
    print(f"progress 1/3 collecting a {args.steps}-step MoE trace", file=sys.stderr, flush=True)
    trace, facts = collect_trace(args.steps, size=args.size, batch=1, seq_len=8)
    print("progress 2/3 training the pilot", file=sys.stderr, flush=True)
    stream = forward_stream(trace)
    pilot = Pilot(horizon=2, warmup_steps=args.steps, retrain_every=10_000, seed=0)
    for t, (step, block, fragment, sizes, idioms, outs, *_) in enumerate(stream):
        pilot.observe(block, fragment, sizes, idioms, outputs=outs)
        if t + 1 == len(stream) or stream[t + 1][0] != step:
            pilot.end_step()
    pilot.wait()
    models = pilot._models
    assert models is not None and models[0].booster is not None, "the pilot did not train"
    booster = models[0].booster
    rows = np.array([r for r, _ in pilot._rows], dtype=np.float64)
    n = len(rows)

    def fast_call(fast: FastBooster) -> Callable[[int], object]:
        def call(i: int) -> object:
            fast.row[:] = rows[i % n]
            return fast.predict()

        return call

    def booster_call(i: int) -> object:
        return booster.predict(rows[i % n : i % n + 1], num_threads=1)

    # same answers (probabilities) from both paths
    for i in range(50):
        np.testing.assert_allclose(fast_call(models[0].fast)(i), booster_call(i)[0], rtol=1e-9)
    print("progress 3/3 timing predictions", file=sys.stderr, flush=True)
    results: dict[str, tuple[float, float]] = {}
    for j, m in enumerate(models, 1):
        if m.fast is not None:
            results[
                f"FastBooster.predict, horizon {j} ({m.booster.num_trees()} trees, C fast path)"
            ] = _time(fast_call(m.fast), args.calls)
    results["Booster.predict(row, num_threads=1), horizon 1"] = _time(
        booster_call, min(args.calls, 2000)
    )
    # live: replay the trace again through the trained pilot, timing each predict()
    times: list[int] = []
    observe_ns: list[int] = []
    booster_ran: list[bool] = []
    for t, (step, block, fragment, sizes, idioms, outs, *_) in enumerate(stream):
        start = time.perf_counter_ns()
        pilot.observe(block, fragment, sizes, idioms, outputs=outs)
        observe_ns.append(time.perf_counter_ns() - start)
        start = time.perf_counter_ns()
        p = pilot.predict()
        times.append(time.perf_counter_ns() - start)
        booster_ran.append(any(src != "rule" for src in p.sources))
        if t + 1 == len(stream) or stream[t + 1][0] != step:
            pilot.end_step()
    ts = np.array(times, dtype=np.float64) / 1000
    ran = np.array(booster_ran)

    def pct(x: np.ndarray) -> tuple[float, float]:
        return float(np.median(x)), float(np.percentile(x, 90))

    results["Pilot.predict() live, all calls (2 horizons, features built in observe)"] = pct(ts)
    results[f"... the rule alone ({(~ran).mean():.0%} of calls)"] = pct(ts[~ran])
    results[f"... a booster (or Markov) for a horizon ({ran.mean():.0%} of calls)"] = pct(ts[ran])
    results["Pilot.observe(..., outputs=...) live (features, rule checks)"] = pct(
        np.array(observe_ns, dtype=np.float64) / 1000
    )
    results["Pilot.observe + predict live, per block"] = pct(
        (np.array(observe_ns, dtype=np.float64) + np.array(times, dtype=np.float64)) / 1000
    )
    results["MarkovPredictor.predict()"] = _time(lambda i: pilot.markov.predict(), args.calls)
    extra: list[str] = []
    for name in ("early_exit", "treelstm") if args.extra_steps > 0 else ():
        print(f"progress 3/3 {name}: trace, training, live replay", file=sys.stderr, flush=True)
        wl = zoo.build(name, size="tiny")
        t2, _ = collect_trace(args.extra_steps, size="tiny", batch=0, seq_len=0, workload=wl)
        s2 = forward_stream(t2)
        # the default pilot, and beside it (interleaved) one with twice the trees: the
        # default before 2026-11-23 (10 rounds at learning rate 0.2)
        kw = dict(horizon=2, warmup_steps=args.extra_steps, retrain_every=10_000, seed=0)
        p2, wide = Pilot(**kw), Pilot(**kw, rounds=10, learning_rate=0.2)
        _live([p2, wide], s2, train=True)
        ms = p2._models
        assert ms is not None and wide._models is not None, f"the pilot did not train on {name}"
        ((obs, pred),) = _live([p2], s2, train=False)  # alone: the pilot's own figures
        extra.append(
            f"{name}: {len(s2)} blocks of {args.extra_steps} steps, "
            f"{', '.join(str(m.booster.num_trees() if m.booster else 0) for m in ms)} trees, "
            f"answers reused for {p2.stats().reuse_rate:.0%} of the rows"
        )
        results[f"{name}: Pilot.predict() live (2 horizons, boosters)"] = pct(pred)
        results[f"{name}: Pilot.observe() live"] = pct(obs)
        results[f"{name}: Pilot.observe + predict live, per block"] = pct(obs + pred)
        # then both, as a first replay again (no stored answers), interleaved: each evicts
        # the other's data from the caches, so both are slower than alone
        p2._answers.clear()
        (_, pair), (_, wide_pred) = _live([p2, wide], s2, train=False)
        trees = ", ".join(str(m.booster.num_trees() if m.booster else 0) for m in wide._models)
        results[f"{name}: ... Pilot.predict(), interleaved with the one below"] = pct(pair)
        results[
            f"{name}: ... Pilot.predict() with 10 rounds at 0.2 ({trees} trees), interleaved"
        ] = pct(wide_pred)
    command = "OMP_NUM_THREADS=1 python benchmarks/pilot_latency.py " + " ".join(
        argv or sys.argv[1:]
    )
    machine = describe_machine()
    lines = [
        "# Pilot prediction latency",
        "",
        f"- command: `{command.strip()}`",
        f"- machine: {machine}, torch {torch.__version__}; shared machine, other jobs running",
        f"- date: {datetime.date.today().isoformat()}",
        f"- model: trained on {n} rows of {args.steps} steps of {facts['workload']} (LightGBM "
        f"per horizon on the rows the output rule did not cover); trees = classes x "
        f"{pilot.rounds} rounds ({', '.join(str(len(m.classes)) for m in models)} classes), "
        f"{booster.num_feature()} features; answers reused for "
        f"{pilot.stats().reuse_rate or 0:.0%} of the rows in the live replay",
        *(f"- {e}" for e in extra),
        "- live: the trace replayed a second time through the trained pilot, every call timed",
        "",
        "| call | median us | p90 us |",
        "|---|---|---|",
    ]
    for name, (p50, p90) in results.items():
        lines.append(f"| {name} | {p50:.1f} | {p90:.1f} |")
    lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pilot_latency.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
