"""Lowest budget a multi-fragment zoo model fits after re-planning, as a fraction of its
unplanned peak.

    OMP_NUM_THREADS=1 python benchmarks/replan_sweep.py [--model moe] [--fractions 0.95,0.9]
        [--steps 4] [--out DIR]

The unplanned peak: one step of the tiny model under memcompile without a budget, measured
(``memcompile.measure_peak``, parameters and the batch added). Then, one process per fraction
(the CPU profiler counts from its own start), ``--steps`` SGD steps under ``budget = fraction *
unplanned`` next to eager: losses and parameters compared bit for bit, the
``MemoryBudgetWarning`` s counted, and one more step measured. A fraction *fits* when no
warning came, the step's prediction is within the budget and the measured peak too. A dynamic
model's steps differ (a tree's size): the figures are the last step's, which may fit where an
earlier step was warned about; *warned at* gives the peaks the warnings predicted. Writes
``benchmarks/results/replan_sweep_<model>.{md,json}`` with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _measure(wl: Any, compiled: Any) -> int:
    import memcompile

    wl.model.zero_grad(set_to_none=True)
    batch = wl.batch(4)
    return memcompile.measure_peak(lambda: compiled(*batch).backward(), resident=[wl.model, batch])


def unplanned(name: str) -> int:
    """Measured peak of one step of ``name`` (tiny) under memcompile without a budget."""
    import memcompile
    from memcompile import zoo

    wl = zoo.build(name, size="tiny")
    compiled = memcompile.compile(wl.model)
    wl.train(compiled, 1)
    return _measure(wl, compiled)


def one(name: str, budget: int, steps: int) -> dict[str, Any]:
    """Train ``name`` under ``budget`` next to eager; what came of it."""
    import memcompile
    from memcompile import MemoryBudgetWarning, zoo

    eager, comp = zoo.build(name, size="tiny"), zoo.build(name, size="tiny")
    eager_losses = eager.train(eager.model, steps)
    compiled = memcompile.compile(comp.model, budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = comp.train(compiled, steps)
        measured = _measure(comp, compiled)
    same = all(torch.equal(a, b) for a, b in zip(eager_losses, losses, strict=True))
    sa, sb = eager.model.state_dict(), comp.model.state_dict()
    same = same and all(torch.equal(sa[k], sb[k]) for k in sa)
    rep = memcompile.report(compiled)
    budget_warnings = [
        str(w.message) for w in caught if issubclass(w.category, MemoryBudgetWarning)
    ]
    return {
        "budget": budget,
        "predicted": rep.predicted_peak,
        "measured": measured,
        "bit_identical": same,
        "warnings": len(budget_warnings),
        "warned": budget_warnings,
        "rounds": len(rep.replans),
        "caps": [  # (none before saved caps existed: the sweep also runs on older trees)
            {
                f: c
                for f, c in zip(r.fragments, getattr(r, "saved_cap", ()), strict=False)
                if c is not None
            }
            for r in rep.replans
        ],
        # Per round: it put the step's parameters on the host (and set no caps).
        "host_rounds": [getattr(r, "host_params", False) for r in rep.replans],
        "fits": not budget_warnings
        and rep.predicted_peak is not None
        and rep.predicted_peak <= budget
        and measured <= budget,
    }


def _warned_at(messages: list[str]) -> str:
    """The peaks the budget warnings predicted (``"predicted to peak at 77.68 KiB"``)."""
    found = (re.search(r"predicted to peak at ([0-9.]+ [KMG]?i?B)", m) for m in messages)
    return ", ".join(f[1] for f in found if f) or "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="moe")
    p.add_argument("--fractions", default="0.95,0.92,0.9,0.85,0.8,0.78,0.75,0.7")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: this budget only
    p.add_argument("--unplanned", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.unplanned:
        print(json.dumps(unplanned(args.model)))
        return 0
    if args.one is not None:
        print(json.dumps(one(args.model, args.one, args.steps)))
        return 0

    def child(*extra: str) -> Any:
        cmd = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps)]
        out = subprocess.run([*cmd, *extra], check=True, capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    full = child("--unplanned")
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        row = {"fraction": fraction, **child("--one", str(int(full * fraction)))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    fitting = [r["fraction"] for r in rows if r["fits"]]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe_machine

    command = "OMP_NUM_THREADS=1 python benchmarks/replan_sweep.py " + " ".join(sys.argv[1:])
    result = {
        "command": command.strip(),
        "machine": describe_machine(),
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "unplanned": full,
        "lowest_fitting": min(fitting) if fitting else None,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"replan_sweep_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Re-planning sweep: {args.model} (tiny), unplanned peak {full:,} B measured",
        "",
        f"`{result['command']}` on {result['machine']}, {result['date']}. Lowest fraction "
        f"that fits (no warning, predicted and measured within the budget): "
        f"{result['lowest_fitting']}.",
        "",
        "| fraction | budget B | predicted B | measured B | rounds | warnings | warned at "
        "| bit-identical | fits | saved caps (last round) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        caps = ", ".join(f"{f} <= {c:,}" for f, c in (r["caps"][-1] if r["caps"] else {}).items())
        if r.get("host_rounds", [False])[-1:] == [True]:  # the last round was the host round
            caps = "none: parameters to the host"
        lines.append(
            f"| {r['fraction']} | {r['budget']:,} | {r['predicted']:,} | {r['measured']:,} | "
            f"{r['rounds']} | {r['warnings']} | {_warned_at(r.get('warned', []))} | "
            f"{r['bit_identical']} | {r['fits']} | {caps} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
