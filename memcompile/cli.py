"""The ``memcompile`` command (also ``python -m memcompile``).

    memcompile demo [--workload gpt] [--size small] [--steps 3] [--budget 60%]
                                                         # eager, then memcompile in a budget
    memcompile inspect TARGET [--budget B]               # fragments, peaks, plans, fallbacks
    memcompile plan TARGET --budget B -o plan.json       # the plan, with what draw/timeline need
    memcompile draw TARGET|plan.json -o plan.svg         # graphviz: nodes coloured by decision
        [--compact|--full]                               # runs of nodes (default when large)
    memcompile timeline TARGET|plan.json -o step.png     # live bytes before/after, budget line
    memcompile bench [--suite anchors|dynamic|all] [--quick] [--dry-run]

TARGET is a zoo workload name (``--size tiny|small|bench``, default tiny) or ``module:function``
returning ``(model, batch)`` or ``(model, batch, loss)`` (see ``memcompile/cli_target.py``).
A budget is bytes (``1500000``), a size (``"1.5MiB"``) or a percentage of the step's allocations
without a plan (``"70%"``, see ``memcompile/viz/capture.py``). ``draw`` and ``timeline`` read a
``plan.json`` written by ``plan`` without recompiling (``memcompile/viz/snapshot.py``).

Every command takes ``--json`` (one JSON object on stdout). Errors print one line on stderr and
exit with status 1 (``-v`` adds the traceback of unexpected ones). Tables are rich on a terminal
when rich is installed and plain text otherwise; ``NO_COLOR`` is respected.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 1."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _pct(pred: int | None, meas: int | None) -> str:
    if not pred or not meas:
        return "-"
    return f"{100.0 * (pred - meas) / meas:+.2f}%"


#: Paired timing rounds of ``demo`` (eager and memcompile alternate; the median is reported).
DEMO_TIMING_REPS = 5


def _train(
    wl: Any, run: Any, module: Any, steps: int, *, seed: int, lr: float, say: Any
) -> tuple[list[float], Any, Callable[[int], float]]:
    """Train ``steps`` SGD steps on ``wl``'s batches through ``run`` (``module`` itself, or
    ``module`` compiled), then measure one more step on the last batch; (losses, the
    measurement, a function running one more training step on batch ``i``)."""
    import torch

    from memcompile.runtime.measure import measure

    torch.manual_seed(seed)  # the same dropout masks for eager and memcompile
    opt = torch.optim.SGD(module.parameters(), lr=lr)

    def step(i: int) -> float:
        loss = wl.loss(run, i)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    losses: list[float] = []
    for i in range(steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        say(f"    step {i}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.2f} s)")
    # One more step, measured, on the last batch: a new shape would compile inside the
    # measurement. Gradients are None before it, as the prediction assumes.
    batch = wl.batch(steps - 1)

    def measured_step() -> None:
        run(*batch).backward()

    m = measure(measured_step, resident=[module, batch])
    opt.zero_grad(set_to_none=True)
    return losses, m, step


def _paired_seconds(steps: Sequence[Callable[[int], float]], batch: int, reps: int) -> list[float]:
    """Median seconds of a training step of each of ``steps``, run in turn ``reps`` times on
    batch ``batch`` (already compiled): alternating cancels most of a shared machine's drift."""
    import statistics

    seconds: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        for step, out in zip(steps, seconds, strict=True):
            t0 = time.perf_counter()
            step(batch)
            out.append(time.perf_counter() - t0)
    return [statistics.median(s) for s in seconds]


