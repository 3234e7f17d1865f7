"""Pilot accuracy on the zoo MoE's block traces: LightGBM vs Markov vs replaying the last step.

    OMP_NUM_THREADS=1 python benchmarks/dynamic.py [--steps 300] [--size small] [--batch 1]
        [--seq-len 8] [--horizon 3] [--warmup 10] [--retrain-every 10] [--extra-steps 100]
        [--natural-steps 150] [--out DIR]

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
The backward order is not predicted (the reverse of the forward's). Then the same on the
early-exit and TreeLSTM zoo models (tiny, ``--extra-steps``) and on the MoEs written the natural
way (``moe_natural``, ``moe_natural_top2``, ``early_exit_natural`` at ``--size``,
``--natural-steps``: Python routes with ``int(argmax)`` / ``tolist()`` and exits on
``conf.item()``, and the pilot sees those numbers, runtime/scalar_reads.py). Writes
``benchmarks/results/dynamic.{md,json}`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import describe_machine  # noqa: E402

import memcompile  # noqa: E402
from memcompile import zoo  # noqa: E402
from memcompile.dynamic.markov import UNKNOWN, MarkovPredictor  # noqa: E402
from memcompile.dynamic.pilot import Pilot  # noqa: E402
from memcompile.dynamic.trace import StepTrace, read_trace  # noqa: E402
from memcompile.report import find_compiler  # noqa: E402
from memcompile.zoo.moe import moe_workload  # noqa: E402

Outputs = tuple[tuple[int, ...], ...]
Stream = list[tuple[int, str, str, tuple[int, ...], tuple[int, ...] | None, Outputs, Outputs]]


def progress_ticks(steps: int, parts: int = 10) -> list[int]:
    """The steps (1-based) after which training reports progress: about ``parts`` of them."""
    every = max(1, -(-steps // parts))
    return sorted({*range(every, steps + 1, every), steps})


def collect_trace(
    steps: int,
    *,
    size: str,
    batch: int,
    seq_len: int,
    seed: int = 0,
    workload: Any = None,
    on_tick: Callable[[int], None] | None = None,
) -> tuple[list[StepTrace], dict[str, Any]]:
    """Train the MoE (or ``workload``) under memcompile for ``steps`` steps; its block trace and
    run facts. ``on_tick(done)`` is called after each step of :func:`progress_ticks`."""
    torch._dynamo.reset()
    wl = (
        workload if workload is not None else moe_workload(size, seed, batch=batch, seq_len=seq_len)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "moe.jsonl")
        compiled = memcompile.compile(wl.model, trace_path=path)
        opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
        start = time.perf_counter()
        ticks = set(progress_ticks(steps))
        for step in range(steps):
            wl.loss(compiled, step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on_tick is not None and step + 1 in ticks:
                on_tick(step + 1)
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
    """(step index, block, fragment, sizes, fragment idioms, small integer outputs, the ints
    Python read after it) of every non-backward call."""
    out: Stream = []
    for i, s in enumerate(trace):
        idioms = dict(s.idioms)
        for e in s.events:
            if e.phase != "backward":
                out.append(
                    (i, e.block, e.fragment, e.sizes, idioms.get(e.fragment), e.outputs, e.reads)
                )
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
    """Replay ``stream`` through a pilot; ``outputs=False``: without the outputs and reads
    (and rule)."""
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
    for t, (step, block, fragment, sizes, idioms, outs, reads) in enumerate(stream):
        pilot.observe(block, fragment, sizes, idioms, outputs=outs if outputs else None)
        for values in reads if outputs else ():
            pilot.observe_read(values)  # scored: the prediction made after the last read
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


def _compare(stream: Stream, h: int, warmup: int, every: int) -> tuple[dict, dict]:
    """Accuracy per predictor at horizons 1..h, and the pilots' stats."""
    pilot_preds, pilot_stats = run_pilot(stream, h, warmup, every, 0.5)
    lgbm_preds, lgbm_stats = run_pilot(stream, h, warmup, every, 0.0)
    plain_preds, plain_stats = run_pilot(stream, h, warmup, every, 0.5, outputs=False)
    results = {
        "pilot": score(stream, pilot_preds, h, warmup),
        "pilot, no threshold": score(stream, lgbm_preds, h, warmup),
        "pilot without outputs": score(stream, plain_preds, h, warmup),
        "markov": score(stream, run_markov(stream, h), h, warmup),
        "replay": score(stream, run_replay(stream, h), h, warmup),
    }
    stats = {
        "pilot": pilot_stats.to_dict(),
        "pilot, no threshold": lgbm_stats.to_dict(),
        "pilot without outputs": plain_stats.to_dict(),
    }
    return results, stats


def _stream_facts(trace: list[StepTrace], stream: Stream) -> dict[str, Any]:
    seqs = [s.blocks("forward", "inference") for s in trace]
    return {
        "steps": len(trace),
        "distinct_blocks": len({b for _, b, *_ in stream}),
        "distinct_step_sequences": len(set(seqs)),
        # periodic: a step repeats the one before it (replay would be exact)
        "steps_repeating_the_previous": sum(a == b for a, b in itertools.pairwise(seqs)),
        "forward_blocks_per_step": round(sum(map(len, seqs)) / len(seqs), 1),
        "events_with_outputs": sum(1 for *_, outs, _reads in stream if outs),
        "events_with_reads": sum(1 for *_, reads in stream if reads),
    }


