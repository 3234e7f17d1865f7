"""The ``memcompile`` command (also ``python -m memcompile``).

    memcompile demo [--workload gpt] [--size small] [--steps 3] [--json]

``demo`` trains a zoo workload under the memcompile backend, then measures one step and prints,
for each fragment, the predicted and the measured device peak. Errors print one line on stderr and
exit with status 1; ``NO_COLOR`` is respected (output is plain text).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 1."""


def _pct(pred: int | None, meas: int | None) -> str:
    if not pred or not meas:
        return "-"
    return f"{100.0 * (pred - meas) / meas:+.2f}%"


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import memcompile
    from memcompile import zoo
    from memcompile.errors import format_bytes
    from memcompile.runtime.measure import measure

    if args.steps < 1:
        raise CliError("--steps must be >= 1")
    try:
        wl = zoo.build(args.workload, size=args.size, seed=args.seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    torch.manual_seed(args.seed)
    compiled = memcompile.compile(wl.model)
    opt = torch.optim.SGD(wl.model.parameters(), lr=args.lr)
    say = (lambda *_: None) if args.json else print
    say(f"memcompile demo: {wl.name} ({args.size}): {wl.summary}")
    losses: list[float] = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = wl.loss(compiled, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        say(f"  step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.2f} s)")

    # One more step, measured, on the last batch: a new shape would compile inside the
    # measurement. Gradients are None before it, as the prediction assumes.
    batch = wl.batch(args.steps - 1)

    def measured_step() -> None:
        compiled(*batch).backward()

    m = measure(measured_step, resident=[wl.model, batch])
    opt.zero_grad(set_to_none=True)
    rep = memcompile.report(compiled)
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
        "losses": losses,
        "predicted_peak": rep.predicted_peak,
        "measured_peak": m.peak,
        "exact": rep.exact,
        "fragments": rows,
        "fallbacks": [fb.to_dict() for fb in rep.fallbacks],
    }
    if not args.json:
        print(
            f"\n  {'fragment':<9} {'calls':>6} {'predicted':>12} {'measured':>12} {'error':>8}"
            "  code"
        )
        for r in rows:
            pred = "-" if r["predicted_peak"] is None else format_bytes(r["predicted_peak"])
            meas = "-" if r["measured_peak"] is None else format_bytes(r["measured_peak"])
            err = _pct(r["predicted_peak"], r["measured_peak"])
            print(
                f"  {r['fragment']:<9} {r['calls']:>6} {pred:>12} {meas:>12} {err:>8}  {r['code']}"
            )
        pred = "-" if rep.predicted_peak is None else format_bytes(rep.predicted_peak)
        kind = "exact model" if rep.exact else "estimate"
        print(
            f"  {'step':<9} {'':>6} {pred:>12} {format_bytes(m.peak):>12} "
            f"{_pct(rep.predicted_peak, m.peak):>8}  whole step ({kind}; measured: "
            f"{'CUDA peak stats' if m.device == 'cuda' else 'CPU profiler'})"
        )
        for fb in rep.fallbacks:
            print(f"  eager fallback: {fb.code}: {fb.kind}: {fb.reason}")
    return result


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memcompile",
        description="memcompile: train networks inside a device-memory budget "
        "(a torch.compile backend).",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log memcompile's decisions (INFO)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    d = sub.add_parser("demo", help="train a zoo workload and compare predicted and measured peaks")
    d.add_argument("--workload", default="gpt", help="zoo workload name (default: gpt)")
    d.add_argument("--size", default="small", help="tiny, small or bench (default: small)")
    d.add_argument("--steps", type=int, default=3, help="training steps before the measured one")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--lr", type=float, default=0.05)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    d.set_defaults(func=_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memcompile`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        result = args.func(args)
    except CliError as e:
        print(f"memcompile: error: {e}", file=sys.stderr)
        return 1
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
