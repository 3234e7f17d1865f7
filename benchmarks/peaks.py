"""Predicted vs measured device peak of one training step, for every zoo workload.

    OMP_NUM_THREADS=1 python benchmarks/peaks.py [--size small] [--workloads gpt,moe] [--out DIR]
        [--budgets 0.7,0.4]

Each workload runs in its own process (the CPU profiler and Dynamo's caches are per process):
build at ``--size``, compile with memcompile (no budget: eager's saved set, eager inner compiler),
train 3 warm-up steps, set gradients to None, then measure a step on the last warm-up batch (so
nothing compiles inside the measurement) with the CPU profiler and
compare with ``memcompile.report(...).predicted_peak``. Eager PyTorch's measured peak of the same
step (a separate process) is shown beside it. With ``--budgets``, each workload also runs under
budgets of those fractions of its no-budget predicted peak (``on_infeasible="best_effort"``: a
plan that cannot fit runs its smallest one), predicted vs measured again. Results go to
``benchmarks/results/peaks_<size>.{md,json}`` with the command, the machine and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from machine import write_results

RESULTS = Path(__file__).resolve().parent / "results"
#: Steps measured at most until one compiles nothing (a re-plan compiles in the next step).
SETTLE_TRIES = 4


def run_one(name: str, size: str, mode: str, budget: int | None = None) -> dict[str, Any]:
    """Measure one workload in this process (``mode``: memcompile or eager; ``budget``: bytes,
    memcompile only)."""
    import torch

    import memcompile
    from memcompile import zoo
    from memcompile.runtime.measure import measure

    torch.manual_seed(0)
    wl = zoo.build(name, size=size, seed=0)
    options: dict[str, Any] = {}
    if budget is not None:
        options = {"budget": budget, "on_infeasible": "best_effort"}
    model = memcompile.compile(wl.model, **options) if mode == "memcompile" else wl.model
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.01)
    for step in range(3):
        wl.loss(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # Measure a batch the model has already run: a new shape would compile inside the measurement.
    # And a step that compiles nothing: a re-plan decided after one step compiles in the next,
    # which then runs half the old plans and half the new.
    batch = wl.batch(2)
    stats = torch._dynamo.utils.counters["stats"]
    for tries in range(1, SETTLE_TRIES + 1):
        measured_step = 3 + tries
        before = stats["unique_graphs"]
        m = measure(lambda: model(*batch).backward(), resident=[wl.model, batch])
        opt.zero_grad(set_to_none=True)
        if stats["unique_graphs"] == before:
            break
    out: dict[str, Any] = {
        "workload": name,
        "mode": mode,
        "measured_peak": m.peak,
        "resident": m.resident_bytes,
        "budget": budget,
        "settled": stats["unique_graphs"] == before,
        "measured_step": measured_step,
    }
    if mode == "memcompile":
        rep = memcompile.report(model)
        out.update(
            predicted_peak=rep.predicted_peak,
            exact=rep.exact,
            fragments=len(rep.fragments),
            step_calls=len(rep.step),
            fallbacks=len(rep.fallbacks),
            over_budget=rep.over_budget,
            per_fragment=[
                {
                    "fragment": f.name,
                    "predicted": f.predicted_peak,
                    "measured": max(
                        (v for k, v in m.ranges.items() if k.startswith(f"memcompile:{f.name}:")),
                        default=None,
                    ),
                }
                for f in rep.fragments
            ],
        )
    return out


def _subprocess(name: str, size: str, mode: str, budget: int | None = None) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--one", name, "--size", size, "--mode", mode]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"workload": name, "mode": mode, "error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _peaks(row: dict[str, Any]) -> str:
    """The predicted, measured and error cells of a memcompile row."""
    predicted, measured = row["predicted_peak"], row["measured_peak"]
    err = 100.0 * (predicted - measured) / measured
    return f"{_mib(predicted)} | {_mib(measured)} | {err:+.2f}%"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="small")
    p.add_argument("--workloads", default="")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--budgets",
        default="",
        help="comma-separated fractions of each workload's no-budget predicted peak to plan for",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="memcompile", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.size, args.mode, args.budget)))
        return
    try:
        fractions = [float(f) for f in args.budgets.split(",") if f]
    except ValueError:
        p.error(f"--budgets takes comma-separated fractions, e.g. 0.7,0.4; got {args.budgets!r}")
    if any(not 0 < f <= 1 for f in fractions):
        p.error(f"--budgets fractions must be in (0, 1]; got {args.budgets!r}")

    from memcompile import zoo

    names = [n for n in args.workloads.split(",") if n] or list(zoo.names())
    rows = []
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        mc, eager = (
            _subprocess(name, args.size, "memcompile"),
            _subprocess(name, args.size, "eager"),
        )
        budgeted = []
        base = mc.get("predicted_peak")
        for f in fractions if base else []:
            print(f"{name} at {f:g}x ...", file=sys.stderr, flush=True)
            row = _subprocess(name, args.size, "memcompile", budget=int(f * base))
            budgeted.append({**row, "fraction": f})
        rows.append({"memcompile": mc, "eager": eager, "budgets": budgeted})

    note = (
        "measured: CPU profiler (`memcompile.measure_peak`), absolute (resident parameters, "
        "buffers, inputs + peak above them), in the first step after 3 training steps that "
        f"compiles nothing (at most {SETTLE_TRIES} tries); one process per row and mode; "
        + ("first table: " if fractions else "")
        + "no budget (memcompile keeps eager's saved set)"
    )
    lines = [
        "| workload | fragments | calls/step | predicted MiB | measured MiB | error | exact model "
        "| eager measured MiB | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mc, eg = r["memcompile"], r["eager"]
        if "error" in mc:
            lines.append(f"| {mc['workload']} | error: {mc['error']} | | | | | | | |")
            continue
        lines.append(
            f"| {mc['workload']} | {mc['fragments']} | {mc['step_calls']} | {_peaks(mc)} "
            f"| {'yes' if mc['exact'] else 'no (estimate)'} | "
            f"{_mib(eg.get('measured_peak'))} | {mc['fallbacks']} |"
        )
    if fractions:
        lines += [
            "",
            "## Under budgets",
            "",
            "Budget: the fraction of the workload's no-budget predicted peak above, in bytes; "
            "`on_infeasible='best_effort'` (a plan that cannot fit runs its smallest one and "
            "says so: *over*).",
            "",
            "| workload | budget | budget MiB | predicted MiB | measured MiB | error | over |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            for b in r["budgets"]:
                if "error" in b:
                    lines.append(f"| {b['workload']} | {b['fraction']:g}x | error: {b['error']} |")
                    continue
                notes = ["over"] if b["over_budget"] else []
                if not b.get("settled", True):  # every try compiled: a transitional step
                    notes.append(f"still compiling in step {b['measured_step']}")
                lines.append(
                    f"| {b['workload']} | {b['fraction']:g}x | {_mib(b['budget'])} | {_peaks(b)} "
                    f"| {', '.join(notes)} |"
                )
    write_results(
        args.out,
        f"peaks_{args.size}",
        script="peaks",
        title=f"Predicted vs measured step peak (size `{args.size}`)",
        argv=sys.argv[1:],
        notes=[note],
        table=lines,
        rows=rows,
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