def _table(results: dict[str, list[float]], h: int) -> list[str]:
    lines = [
        "| predictor | " + " | ".join(f"{j}-ahead" for j in range(1, h + 1)) + " |",
        "|---|" + "---|" * h,
    ]
    for name, accs in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f}" for a in accs) + " |")
    return lines


def _pilot_line(name: str, st: dict[str, Any], h: int) -> str:
    fb = st["fallback_rate"]
    return (
        f"- {name}: {st['models_trained']} trainings, rule made {st['rule_rate']:.1%} of the "
        f"per-horizon predictions, Markov fallback in "
        f"{'n/a' if fb is None else f'{fb:.1%}'} of predictions, Pilot.predict median "
        f"{st['predict_us_p50']:.1f} us ({h} horizons, features included)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=8)
    ap.add_argument("--horizon", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--retrain-every", type=int, default=10)
    ap.add_argument("--extra-steps", type=int, default=100, help="early_exit, treelstm (0: skip)")
    ap.add_argument(
        "--natural-steps",
        type=int,
        default=150,
        help="the natural MoEs and early exit at --size: what their Python reads (0: skip)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error(
            f"--steps ({args.steps}) must be more than --warmup ({args.warmup}): "
            "nothing would be scored"
        )
    torch.set_num_threads(1)
    # "progress I/N TEXT" on stderr: `memcompile bench --suite dynamic` draws its bar from them
    # (zoo name, size, steps): the natural models decide in Python (int(argmax), tolist(),
    # conf.item()): their pilot learns from the numbers read (runtime/scalar_reads.py)
    extras = [(n, "tiny", args.extra_steps) for n in ("early_exit", "treelstm")]
    natural = ("moe_natural", "moe_natural_top2", "early_exit_natural")
    extras += [(n, args.size, args.natural_steps) for n in natural]
    extras = [e for e in extras if e[2] > 0]
    total = len(progress_ticks(args.steps)) + 1 + 2 * len(extras)
    done = 0

    def report(text: str) -> None:
        nonlocal done
        done += 1
        print(f"progress {done}/{total} {text}", file=sys.stderr, flush=True)

    trace, facts = collect_trace(
        args.steps,
        size=args.size,
        batch=args.batch,
        seq_len=args.seq_len,
        on_tick=lambda n: report(f"trained {n}/{args.steps} MoE steps"),
    )
    stream = forward_stream(trace)
    h = args.horizon
    results, stats = _compare(stream, h, args.warmup, args.retrain_every)
    report("MoE predictors replayed")
    facts.update(_stream_facts(trace, stream))
    facts["scored_predictions"] = sum(
        1 for t in range(len(stream) - 1) if stream[t][0] >= args.warmup
    )
    facts["pilots"] = stats
    extra: dict[str, Any] = {}
    for name, size, steps in extras:
        wl = zoo.build(name, size=size)
        t2, f2 = collect_trace(steps, size=size, batch=0, seq_len=0, workload=wl)
        f2["size"] = size
        report(f"trained {steps} {name} steps")
        s2 = forward_stream(t2)
        r2, st2 = _compare(s2, h, args.warmup, args.retrain_every)
        report(f"{name} predictors replayed")
        f2.update(_stream_facts(t2, s2))
        extra[name] = {"facts": f2, "accuracy": r2, "pilots": st2}
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
        f"step sequences in {facts['steps']} steps, {facts['steps_repeating_the_previous']} steps "
        f"repeat the previous one (not periodic); {facts['events_with_outputs']} forward calls "
        f"with small integer outputs, {facts['events_with_reads']} followed by numbers Python "
        "read (runtime/scalar_reads.py)",
        f"- scored: predictions made from step {args.warmup} on "
        f"({facts['scored_predictions']} at horizon 1), after the block's outputs are seen; the "
        f"pilot trains after {args.warmup} steps, then every {args.retrain_every}",
        "- pilot: output rule (rules.py) where it has a plan, else LightGBM, else Markov below "
        "probability 0.5; no threshold: LightGBM wherever the rule has no plan; without "
        "outputs: the pilot before the rule (no outputs or reads given, no rule)",
        "",
        *_table(results, h),
        "",
        *(_pilot_line(n, st, h) for n, st in stats.items()),
        "",
    ]
    for name, e in extra.items():
        f2 = e["facts"]
        lines += [
            f"## {name} ({f2['size']}, {f2['steps']} steps)",
            "",
            f"- workload: {f2['workload']}; {f2['fragments']} fragments, "
            f"{f2['eager_fallbacks']} eager fallbacks",
            f"- stream: {f2['forward_blocks_per_step']} forward blocks per step, "
            f"{f2['distinct_blocks']} distinct blocks, {f2['distinct_step_sequences']} distinct "
            f"step sequences, {f2['steps_repeating_the_previous']} steps repeat the previous one; "
            f"{f2['events_with_outputs']} forward calls with small integer outputs, "
            f"{f2['events_with_reads']} followed by numbers Python read",
            "",
            *_table(e["accuracy"], h),
            "",
            *(_pilot_line(n, st, h) for n, st in e["pilots"].items()),
            "",
        ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dynamic.md").write_text("\n".join(lines))
    payload = {"command": command, "machine": machine, "date": date, "facts": facts}
    payload["accuracy"] = results
    payload["extra"] = extra
    (args.out / "dynamic.json").write_text(json.dumps(payload, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
