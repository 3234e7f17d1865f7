"""Dynamic networks written the natural way, trained under memcompile (issue: no frame unmanaged).

    OMP_NUM_THREADS=1 python benchmarks/natural.py                       # small (~10 min)
    OMP_NUM_THREADS=1 python benchmarks/natural.py --size tiny --reps 3  # quick

The zoo's natural models (``memcompile/zoo/natural.py``: ``moe_natural``, ``moe_natural_top2``,
``early_exit_natural``, ``tree_natural``) have Python control flow on tensor values in their
layer loops (or recurse over a new tree each step), so Dynamo runs their ``forward`` eagerly (or
memcompile does, after 8 graphs of the tree's); memcompile compiles the ``torch.nn`` modules it
calls as fragments of their own (``backends/regions.py``). Each row builds the model twice from
one seed (an eager copy and the configured one) and runs a user's loop on both:
``AdamW(lr=1e-3)``, one micro-batch, ``opt.step(); opt.zero_grad(set_to_none=True)``:

* ``--warmup`` (4; the tree 12) iterations of both copies (compiles happen here), then ONE
  iteration of the configured copy measured with ``memcompile.measure`` (CPU profiler;
  ``resident=[model, opt, batch]``): the iteration's absolute device peak;
* every loss of those iterations and then every parameter compared with ``torch.equal``
  ("identical");
* ``--reps`` iterations timed interleaved with the eager copy (ABAB, process CPU time), median of
  the paired ratios ("time vs eager").

Configurations: ``eager``; ``mc`` (no budget: memcompile's cost with nothing to plan; once the
step is seen the regions call their modules directly, ``backends/unplanned.py``);
``mc_watched`` (no budget, every step watched: the compiled regions' calls); ``mc_75_off`` (budget
0.75x, regional capture switched off: what memcompile did before); ``mc_75``, ``mc_50`` (budget =
f x eager's measured iteration peak of the same run; ``on_infeasible="best_effort"``). The
prediction is ``report(compiled).iteration.peak`` (the whole iteration's, when an optimizer was
seen) or ``predicted_peak``, read right after the measured iteration. The glue (tensor ops
between the regions: the residual adds, the routers' softmax, the loss) is in it only as far as
a sampled iteration measured it (``report().unseen_bytes``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from machine import write_results  # noqa: E402

import memcompile  # noqa: E402
from memcompile import zoo  # noqa: E402
from memcompile.pipeline import features  # noqa: E402

MODELS = ("moe_natural", "moe_natural_top2", "early_exit_natural", "tree_natural")
# The tree network compiles a graph per tree until it goes regional (compiler.REGIONAL_AFTER):
# its warm-up runs past that.
WARMUP = {"tree_natural": 12}
CONFIGS = ("eager", "mc", "mc_watched", "mc_75_off", "mc_75", "mc_50")
_FRACTION = {"mc_75_off": 0.75, "mc_75": 0.75, "mc_50": 0.5}


class Loop:
    """A user's loop over one copy of a workload: AdamW, one micro-batch per iteration."""

    def __init__(self, wl: zoo.Workload, fn: Callable[..., torch.Tensor]) -> None:
        self.wl, self.fn = wl, fn
        self.opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3)

    def iteration(self, k: int) -> float:
        loss = self.wl.loss(self.fn, k)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def run_row(name: str, size: str, config: str, eager_peak: int | None, args: Any) -> dict:
    torch._dynamo.reset()
    warmup = max(args.warmup, WARMUP.get(name, 0))
    eager_wl, wl = zoo.build(name, size=size), zoo.build(name, size=size)
    budget = int(_FRACTION[config] * eager_peak) if config in _FRACTION and eager_peak else None
    fn: Callable[..., torch.Tensor] = wl.model
    # "_off": regional capture switched off; "_watched": no direct mode; otherwise the switches
    # as they are by default.
    with features.patch(
        regional=not config.endswith("_off"), direct_unplanned=config != "mc_watched"
    ):
        if config != "eager":
            fn = memcompile.compile(wl.model, budget=budget, on_infeasible="best_effort")
        ref, loop = Loop(eager_wl, eager_wl.model), Loop(wl, fn)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same = True
            for k in range(warmup):
                same &= ref.iteration(k) == loop.iteration(k)
            batch = wl.batch(warmup)
            m = memcompile.measure(
                lambda: loop.iteration(warmup), resident=[wl.model, loop.opt, batch]
            )
            # The report of the step measured (a dynamic model's next step differs).
            rep = memcompile.report(fn) if config != "eager" else None
            same &= ref.iteration(warmup) == m.result
            same &= all(
                torch.equal(p, q)
                for p, q in zip(wl.model.parameters(), eager_wl.model.parameters(), strict=True)
            )
            ratios = []
            for r in range(args.reps):
                k = warmup + 1 + r
                t0 = time.process_time()
                loop.iteration(k)
                t1 = time.process_time()
                ref.iteration(k)
                t2 = time.process_time()
                ratios.append((t1 - t0) / max(t2 - t1, 1e-9))
    row: dict[str, Any] = {
        "model": name,
        "config": config,
        "budget": budget,
        "measured_peak": m.peak,
        "identical": bool(same),
        "time_vs_eager": statistics.median(ratios) if ratios else None,
        "budget_warnings": sum(
            issubclass(w.category, memcompile.MemoryBudgetWarning) for w in caught
        ),
    }
    if rep is not None:
        it = rep.iteration
        row.update(
            predicted=it.peak if it is not None and it.peak is not None else rep.predicted_peak,
            fragments=len(rep.fragments),
            regions=len(rep.regions),
            eager_frames=rep.eager_frames,
        )
    return row