def _demo_budget(text: str, *, resident: int, eager_peak: int) -> int | None:
    """Bytes of ``demo --budget``: ``none``, bytes, a size, or a percentage of what the eager
    step allocates above its resident bytes (the convention of ``inspect --budget 70%``)."""
    from memcompile.viz.capture import resolve_budget

    text = text.strip()
    if text.lower() == "none":
        return None
    budget: int | str = int(text) if text.isdigit() else text
    return resolve_budget(budget, resident=resident, unplanned_peak=eager_peak)


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    import copy

    import memcompile
    from memcompile import zoo
    from memcompile.errors import format_bytes
    from memcompile.viz.capture import _unwrap_budget_error as unwrap_budget_error

    if args.steps < 1:
        raise CliError("--steps must be >= 1")
    if args.budget.strip().lower() != "none":
        _check_budget(args.budget)
    try:
        wl = zoo.build(args.workload, size=args.size, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    say = (lambda *_: None) if args.json else print
    say(f"memcompile demo: {wl.name} ({args.size}): {wl.summary}")

    # 1. Eager PyTorch without memcompile, on a copy made before anything compiles: the same
    # weights, batches and dropout masks.
    eager_model = copy.deepcopy(wl.model)
    say("  eager PyTorch, without memcompile:")
    eager_losses, em, eager_step = _train(
        wl, eager_model, eager_model, args.steps, seed=args.seed, lr=args.lr, say=say
    )

    # 2. memcompile under the budget (default: 60 % of what the eager step allocates above its
    # resident bytes, as `inspect --budget 60%` reads it), the same steps.
    budget = _demo_budget(args.budget, resident=em.resident_bytes, eager_peak=em.peak)
    if budget is None:
        say("  memcompile, no budget:")
    else:
        share = ""
        if args.budget.strip().endswith("%"):
            share = f" ({args.budget.strip()} of what eager allocates above its resident bytes)"
        say(f"  memcompile, budget {format_bytes(budget)}{share}:")
    compiled = memcompile.compile(wl.model, budget=budget)
    try:
        losses, m, step = _train(
            wl, compiled, wl.model, args.steps, seed=args.seed, lr=args.lr, say=say
        )
    except Exception as e:
        budget_error = unwrap_budget_error(e)
        if budget_error is not None:
            raise budget_error from None
        raise
    rep = memcompile.report(compiled)  # before the timing steps: the training run's calls
    # Time per step, after the losses and the measurement: eager and memcompile in turn.
    eager_s, step_s = _paired_seconds((eager_step, step), args.steps - 1, DEMO_TIMING_REPS)
    rows: list[dict[str, Any]] = []
    for f in rep.fragments:
        measured = max(
            (v for k, v in m.ranges.items() if k.startswith(f"memcompile:{f.name}:")), default=None
        )
        rows.append(
            {
                "fragment": f.name,
                "id": f.id,
                "code": f.code,
                "calls": f.forward_calls + f.inference_calls,
                "predicted_peak": f.predicted_peak,
                "measured_peak": measured,
            }
        )
    result = {
        "workload": wl.name,
        "size": args.size,
        "budget": budget,
        "eager_peak": em.peak,
        "eager_step_seconds": eager_s,
        "eager_losses": eager_losses,
        "losses": losses,
        "losses_equal_eager": losses == eager_losses,
        "predicted_peak": rep.predicted_peak,
        "measured_peak": m.peak,
        "within_budget": None if budget is None else m.peak <= budget,
        "step_seconds": step_s,
        "exact": rep.exact,
        "measured_with": "CUDA peak stats" if m.device == "cuda" else "CPU profiler",
        "fragments": rows,
        "fallbacks": [fb.to_dict() for fb in rep.fallbacks],
    }
    if not args.json:
        _print_demo(result)
        for fb in rep.fallbacks:
            print(f"  eager fallback: {fb.code}: {fb.kind}: {fb.reason}")
    return result


def _print_demo(r: dict[str, Any]) -> None:
    from memcompile.errors import format_bytes

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    def times(n: float | None, of: float) -> str:
        return "-" if n is None or not of else f"{n / of:.2f}x"

    eager_peak, eager_s = r["eager_peak"], r["eager_step_seconds"]
    budget = "no budget" if r["budget"] is None else f"budget {size(r['budget'])}"
    kind = "exact model" if r["exact"] else "estimate"
    print(f"\n  {'one training step':<30} {'peak':>12} {'vs eager':>9} {'time':>9} {'vs eager':>9}")
    print(
        f"  {'eager PyTorch':<30} {size(eager_peak):>12} {'1.00x':>9} {eager_s:>8.3f}s {'1.00x':>9}"
    )
    print(
        f"  {'memcompile, ' + budget:<30} {size(r['measured_peak']):>12} "
        f"{times(r['measured_peak'], eager_peak):>9} {r['step_seconds']:>8.3f}s "
        f"{times(r['step_seconds'], eager_s):>9}"
    )
    print(
        f"  {'  predicted by memcompile':<30} {size(r['predicted_peak']):>12} "
        f"{times(r['predicted_peak'], eager_peak):>9}  ({kind}, "
        f"{_pct(r['predicted_peak'], r['measured_peak'])} of measured)"
    )
    if r["within_budget"] is not None:
        held = "held" if r["within_budget"] else "MISSED"
        sign = "<=" if r["within_budget"] else ">"
        print(f"  budget {held}: measured {size(r['measured_peak'])} {sign} {size(r['budget'])}")
    n = len(r["losses"])
    if r["losses_equal_eager"]:
        print(f"  losses: equal to eager's bit for bit in all {n} step(s)")
    else:
        print(f"  losses: DIFFER from eager's: {r['losses']} vs {r['eager_losses']}")
    print(
        f"  peaks: {r['measured_with']} + resident bytes, one step after training; "
        f"time: median of {DEMO_TIMING_REPS} steps each, in turn"
    )
    print(f"\n  {'fragment':<9} {'calls':>6} {'predicted':>12} {'measured':>12} {'error':>8}  code")
    for row in r["fragments"]:
        err = _pct(row["predicted_peak"], row["measured_peak"])
        print(
            f"  {row['fragment']:<9} {row['calls']:>6} {size(row['predicted_peak']):>12} "
            f"{size(row['measured_peak']):>12} {err:>8}  {row['code']}"
        )
    print(
        f"  {'step':<9} {'':>6} {size(r['predicted_peak']):>12} {size(r['measured_peak']):>12} "
        f"{_pct(r['predicted_peak'], r['measured_peak']):>8}  whole step ({kind}; measured: "
        f"{r['measured_with']})"
    )


# -- inspection commands --------------------------------------------------------------------


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    from memcompile.config import option_value

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--option {pair!r}: expected KEY=VALUE, e.g. swap=false")
        if key == "budget":
            raise CliError("--option budget=...: use --budget")
        out[key] = option_value(value)
    return out


def _check_budget(budget: str | None) -> None:
    # A typo must fail before anything compiles (a percentage is resolved after the first run).
    from memcompile.config import parse_bytes

    if budget is None:
        return
    text = budget.strip()
    if text.endswith("%"):
        try:
            fraction = float(text[:-1])
        except ValueError:
            fraction = -1.0
        if fraction <= 0:
            raise CliError(f"--budget {budget!r}: a percentage must be a positive number, e.g. 70%")
        return
    try:
        parse_bytes(int(text) if text.isdigit() else text)
    except (TypeError, ValueError) as e:
        raise CliError(f"--budget: {_first_line(e)}") from None


def _collect(args: argparse.Namespace) -> Any:
    """The Inspection of args.target (compiling it), or read from a plan file."""
    from memcompile.cli_target import resolve_target
    from memcompile.viz.capture import collect

    _check_budget(args.budget)
    options = _options(args.option)
    wl = resolve_target(args.target, size=args.size, seed=args.seed)
    budget: int | str | None = args.budget
    if isinstance(budget, str) and budget.strip().isdigit():
        budget = int(budget.strip())
    return collect(
        wl,
        budget=budget,
        before=not args.no_before or (isinstance(budget, str) and budget.strip().endswith("%")),
        measure=not args.no_measure,
        target=args.target if ":" in args.target else f"{args.target} ({args.size})",
        **options,
    )


def _load_or_collect(args: argparse.Namespace) -> Any:
    from memcompile.viz.snapshot import load_inspection

    if args.target.endswith(".json"):
        if args.budget is not None or args.option:
            raise CliError("--budget and --option apply to a TARGET, not to a plan file")
        return load_inspection(args.target)
    return _collect(args)


def _summary(insp: Any) -> dict[str, Any]:
    return {
        "target": insp.target,
        "budget": insp.budget,
        "predicted_peak": insp.predicted_peak,
        "measured_peak": insp.measured_peak,
        "before_peak": insp.before_peak,
        "exact": insp.exact,
        "resident_bytes": insp.resident_bytes,
        "step": [c.label for c in insp.step],
        "fragments": [
            {
                "name": f.name,
                "id": f.id,
                "code": f.code,
                "reason": f.reason,
                "calls": f.calls,
                "predicted_peak": f.predicted_peak,
                "peak_at": f"{f.peak_graph}:{f.peak_node}" if f.peak_node else None,
            }
            for f in insp.fragments
        ],
        "plans": [p.to_dict() for p in insp.plan.fragments],
        "fallbacks": list(insp.fallbacks),
    }


def _fmt(n: int | None) -> str:
    from memcompile.errors import format_bytes

    return "-" if n is None else format_bytes(n)


def _print_inspection(insp: Any) -> None:
    from memcompile.cli_output import print_table

    budget = "no budget" if insp.budget is None else f"budget {_fmt(insp.budget)}"
    kind = "exact model" if insp.exact else "estimate"
    print(f"memcompile inspect {insp.target}: {budget}, {len(insp.fragments)} fragment(s)")
    print(
        f"  step peak: predicted {_fmt(insp.predicted_peak)} ({kind}), measured "
        f"{_fmt(insp.measured_peak)} ({_pct(insp.predicted_peak, insp.measured_peak)}), "
        f"without a plan {_fmt(insp.before_peak)}"
    )
    print(f"  step: {' '.join(c.label for c in insp.step) or '-'}\n")
    print_table(
        "fragments",
        ["frag", "id", "calls", "predicted peak", "peak at", "code"],
        [
            [f.name, f.id, f.calls, _fmt(f.predicted_peak), f.peak_node or "-", f.short_code]
            for f in insp.fragments
        ],
        right=(2, 3),
    )
    for f in insp.fragments:
        plan = insp.plan_of(f)
        if plan is None:
            continue
        tiers = sorted(set(plan.swapped.values()))
        print(
            f"\nplan of {f.name}: {'fits' if plan.feasible else 'DOES NOT FIT'}; recompute "
            f"{len(plan.recomputed)}, swap {len(plan.swapped)}"
            f"{' (' + ', '.join(tiers) + ')' if tiers else ''} of {len(plan.decisions)} saved "
            f"tensors ({_fmt(plan.saved_bytes)} kept); predicted peak "
            f"{_fmt(plan.predicted_peak)} (without a plan {_fmt(plan.baseline_peak)})"
        )
        stall = "-" if plan.swap_stall is None else f"{plan.swap_stall * 1e3:.3f} ms"
        print(
            f"  cost: recompute {plan.recompute_time * 1e3:.3f} ms, swap copies "
            f"{plan.swap_time * 1e3:.3f} ms, stall after prefetch {stall}, "
            f"{len(plan.prefetch)} reload(s) prefetched"
        )
        moved = [d for d in plan.decisions if d.action != "keep"]
        if moved:
            print_table(
                f"  decisions other than keep ({len(moved)})",
                ["tensor", "bytes", "action"],
                [[d.tensor, _fmt(d.nbytes), d.action] for d in moved],
                right=(1,),
            )
    if insp.fallbacks:
        print("\neager fallbacks (memory there is not managed):")
        for line in insp.fallbacks:
            print(f"  {line}")
    else:
        print("\neager fallbacks: none")


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    insp = _collect(args)
    if not args.json:
        _print_inspection(insp)
    return _summary(insp)


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.output)
    if not out.parent.is_dir():
        raise CliError(f"-o {args.output}: folder {str(out.parent)!r} does not exist")
    insp = _collect(args)
    try:
        out.write_text(insp.to_json(indent=1) + "\n")
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    if not args.json:
        planned = sum(1 for _ in insp.plan.fragments)
        print(
            f"wrote {out}: {planned} fragment plan(s), budget {_fmt(insp.budget)}, predicted "
            f"step peak {_fmt(insp.predicted_peak)} (without a plan {_fmt(insp.before_peak)})"
        )
    return {"output": str(out), **_summary(insp)}


