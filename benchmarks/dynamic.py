"""Pilot accuracy on the zoo MoE's block traces: LightGBM vs Markov vs replaying the last step.

    OMP_NUM_THREADS=1 python benchmarks/dynamic.py [--steps 300] [--size small] [--batch 1]
        [--seq-len 8] [--horizon 3] [--warmup 10] [--retrain-every 10] [--out DIR]

Trains the zoo MoE (``moe_workload(size, batch=…, seq_len=…)``: the model's own router on the
zoo's structured topic stream; few tokens per step, so some experts idle and the block sequence
changes from step to step) under ``memcompile.compile(trace_path=…)`` with Adam for ``--steps``
steps, reads the block trace back, and replays its forward/inference block stream through each
predictor online, in order:

* ``pilot``: :class:`memcompile.dynamic.pilot.Pilot` as memcompile would run it: LightGBM once
  trained, the Markov prediction where LightGBM's probability is under 0.5;
* ``lightgbm``: the same with no threshold (LightGBM's prediction wherever it has one);
* ``markov``: the last-successor predictor;
* ``replay``: the block at the same position of the previous step (wrapping into its start).

The pilot retrains every ``--retrain-every`` steps after ``--warmup`` steps; here the training
thread is joined at the step's end, so the swap point (and the figures) are deterministic. Every
predictor is scored on the same predictions: those made from step ``--warmup`` on, at horizons
1..``--horizon`` (``k``-ahead accuracy: the block ``k`` calls ahead is exactly the predicted one).
The backward order is not predicted (the reverse of the forward's). Writes
``benchmarks/results/dynamic.{md,json}`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import describe_machine  # noqa: E402

import memcompile  # noqa: E402
from memcompile.dynamic.markov import UNKNOWN, MarkovPredictor  # noqa: E402
from memcompile.dynamic.pilot import Pilot  # noqa: E402
from memcompile.dynamic.trace import StepTrace, read_trace  # noqa: E402
from memcompile.report import find_compiler  # noqa: E402
from memcompile.zoo.moe import moe_workload  # noqa: E402

Outputs = tuple[tuple[int, ...], ...]
Stream = list[tuple[int, str, str, tuple[int, ...], tuple[int, ...] | None, Outputs]]


def collect_trace(
    steps: int, *, size: str, batch: int, seq_len: int, seed: int = 0
) -> tuple[list[StepTrace], dict[str, Any]]:
    """Train the MoE under memcompile for ``steps`` steps; its block trace and run facts."""
    torch._dynamo.reset()
    wl = moe_workload(size, seed, batch=batch, seq_len=seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "moe.jsonl")
        compiled = memcompile.compile(wl.model, trace_path=path)
        opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
        start = time.perf_counter()
        for step in range(steps):
            wl.loss(compiled, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        compiler, _ = find_compiler(compiled)
        (recorder,) = compiler.block_observers
        recorder.flush()  # type: ignore[attr-defined]
        trace = read_trace(path)
    facts = {
        "workload": wl.summary,
        "train_seconds": round(seconds, 1),
        "fragments": len(compiler.records()),
        "eager_fallbacks": len(compiler.fallbacks),
    }
    return trace, facts


def forward_stream(trace: list[StepTrace]) -> Stream:
    """(step index, block, fragment, sizes, fragment idioms, small integer outputs) of every
    non-backward call."""
    out: Stream = []
    for i, s in enumerate(trace):
        idioms = dict(s.idioms)
        for e in s.events:
            if e.phase != "backward":
                out.append((i, e.block, e.fragment, e.sizes, idioms.get(e.fragment), e.outputs))
    return out


def run_pilot(
    stream: Stream,
    horizon: int,
    warmup: int,
    every: int,
    threshold: float,
    *,
    outputs: bool = True,
    **options: Any,
) -> tuple:
    """Replay ``stream`` through a pilot; ``outputs=False``: without the outputs (and rule)."""
    pilot = Pilot(
        horizon=horizon,
        warmup_steps=warmup,
        retrain_every=every,
        threshold=threshold,
        seed=0,
        rule=outputs,
        **options,
    )
    preds: list[tuple[str | None, ...]] = []
    for t, (step, block, fragment, sizes, idioms, outs) in enumerate(stream):
        pilot.observe(block, fragment, sizes, idioms, outputs=outs if outputs else None)
        preds.append(pilot.predict().blocks)
        if t + 1 == len(stream) or stream[t + 1][0] != step:
            pilot.end_step()
            pilot.wait()  # deterministic swap point (see the module docstring)
    return preds, pilot.stats()


def run_markov(stream: Stream, horizon: int) -> list[tuple[str | None, ...]]:
    m = MarkovPredictor(horizon)
    ids: dict[str, int] = {}
    labels: list[str] = []
    preds = []
    for _, block, *_rest in stream:
        if block not in ids:
            ids[block] = len(labels)
            labels.append(block)
        m.observe(ids[block])
        preds.append(tuple(labels[i] if i != UNKNOWN else None for i in m.predict()))
    return preds


def run_replay(stream: Stream, horizon: int) -> list[tuple[str | None, ...]]:
    by_step: dict[int, list[str]] = {}
    for step, block, *_rest in stream:
        by_step.setdefault(step, []).append(block)
    preds = []
    pos = 0
    for t, (step, *_rest) in enumerate(stream):
        pos = pos + 1 if t and stream[t - 1][0] == step else 0
        prev = by_step.get(step - 1)
        if not prev:
            preds.append((None,) * horizon)
            continue
        preds.append(tuple(prev[(pos + j) % len(prev)] for j in range(1, horizon + 1)))
    return preds


def score(stream: Stream, preds: list, horizon: int, first_step: int) -> list[float]:
    """Accuracy at each horizon over predictions made from step ``first_step`` on."""
    out = []
    for j in range(1, horizon + 1):
        made = [t for t in range(len(stream) - j) if stream[t][0] >= first_step]
        hits = sum(preds[t][j - 1] == stream[t + j][1] for t in made)
        out.append(hits / len(made) if made else float("nan"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--horizon", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--retrain-every", type=int, default=10)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trace, facts = collect_trace(args.steps, size=args.size, batch=args.batch, seq_len=args.seq_len)
    stream = forward_stream(trace)
    h = args.horizon
    pilot_preds, pilot_stats = run_pilot(stream, h, args.warmup, args.retrain_every, 0.5)
    lgbm_preds, lgbm_stats = run_pilot(stream, h, args.warmup, args.retrain_every, 0.0)
    results = {
        "pilot": score(stream, pilot_preds, h, args.warmup),
        "lightgbm": score(stream, lgbm_preds, h, args.warmup),
        "markov": score(stream, run_markov(stream, h), h, args.warmup),
        "replay": score(stream, run_replay(stream, h), h, args.warmup),
    }
    per_step = [len(s.blocks("forward", "inference")) for s in trace]
    facts.update(
        steps=len(trace),
        distinct_blocks=len({b for _, b, *_ in stream}),
        distinct_step_sequences=len({s.blocks("forward", "inference") for s in trace}),
        forward_blocks_per_step=round(sum(per_step) / len(per_step), 1),
        scored_predictions=sum(1 for t in range(len(stream) - 1) if stream[t][0] >= args.warmup),
        pilot=pilot_stats.to_dict(),
        lightgbm_only=lgbm_stats.to_dict(),
    )
    command = "OMP_NUM_THREADS=1 python benchmarks/dynamic.py " + " ".join(argv or sys.argv[1:])
    machine = describe_machine()
    date = datetime.date.today().isoformat()
    lines = [
        "# Pilot accuracy on the zoo MoE's block traces",
        "",
        f"- command: `{command.strip()}`",
        f"- machine: {machine}, torch {torch.__version__}",
        f"- date: {date}",
        f"- workload: {facts['workload']}; {facts['steps']} Adam steps under memcompile "
        f"({facts['train_seconds']} s), {facts['fragments']} fragments, "
        f"{facts['eager_fallbacks']} eager fallbacks",
        f"- stream: {facts['forward_blocks_per_step']} forward blocks per step, "
        f"{facts['distinct_blocks']} distinct blocks, {facts['distinct_step_sequences']} distinct "
        f"step sequences in {facts['steps']} steps",
        f"- scored: predictions made from step {args.warmup} on "
        f"({facts['scored_predictions']} at horizon 1); the pilot trains after {args.warmup} "
        f"steps, then every {args.retrain_every}",
        "",
        "| predictor | " + " | ".join(f"{j}-ahead" for j in range(1, h + 1)) + " |",
        "|---|" + "---|" * h,
    ]
    for name, accs in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in accs) + " |")
    ps = pilot_stats
    lines += [
        "",
        f"pilot (threshold 0.5): {ps.models_trained} trainings, Markov fallback in "
        f"{ps.fallback_rate:.1%} of predictions, Pilot.predict median {ps.predict_us_p50:.1f} us "
        f"({h} horizons, features included)",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dynamic.md").write_text("\n".join(lines))
    payload = {"command": command, "machine": machine, "date": date, "facts": facts}
    payload["accuracy"] = results
    (args.out / "dynamic.json").write_text(json.dumps(payload, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