def _mib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**20:.2f}"


def render(rows: list[dict]) -> list[str]:
    lines = [
        "| model | config | budget MiB | measured MiB | predicted MiB | within budget | "
        "identical | time vs eager | fragments (regions) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        within = (
            "—"
            if r["budget"] is None
            else (
                "yes"
                if r["measured_peak"] <= r["budget"]
                else f"no (+{r['measured_peak'] / r['budget'] - 1:.0%})"
            )
        )
        frags = "—" if "fragments" not in r else f"{r['fragments']} ({r['regions']})"
        ratio = "—" if r["time_vs_eager"] is None else f"{r['time_vs_eager']:.2f}x"
        lines.append(
            f"| {r['model']} | {r['config']} | {_mib(r['budget'])} | {_mib(r['measured_peak'])} "
            f"| {_mib(r.get('predicted'))} | {within} | {'yes' if r['identical'] else 'NO'} "
            f"| {ratio} | {frags} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        eager = run_row(name, args.size, "eager", None, args)
        rows.append(eager)
        for config in configs:
            if config == "eager":
                continue
            t = time.perf_counter()
            rows.append(run_row(name, args.size, config, eager["measured_peak"], args))
            print(render([rows[-1]])[-1], f"({time.perf_counter() - t:.0f} s)", flush=True)
    write_results(
        args.out,
        "natural",
        title="Dynamic networks written naturally, under memcompile (regional capture)",
        argv=sys.argv[1:] if argv is None else argv,
        notes=[
            "AdamW, one micro-batch per iteration; peaks are the whole iteration's (CPU "
            "profiler), budgets a fraction of eager's measured iteration peak in the same run",
            "predicted: the report's iteration peak; the eager glue between regions is in it as "
            "far as a sampled iteration (one after each compile) measured it beyond the plans "
            "(report().unseen_bytes)",
            "mc_75_off: regional capture off (features.regional=False): nothing of the MoEs and "
            "early exit compiles; the tree compiles a graph per tree (a new one every step)",
            "mc: no budget; from the third iteration after the last compile the regions call their "
            "modules directly and nothing is watched (backends/unplanned.py); mc_watched: the "
            "same with every step watched (features.direct_unplanned=False), the compiled "
            "regions' own cost",
        ],
        table=render(rows),
        rows=rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