def _output_format(path: str, allowed: Sequence[str]) -> str:
    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in allowed:
        raise CliError(f"-o {path}: the file name must end in one of .{', .'.join(allowed)}")
    if not Path(path).parent.is_dir():
        raise CliError(f"-o {path}: folder {str(Path(path).parent)!r} does not exist")
    return fmt


def _draw(args: argparse.Namespace) -> dict[str, Any]:
    from memcompile.viz.draw import COMPACT_ABOVE, node_count, plan_digraph, render

    fmt = _output_format(args.output, ("svg", "png", "pdf", "dot"))
    insp = _load_or_collect(args)
    nodes = node_count(insp)
    compact = nodes > COMPACT_ABOVE if args.compact is None else args.compact
    data = render(plan_digraph(insp, compact=compact), fmt)
    Path(args.output).write_bytes(data)
    if not args.json:
        mode = " (compact: runs of nodes; --full draws every node)" if compact else ""
        print(f"wrote {args.output}: {len(insp.fragments)} fragment(s), {nodes} nodes{mode}")
    return {
        "output": args.output,
        "format": fmt,
        "fragments": len(insp.fragments),
        "nodes": nodes,
        "compact": compact,
    }


def _timeline(args: argparse.Namespace) -> dict[str, Any]:
    from memcompile.viz.timeline import timeline_figure

    fmt = _output_format(args.output, ("png", "svg", "pdf"))
    insp = _load_or_collect(args)
    timeline_figure(insp).savefig(args.output, format=fmt, dpi=100)
    if not args.json:
        print(
            f"wrote {args.output}: budget {_fmt(insp.budget)}, predicted step peak "
            f"{_fmt(insp.predicted_peak)}, without a plan {_fmt(insp.before_peak)}"
        )
    return {
        "output": args.output,
        "format": fmt,
        "budget": insp.budget,
        "predicted_peak": insp.predicted_peak,
        "before_peak": insp.before_peak,
    }


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from memcompile.cli_bench import (
        BenchError,
        BenchOptions,
        harness_commands,
        run_suite,
        suites_for,
    )
    from memcompile.cli_output import progress

    opts = BenchOptions(
        quick=args.quick,
        models=args.models,
        configs=args.configs,
        reps=args.reps,
        no_sweep=args.no_sweep,
        steps=args.steps,
        size=args.size,
    )
    try:
        suites = suites_for(args.suite)
        opts.check(suites)
        if args.dry_run:
            commands = {s: harness_commands(s, opts, args.out) for s in suites}
        else:
            runs = []
            for suite in suites:
                runs.append(run_suite(suite, opts, args.out, lambda label: progress(None, label)))
                if not args.json:
                    print(runs[-1].report, end="")
                    print(f"results: {runs[-1].out}")
    except BenchError as e:
        raise CliError(str(e)) from None
    if args.dry_run:
        if not args.json:
            for suite, cmds in commands.items():
                for cmd in cmds:
                    print(f"{suite}: OMP_NUM_THREADS=1 {' '.join(cmd)}")
        return {
            "dry_run": True,
            "suites": [
                {"suite": s, "commands": [list(c) for c in cmds]} for s, cmds in commands.items()
            ],
        }
    return {
        "suites": [
            {
                "suite": r.suite,
                "rows": list(r.rows),
                "out": r.out,
                "commands": [list(c) for c in r.commands],
            }
            for r in runs
        ],
    }


