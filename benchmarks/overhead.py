"""What memcompile costs without a budget: step time beside eager and ``aot_eager``.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--models gpt,treelstm] [--sizes tiny,small]
        [--rounds 7] [--batches 4] [--out DIR]

The contract says ``budget=None`` lowers the peak only where that costs no time. This measures
the time side on every zoo workload: three copies of the model built from one seed (eager,
``torch.compile(backend="aot_eager")``, ``torch.compile(backend="memcompile")`` with no
options), each warmed up over the batches twice (compiles happen there), then ``--rounds``
rounds, each running every copy over ``--batches`` training steps (``zero_grad``, forward,
backward; no optimizer) one copy after the other, so load from other jobs falls on all three.
Reported: the median over rounds of process CPU time per step, and its ratio to eager's. The
first batch's loss of each compiled copy is checked against eager's (bit for bit) and the
frames Dynamo ran eagerly are counted.

``aot_eager`` is the floor for a backend built on AOTAutograd with eager kernels (Dynamo's
guards, AOTAutograd's runtime wrappers and aten-level graphs): on small graphs called many times
a step (a tree's cells) it is well above eager's own time. memcompile's share is the difference.

Results go to ``benchmarks/results/overhead.{md,json}`` with the command, the machine and the
date.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("eager", "aot_eager", "memcompile")


def _step(model: torch.nn.Module, fn: Callable[..., torch.Tensor], batch: Any) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = fn(*batch)
    loss.backward()
    return loss.detach()


def measure(name: str, size: str, *, rounds: int, batches: int) -> dict[str, Any]:
    """Per-step CPU time of each configuration on zoo ``name`` at ``size``."""
    import memcompile
    from memcompile import zoo

    torch._dynamo.reset()
    wl = zoo.build(name, size=size)
    data = [wl.batch(i) for i in range(batches)]
    copies: dict[str, tuple[torch.nn.Module, Callable[..., torch.Tensor]]] = {}
    for config in CONFIGS:
        model = copy.deepcopy(wl.model)
        fn = model if config == "eager" else torch.compile(model, backend=config)
        copies[config] = (model, fn)
    first: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager frames are counted from the report below
        for config, (model, fn) in copies.items():
            for _ in range(2):
                for i, batch in enumerate(data):
                    torch.manual_seed(i)  # dropout draws the same masks in every copy
                    loss = _step(model, fn, batch)
                    if i == 0:
                        first.setdefault(config, loss)
        times: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for r in range(rounds):
            for config, (model, fn) in copies.items():
                start = time.process_time()
                for batch in data:
                    _step(model, fn, batch)
                times[config].append((time.process_time() - start) / len(data))
            print(f"  {name:10s} {size:6s} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    per_step = {c: statistics.median(t) for c, t in times.items()}
    report = memcompile.report(copies["memcompile"][1])
    return {
        "model": name,
        "size": size,
        "ms_per_step": {c: round(v * 1e3, 3) for c, v in per_step.items()},
        "vs_eager": {c: round(v / per_step["eager"], 3) for c, v in per_step.items()},
        "loss_equal": {c: bool(torch.equal(first[c], first["eager"])) for c in CONFIGS[1:]},
        "fragments": len(report.fragments),
        "eager_frames": len(report.fallbacks),
    }


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model | size | eager ms | aot_eager | memcompile | memcompile vs aot_eager "
        "| loss equal (aot / mc) | fragments | eager frames |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, vs = r["ms_per_step"], r["vs_eager"]
        mine = ms["memcompile"] / ms["aot_eager"]
        equal = "/".join("yes" if r["loss_equal"][c] else "no" for c in CONFIGS[1:])
        out.append(
            f"| {r['model']} | {r['size']} | {ms['eager']:.2f} | {vs['aot_eager']:.2f}x "
            f"| {vs['memcompile']:.2f}x | {mine:.2f}x | {equal} | {r['fragments']} "
            f"| {r['eager_frames']} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    from memcompile import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(zoo.names()))
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batches < 1:
        parser.error("--rounds and --batches must be >= 1")
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(zoo.names()))
    if unknown:
        parser.error(f"unknown zoo workload(s) {unknown}; choose from {', '.join(zoo.names())}")
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in zoo.SIZES]
    if bad or not sizes or not models:
        parser.error(
            f"--models and --sizes need zoo names and sizes ({', '.join(zoo.SIZES)}); "
            f"got models {models}, sizes {sizes}"
        )
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: set OMP_NUM_THREADS=1 (shared machines)", file=sys.stderr)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    rows = []
    for size in sizes:
        for name in models:
            rows.append(measure(name, size, rounds=args.rounds, batches=args.batches))
            print(_table(rows[-1:])[-1], flush=True)
    write_results(
        args.out,
        "overhead",
        title="Step time without a budget: memcompile beside eager and aot_eager",
        argv=argv if argv is not None else sys.argv[1:],
        notes=[
            f"time: median over {args.rounds} rounds of process CPU time per training step "
            f"(zero_grad, forward, backward; {args.batches} batches a round, the three copies "
            "one after the other in each round); columns after the first: ratio to eager's",
            "memcompile vs aot_eager: memcompile's own share (aot_eager is AOTAutograd with the "
            "same eager kernels, and no budget work)",
        ],
        table=_table(rows),
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
