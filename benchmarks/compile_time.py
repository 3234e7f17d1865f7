"""Compile time of a budgeted zoo workload: the first training step, and the planner's share.

    OMP_NUM_THREADS=1 python benchmarks/compile_time.py [--model gru] [--size small]
        [--budget 14.2MiB] [--steps 1] [--out DIR] [-O KEY=VALUE ...] [--warm]

Runs ``--steps`` training steps of zoo ``--model`` under ``memcompile.compile(budget=...,
on_infeasible="best_effort")`` in this process and times them: the first step compiles (Dynamo,
AOTAutograd, planning, building the rewritten graphs, compiling them). Every call of the planner
(``planner.plan_fragment``) is timed too, with its graph's size, target, techniques and a digest
of the plan it returned (the decisions, both orders, the predicted peak), so two versions of
memcompile can be compared plan for plan as well as in seconds. The default is the zoo GRU
(small) at 14.2 MiB, 0.7x its no-budget predicted peak (``benchmarks/results/peaks_small.md``),
under which its first step (T=96, a 5,000-node joint graph) runs its smallest plan. Results go
to ``benchmarks/results/compile_time.{md,json}``.

``--warm``: the plan cache across runs (``pipeline/plan_cache.py``). Three fresh processes, one
after the other: the first step without a budget, then under the budget with an empty cache
directory (cold), then again with the cache the cold run wrote (warm); the table gives each
one's first step and planner calls.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _digest(plan: Any) -> str:
    """A short hash of what a plan decides and predicts."""
    text = json.dumps(
        [
            [[d.tensor, d.action] for d in plan.decisions],
            list(plan.backward_order),
            list(plan.forward_order),
            plan.predicted_peak,
            plan.feasible,
        ]
    )
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def run(
    model: str,
    size: str,
    budget: int | str | None,
    steps: int,
    options: dict[str, Any],
    *,
    cache: bool = False,
) -> dict:
    """Time ``steps`` budgeted steps of zoo ``model`` and every planner call in them; the plan
    cache across runs only with ``cache`` (else every plan is searched, whatever the user's
    cache directory holds)."""
    import memcompile
    import memcompile.pipeline.search as search
    from memcompile import zoo
    from memcompile.pipeline import features

    calls: list[dict[str, Any]] = []
    plan_fragment = search.plan_fragment

    def timed(joint_model: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        plan = plan_fragment(joint_model, **kwargs)
        calls.append(
            dict(
                nodes=len(joint_model.nodes),
                target=kwargs.get("target"),
                recompute=kwargs.get("recompute", True),
                swap=kwargs.get("swap_tier"),
                seconds=round(time.perf_counter() - start, 3),
                peak=plan.predicted_peak,
                feasible=plan.feasible,
                digest=_digest(plan),
            )
        )
        print(f"  plan {len(calls)}: {calls[-1]}", file=sys.stderr, flush=True)
        return plan

    search.plan_fragment = timed
    try:
        with features.patch(plan_cache=cache):
            wl = zoo.build(model, size=size)
            compiled = memcompile.compile(
                wl.model, budget=budget, on_infeasible="best_effort", **options
            )
            step_seconds = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", memcompile.MemoryBudgetWarning)
                for step in range(steps):
                    start = time.perf_counter()
                    wl.loss(compiled, step).backward()
                    step_seconds.append(round(time.perf_counter() - start, 1))
                    print(f"step {step}: {step_seconds[-1]} s", file=sys.stderr, flush=True)
    finally:
        search.plan_fragment = plan_fragment
    return dict(
        model=model,
        size=size,
        budget=budget,
        options=options,
        step_seconds=step_seconds,
        planner_seconds=round(sum(c["seconds"] for c in calls), 1),
        calls=calls,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gru")
    p.add_argument("--size", default="small")
    p.add_argument("--budget", default="14.2MiB", help="bytes or a size such as 14.2MiB")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("-O", dest="option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--warm", action="store_true", help="no budget, cold and warm plan cache")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from memcompile.cli import CliError, _options

    try:  # as `memcompile plan -O`: values typed alike (true, none, integers)
        options = _options(args.option)
    except CliError as e:
        p.error(f"-O takes KEY=VALUE: {e}")
    budget: int | str | None = (
        None
        if args.budget == "none"
        else int(args.budget)
        if args.budget.isdigit()
        else args.budget
    )
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")

    import memcompile
    from memcompile import zoo

    if args.model not in zoo.names():
        p.error(f"unknown zoo workload {args.model!r}; one of {list(zoo.names())}")
    if args.size not in zoo.SIZES:
        p.error(f"unknown size {args.size!r}; one of {list(zoo.SIZES)}")
    try:
        memcompile.MemConfig.from_options({"budget": budget, **options})
    except (TypeError, ValueError) as e:
        p.error(str(e))

    if args.child:
        result = run(args.model, args.size, budget, args.steps, options, cache=True)
        print("RESULT " + json.dumps(result))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    if args.warm:
        return _warm(args, argv)
    result = run(args.model, args.size, budget, args.steps, options)

    table = [
        "| plan | joint nodes | target B | recompute | swap | seconds | predicted peak B "
        "| feasible | digest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, c in enumerate(result["calls"], 1):
        table.append(
            f"| {k} | {c['nodes']} | {c['target']} | {c['recompute']} | {c['swap'] or '-'} "
            f"| {c['seconds']:.2f} | {c['peak']} | {c['feasible']} | `{c['digest']}` |"
        )
    first = result["step_seconds"][0]
    where = Path(memcompile.__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(where), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    notes = [
        f"memcompile from `{where}`, commit {commit or 'unknown'}",
        f"workload: zoo `{args.model}` ({args.size}), budget {args.budget}, options {options}, "
        'on_infeasible="best_effort"; every plan searched (the plan cache across runs off: '
        "`--warm` measures it)",
        f"first step (compiles): **{first} s**, of it the planner **{result['planner_seconds']} "
        f"s** in {len(result['calls'])} calls"
        + (f"; later steps: {result['step_seconds'][1:]} s" if args.steps > 1 else ""),
    ]
    path = write_results(
        args.out,
        "compile_time",
        title="Compile time of a budgeted step",
        argv=sys.argv[1:] if argv is None else argv,
        notes=notes,
        table=table,
        rows=[result],
    )
    print(f"wrote {path}")
    return 0


def _child(args: argparse.Namespace, budget: str, cache: Path) -> dict[str, Any]:
    """:func:`run` in a fresh process with the plan cache in ``cache``."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"--model={args.model}",
        f"--size={args.size}",
        f"--budget={budget}",
        f"--steps={args.steps}",
        *(f"-O{o}" for o in args.option),
    ]
    env = {**os.environ, "MEMCOMPILE_CACHE_DIR": str(cache), "MEMCOMPILE_PLAN_CACHE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _warm(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--warm``: no budget, cold cache, warm cache; each a fresh process."""
    from machine import write_results

    rows = []
    with tempfile.TemporaryDirectory(prefix="memcompile_plans_") as cache:
        for label, budget in (("no budget", "none"), ("cold", args.budget), ("warm", args.budget)):
            result = _child(args, budget, Path(cache))
            result["run"] = label
            rows.append(result)
            print(f"{label}: first step {result['step_seconds'][0]} s", file=sys.stderr)
    table = [
        "| run | budget | first step s | planner calls | planner s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['run']} | {r['budget'] or '-'} | {r['step_seconds'][0]} | "
            f"{len(r['calls'])} | {r['planner_seconds']} |"
        )
    notes = [
        f"workload: zoo `{args.model}` ({args.size}), budget {args.budget}, options "
        f'{args.option}, on_infeasible="best_effort"',
        "each run a fresh process; cold: an empty plan cache directory; warm: the directory "
        "the cold run wrote (MEMCOMPILE_CACHE_DIR)",
    ]
    path = write_results(
        args.out,
        "compile_time_warm",
        script="compile_time",
        title="Compile time of a budgeted step: the plan cache across runs",
        argv=sys.argv[1:] if argv is None else argv,
        notes=notes,
        table=table,
        rows=rows,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