# -- parser and entry point -------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memcompile",
        description="memcompile: train networks inside a device-memory budget "
        "(a torch.compile backend).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log memcompile's decisions (INFO)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object instead")
    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("--size", default="tiny", help="zoo size: tiny, small or bench (tiny)")
    target.add_argument("--seed", type=int, default=0)
    target.add_argument(
        "--option",
        "-O",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another memcompile option, e.g. -O swap=false -O offload_to=disk (repeatable)",
    )
    target.add_argument(
        "--no-before", action="store_true", help="skip the unplanned compile (no 'before' curve)"
    )
    target.add_argument("--no-measure", action="store_true", help="do not measure the step")

    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    d = sub.add_parser(
        "demo",
        parents=[common],
        help="train a zoo workload eagerly, then under memcompile in a budget: peaks, time, losses",
    )
    d.add_argument("--workload", default="gpt", help="zoo workload name (default: gpt)")
    d.add_argument("--size", default="small", help="tiny, small or bench (default: small)")
    d.add_argument("--steps", type=int, default=3, help="training steps before the measured one")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--lr", type=float, default=0.05)
    d.add_argument(
        "--budget",
        default="60%",
        help="bytes, a size like 1.5MiB, N%% of what the eager step allocates above its "
        "resident bytes (default 60%%), or none",
    )
    d.set_defaults(func=_demo)

    budget_help = "bytes, a size like 1.5MiB, or N%% of the step's allocations without a plan"
    i = sub.add_parser(
        "inspect",
        parents=[common, target],
        help="compile TARGET, run one step; fragments, peaks, plans and eager fallbacks",
    )
    i.add_argument("target", metavar="TARGET", help="zoo workload name or module:function")
    i.add_argument("--budget", help=budget_help)
    i.set_defaults(func=_inspect)

    pl = sub.add_parser(
        "plan", parents=[common, target], help="write TARGET's memory plan (and graphs) as JSON"
    )
    pl.add_argument("target", metavar="TARGET", help="zoo workload name or module:function")
    pl.add_argument("--budget", required=True, help=budget_help)
    pl.add_argument("-o", "--output", required=True, help="the plan file to write (plan.json)")
    pl.set_defaults(func=_plan)

    dr = sub.add_parser(
        "draw", parents=[common, target], help="draw fragments and plans (graphviz)"
    )
    dr.add_argument("target", metavar="TARGET|PLAN.json")
    dr.add_argument("--budget", help=budget_help)
    dr.add_argument("-o", "--output", required=True, help="out.svg (or .png, .pdf, .dot)")
    mode = dr.add_mutually_exclusive_group()
    mode.add_argument(
        "--compact",
        dest="compact",
        action="store_const",
        const=True,
        default=None,
        help="one box per run of nodes with one decision (default for large graphs)",
    )
    mode.add_argument(
        "--full", dest="compact", action="store_const", const=False, help="every node"
    )
    dr.set_defaults(func=_draw)

    tl = sub.add_parser(
        "timeline",
        parents=[common, target],
        help="plot live bytes over the step before and after the plan (matplotlib)",
    )
    tl.add_argument("target", metavar="TARGET|PLAN.json")
    tl.add_argument("--budget", help=budget_help)
    tl.add_argument("-o", "--output", required=True, help="out.png (or .svg, .pdf)")
    tl.set_defaults(func=_timeline)

    b = sub.add_parser(
        "bench", parents=[common], help="run the benchmark harness (benchmarks/, a checkout)"
    )
    b.add_argument("--suite", default="anchors", help="anchors (default), dynamic or all")
    b.add_argument("--quick", action="store_true", help="each harness's quick mode")
    b.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    b.add_argument("--models", help="anchors: comma list of models (harness default: all)")
    b.add_argument("--configs", help="anchors: comma list of configurations (default: all)")
    b.add_argument("--reps", type=int, help="anchors: paired timing repetitions")
    b.add_argument("--no-sweep", action="store_true", help="anchors: skip the largest-model sweep")
    b.add_argument("--steps", type=int, help="dynamic: MoE training steps (harness default: 300)")
    b.add_argument("--size", help="dynamic: zoo MoE size, tiny, small or bench (default: small)")
    b.add_argument(
        "--out", type=Path, default=None, help="results folder (default: benchmarks/results)"
    )
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memcompile`` command; returns the exit status."""
    from memcompile.cli_target import TargetError
    from memcompile.errors import MemcompileError
    from memcompile.viz.snapshot import InspectionFileError

    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        result = args.func(args)
    except (CliError, TargetError, InspectionFileError, MemcompileError) as e:
        print(f"memcompile: error: {_first_line(e)}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, NotImplementedError) as e:
        # Bad option values (MemConfig names the key), drawing failures and the like.
        if args.verbose:
            log.exception("memcompile %s failed", args.command)
        print(f"memcompile: error: {_first_line(e)}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(
            f"memcompile: error: {_first_line(e)} (install the extra: pip install "
            "'memcompile[viz]')",
            file=sys.stderr,
        )
        return 1
    except Exception as e:
        if args.verbose:
            log.exception("memcompile %s failed", args.command)
        hint = "" if args.verbose else " (run with -v for the traceback)"
        print(
            f"memcompile: error: unexpected {type(e).__name__}: {_first_line(e)}{hint}",
            file=sys.stderr,
        )
        return 1
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
