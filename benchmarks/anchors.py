"""memcompile beside PyTorch's own memory features: peak, time, and the largest model that fits.

    OMP_NUM_THREADS=1 python benchmarks/anchors.py                 # everything (~40 min)
    OMP_NUM_THREADS=1 python benchmarks/anchors.py --quick    # 3 reps, no Inductor, small sweep
    OMP_NUM_THREADS=1 python benchmarks/anchors.py --models gpt --configs eager,checkpoint,mc_r25

Part 1, the anchor table (research/01 §3's protocol). For each model (zoo ``gpt``, ``gpt_manual``
and ``branchy`` at size ``bench``) and configuration, one process:

* builds the model twice from one seed: a plain eager copy and the configured one;
* runs 2 warm-up steps of each (compiles happen here), then measures one step
  (``zero_grad(set_to_none)``, forward, backward, no optimizer) of the configured copy with the CPU
  profiler (``memcompile.measure``): the absolute peak and the bytes resident at its start
  (parameters, buffers, batch);
* times ``--reps`` steps interleaved with the eager copy (ABAB) and reports the median of the
  paired ratios of process CPU time, so load from other jobs on the machine cancels out.

"step peak" is the peak above what is resident (gradients included, as in research/01), and
"vs eager" divides it by eager's step peak measured in its own process. memcompile budgets are
absolute (the budget contract), set from eager's measurement as
``resident + f * eager step peak``: ``mc_r50`` is f = 0.50 with recomputation only, ``mc_h15``
f = 0.15 with the host tier allowed, ``mc_d15`` with the disk tier.

Part 2, "largest model in a fixed budget": GPT blocks (bench width, SDPA) are added until each
system's measured peak passes the budget; the budget is eager's measured peak at
``--sweep-base-layers`` layers. memcompile counts as fitting when it plans the step without
``MemoryBudgetError`` and its measured peak is within the budget (+2 %, the contract's tolerance).

Results: ``benchmarks/results/anchors.md`` and ``anchors.json`` (with the command, the machine
and the date). Every number in them was measured in this run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("gpt", "gpt_manual", "branchy")

#: name -> (what it is, family). Families: eager, ckpt, sac, inductor, aot, memcompile.
CONFIGS: dict[str, str] = {
    "eager": "eager PyTorch",
    "checkpoint": "eager + torch.utils.checkpoint per block (per branch for branchy)",
    "sac": "eager + selective checkpointing per block: save matmuls and attention",
    "inductor": "torch.compile (Inductor) default",
    "inductor_amb50": "torch.compile (Inductor), activation_memory_budget=0.5",
    "inductor_amb10": "torch.compile (Inductor), activation_memory_budget=0.1",
    "aot_amb50": "aot_autograd min-cut + eager kernels, activation_memory_budget=0.5",
    "aot_amb10": "aot_autograd min-cut + eager kernels, activation_memory_budget=0.1",
    "mc_none": "memcompile, no budget (reorder only)",
    "mc_r50": "memcompile, budget 0.50, recompute only",
    "mc_r35": "memcompile, budget 0.35, recompute only",
    "mc_r25": "memcompile, budget 0.25, recompute only",
    "mc_r20": "memcompile, budget 0.20, recompute only",
    "mc_r19": "memcompile, budget 0.19, recompute only",
    "mc_r15": "memcompile, budget 0.15, recompute only",
    "mc_r12": "memcompile, budget 0.12, recompute only",
    "mc_r10": "memcompile, budget 0.10, recompute only",
    "mc_r00": "memcompile, budget 0: its error names the smallest budget, recompute only",
    "mc_h25": "memcompile, budget 0.25, recompute + host tier",
    "mc_h15": "memcompile, budget 0.15, recompute + host tier",
    "mc_h10": "memcompile, budget 0.10, recompute + host tier",
    "mc_h05": "memcompile, budget 0.05, recompute + host tier",
    "mc_h03": "memcompile, budget 0.03, recompute + host tier",
    "mc_h02": "memcompile, budget 0.02, recompute + host tier",
    "mc_h017": "memcompile, budget 0.017, recompute + host tier",
    "mc_h015": "memcompile, budget 0.015, recompute + host tier",
    "mc_h00": "memcompile, budget 0: its error names the smallest budget, recompute + host tier",
    "mc_d15": "memcompile, budget 0.15, recompute + disk tier",
    "mc_s50": "memcompile, budget 0.50, host tier only (no recompute)",
    "mc_s35": "memcompile, budget 0.35, host tier only (no recompute)",
}
QUICK_CONFIGS = ("eager", "checkpoint", "sac", "aot_amb10", "mc_none", "mc_r25", "mc_h15")
SWEEP_SYSTEMS = ("eager", "checkpoint", "sac", "aot_amb10", "mc_r", "mc_h")


# --------------------------------------------------------------------------- building models


def build(model: str, layers: int | None = None) -> Any:
    """The zoo workload at bench size; for GPT with ``layers`` blocks when given."""
    from memcompile import zoo
    from memcompile.zoo import gpt

    wl = zoo.build(model, size="bench", seed=0)
    if layers is None or layers == wl.extra.get("layers"):
        return wl
    if model not in ("gpt", "gpt_manual"):
        raise ValueError("--layers applies to gpt and gpt_manual only")
    cfg = {k: wl.extra[k] for k in ("d_model", "heads", "seq_len", "batch", "vocab")}
    return gpt.workload(
        {**cfg, "layers": layers}, manual=model == "gpt_manual", name=f"{model}_{layers}l"
    )


def _checkpoint_blocks(net: Any, context_fn: Callable[[], Any] | None) -> None:
    """Wrap every GPT block's forward (or every branchy branch) in ``checkpoint``."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    kw: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kw["context_fn"] = context_fn
    if hasattr(net, "blocks"):
        for block in net.blocks:
            inner = block.forward
            block.forward = lambda x, _f=inner: checkpoint(_f, x, **kw)
        return

    # Branchy: checkpoint each branch; that is depth-first, what a user would write by hand.
    def forward(x: Any, target: Any) -> Any:
        import torch

        ys = [checkpoint(lambda z, _b=b: F.gelu(_b(z)).mean(dim=-1), x, **kw) for b in net.branches]
        return F.mse_loss(torch.stack(ys).sum(dim=0), target)

    net.forward = forward


def _sac_context() -> Callable[[], Any]:
    import functools

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
    }

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _memcompile_options(config: str, budget: int | None, disk_dir: str) -> dict[str, Any]:
    if config == "mc_none":
        return {}
    tier = config[3]
    opts: dict[str, Any] = {"budget": budget, "on_infeasible": "error"}
    if tier == "r":  # recomputation only: parameters stay on the device too
        opts.update(swap=False, offload_params=False)
    elif tier == "s":
        opts["recompute"] = False
    elif tier == "d":
        opts.update(offload_to="disk", disk_path=disk_dir)
    return opts


def configure(config: str, wl: Any, budget: int | None, disk_dir: str) -> Callable[..., Any]:
    """The callable that runs ``wl``'s step under ``config`` (compiling lazily, on first call)."""
    import torch

    net = wl.model
    if config == "eager":
        return net
    if config == "checkpoint":
        _checkpoint_blocks(net, None)
        return net
    if config == "sac":
        _checkpoint_blocks(net, _sac_context())
        return net
    if config.startswith("inductor"):
        if config != "inductor":
            torch._functorch.config.activation_memory_budget = int(config[-2:]) / 100
        return torch.compile(net)
    if config.startswith("aot_"):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        torch._functorch.config.activation_memory_budget = int(config[-2:]) / 100

        def nop(gm: Any, _inputs: Any) -> Any:
            return gm

        backend = aot_autograd(
            fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition
        )
        return torch.compile(net, backend=backend)
    if config.startswith("mc_"):
        import memcompile

        return memcompile.compile(net, **_memcompile_options(config, budget, disk_dir))
    raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")


# --------------------------------------------------------------------------- one process


def _step(fn: Callable[..., Any], net: Any, batch: tuple[Any, ...]) -> float:
    import torch

    net.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout draws the same mask in both copies
    loss = fn(*batch)
    loss.backward()
    return float(loss.detach())


def run_one(model: str, config: str, reps: int, budget: int | None, layers: int | None) -> dict:
    """One configuration in this process: its peak, and CPU time paired with an eager copy."""
    import torch

    import memcompile

    torch.set_num_threads(1)
    ref, wl = build(model, layers), build(model, layers)
    ref.model.load_state_dict(wl.model.state_dict())
    out: dict[str, Any] = {"model": wl.name, "config": config, "budget": budget}
    with tempfile.TemporaryDirectory(prefix="memcompile-anchor-") as disk_dir:
        fn = configure(config, wl, budget, disk_dir)
        batch = wl.batch(0)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses = [_step(fn, wl.model, batch) for _ in range(2)]
        except memcompile.MemoryBudgetError as e:
            out.update(fits=False, error=f"MemoryBudgetError: min_feasible={e.min_feasible}")
            out["min_feasible"] = e.min_feasible
            return out
        out["first_steps_s"] = time.perf_counter() - t0
        out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
        ref_loss = _step(ref.model, ref.model, batch)
        _step(ref.model, ref.model, batch)
        out["loss_diff"] = abs(losses[-1] - ref_loss)
        wl.model.zero_grad(set_to_none=True)
        m = memcompile.measure(lambda: _step(fn, wl.model, batch), resident=[wl.model, batch])
        out.update(peak=m.peak, resident=m.resident_bytes, step_peak=m.peak - m.resident_bytes)
        if budget is not None:
            out["within_budget"] = m.peak <= budget * 1.02
        if config.startswith("mc_"):
            rep = memcompile.report(fn)
            out["predicted_peak"] = rep.predicted_peak
            plans = rep.plan.fragments
            out["recomputed"] = sum(len(p.recomputed) for p in plans)
            out["swapped"] = sum(len(p.swapped) for p in plans)
            out["predicted_gpu_overhead_s"] = sum(p.recompute_time + p.swap_time for p in plans)
        ratios = []
        for _ in range(reps):
            a = time.process_time()
            _step(ref.model, ref.model, batch)
            b = time.process_time()
            _step(fn, wl.model, batch)
            c = time.process_time()
            ratios.append((c - b) / max(b - a, 1e-9))
        out["time_ratios"] = ratios
        out["time_ratio"] = statistics.median(ratios) if ratios else None
        out["eager_step_s"] = b - a if reps else None
        out["fits"] = True
    return out


def _subprocess(
    model: str,
    config: str,
    reps: int,
    budget: int | None = None,
    layers: int | None = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--one", model, "--config", config, "--reps", str(reps)]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "config": config, "error": f"timeout after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in proc.stderr.strip().splitlines() if "USDT" not in ln][-3:]
        return {"model": model, "config": config, "error": " / ".join(tail)}
    return dict(json.loads(lines[-1]))


# --------------------------------------------------------------------------- the table


def budget_for(config: str, eager: dict[str, Any]) -> int | None:
    """Absolute budget of a memcompile config: resident + f * eager's step peak (f = the
    name's digits after a decimal point: ``mc_h15`` 0.15, ``mc_h015`` 0.015)."""
    if not config.startswith("mc_") or config == "mc_none":
        return None
    digits = config[4:]
    f = int(digits) / 10 ** len(digits)
    return int(eager["resident"] + f * eager["step_peak"])


def table(models: list[str], configs: list[str], reps: int) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        eager = _subprocess(model, "eager", reps)
        rows.append(eager)
        _progress(eager)
        if "error" in eager:
            continue
        for config in configs:
            if config == "eager":
                continue
            row = _subprocess(model, config, reps, budget_for(config, eager))
            if "step_peak" in row:
                row["step_peak_vs_eager"] = row["step_peak"] / eager["step_peak"]
            rows.append(row)
            _progress(row)
    return rows


def _progress(row: dict[str, Any]) -> None:
    if "error" in row:
        msg = f"error {row['error']}"
    elif not row.get("fits", True):
        msg = "does not fit"
    else:
        msg = f"peak {_mib(row['peak'])} MiB, time x{row['time_ratio']:.2f}"
    print(f"  {row['model']:<12} {row['config']:<16} {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the sweep


def _fits(system: str, layers: int, budget: int) -> dict[str, Any]:
    config = {"mc_r": "mc_r00", "mc_h": "mc_h00"}.get(system, system)
    row = _subprocess("gpt", config, 0, budget if system.startswith("mc_") else None, layers)
    row["layers"] = layers
    row["fits"] = bool(row.get("fits")) and "peak" in row and row["peak"] <= budget * 1.02
    return row


def largest(system: str, budget: int, cap: int) -> tuple[int, list[dict[str, Any]]]:
    """Most GPT layers ``system`` trains within ``budget``: doubling, then bisection."""
    tried: list[dict[str, Any]] = []

    def ok(n: int) -> bool:
        row = _fits(system, n, budget)
        tried.append(row)
        print(
            f"  sweep {system:<10} {n:>3} layers: {'fits' if row['fits'] else 'over'}",
            file=sys.stderr,
            flush=True,
        )
        return row["fits"]

    if not ok(1):
        return 0, tried
    lo, hi = 1, 2
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        return lo, tried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, tried


# --------------------------------------------------------------------------- report


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def render(result: dict[str, Any]) -> str:
    lines = [
        "# memcompile vs PyTorch's memory features (anchors)",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']}",
        f"- date: {result['date']}",
        "- peak: CPU profiler, one process per row; *step peak* = peak above the resident "
        "parameters and batch (gradients included); time: median of paired process-CPU-time "
        f"ratios vs an eager copy in the same process ({result['reps']} reps, 1 thread)",
        "- memcompile budgets are absolute: resident + f x eager's step peak (f in the name: "
        "`mc_r25` = 0.25 recompute only, `h` = host tier allowed, `d` = disk tier)",
        "",
        "| model | config | budget MiB | peak MiB | step peak MiB | vs eager | CPU time vs eager "
        "| within budget | predicted MiB | recomputed / swapped | loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["table"]:
        if "error" in r or not r.get("fits", True):
            why = r.get("error", "does not fit")
            lines.append(
                f"| {r['model']} | {r['config']} | {_mib(r.get('budget'))} | {why} |||||||"
            )
            continue
        vs = r.get("step_peak_vs_eager", 1.0 if r["config"] == "eager" else None)
        mc = r["config"].startswith("mc_")
        moves = f"{r['recomputed']} / {r['swapped']}" if mc else "-"
        lines.append(
            f"| {r['model']} | {r['config']} | {_mib(r.get('budget'))} | {_mib(r['peak'])} "
            f"| {_mib(r['step_peak'])} | {'-' if vs is None else f'{vs:.3f}x'} "
            f"| {r['time_ratio']:.2f}x | {'-' if r.get('budget') is None else r['within_budget']} "
            f"| {_mib(r.get('predicted_peak')) if mc else '-'} "
            f"| {moves} | {r['loss_diff']:.1e} |"
        )
    lines += ["", "Configurations:", ""]
    lines += [f"- `{k}`: {v}" for k, v in CONFIGS.items() if k in result["configs"]]
    sweep = result.get("sweep")
    if sweep:
        lines += [
            "",
            f"## Largest GPT in a fixed budget ({_mib(sweep['budget'])} MiB = eager's peak at "
            f"{sweep['base_layers']} layers; bench width, SDPA; cap {sweep['cap']} layers)",
            "",
            "| system | most layers that fit | vs eager | vs best PyTorch anchor |",
            "|---|---|---|---|",
        ]
        # Eager fits the base layers by definition (its peak there is the budget).
        base = max(sweep["largest"].get("eager", sweep["base_layers"]), 1)
        anchors = [n for k, n in sweep["largest"].items() if not k.startswith("mc_")]
        best = max(max(anchors, default=0), 1)
        for system, n in sweep["largest"].items():
            capped = " (cap)" if n >= sweep["cap"] else ""
            lines.append(f"| {system} | {n}{capped} | {n / base:.1f}x | {n / best:.1f}x |")
        lines += [
            "",
            "`mc_r` = memcompile recompute only (parameters stay on the device), `mc_h` = "
            "memcompile with the host tier (swaps, and parameters on the host when nothing else "
            "fits: offload_params='auto'), both with the fixed budget; `sac` = selective "
            "checkpointing per block; `aot_amb10` = min-cut with activation_memory_budget 0.1.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="3 reps, fewer configs, a small sweep")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--configs", default="", help=f"comma list of: {', '.join(CONFIGS)}")
    p.add_argument("--reps", type=int, default=None, help="paired timing reps (default 9)")
    p.add_argument("--sweep-base-layers", type=int, default=2)
    p.add_argument("--sweep-cap", type=int, default=None)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the largest-model sweep (results to anchors_sweep.md/json)",
    )
    p.add_argument(
        "--sweep-systems", default=",".join(SWEEP_SYSTEMS), help="comma list for the sweep"
    )
    p.add_argument(
        "--sweep-name",
        default="anchors_sweep",
        help="file stem of a --sweep-only run's results (default anchors_sweep): a partial "
        "sweep (some systems) can be kept beside the full one",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    reps = args.reps if args.reps is not None else (3 if args.quick else 9)
    if args.one:
        print(json.dumps(run_one(args.one, args.config, reps, args.budget, args.layers)))
        return

    models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c] or list(
        QUICK_CONFIGS if args.quick else CONFIGS
    )
    for name in (*models, *configs):
        if name not in (*MODELS, *CONFIGS):
            p.error(f"unknown model or config {name!r}")
    systems = [x for x in args.sweep_systems.split(",") if x]
    for name in systems:
        if name not in SWEEP_SYSTEMS:
            p.error(f"unknown sweep system {name!r}; choose from {', '.join(SWEEP_SYSTEMS)}")
    if args.sweep_only:
        models, configs = [], []
    print(f"anchor table: {len(models)} models x {len(configs)} configs", file=sys.stderr)
    rows = table(models, configs, reps)

    sweep = None
    if not args.no_sweep:
        cap = args.sweep_cap or (16 if args.quick else 64)
        base = _subprocess("gpt", "eager", 0, layers=args.sweep_base_layers)
        budget = int(base["peak"])
        print(f"sweep: budget {_mib(budget)} MiB, cap {cap} layers", file=sys.stderr)
        largest_by: dict[str, int] = {}
        tried: dict[str, list[dict[str, Any]]] = {}
        for system in systems:
            largest_by[system], tried[system] = largest(system, budget, cap)
        sweep = {
            "budget": budget,
            "base_layers": args.sweep_base_layers,
            "cap": cap,
            "largest": largest_by,
            "tried": tried,
        }

    import torch

    cpu = platform.processor() or platform.machine()
    result = {
        "command": "OMP_NUM_THREADS=1 python " + " ".join(sys.argv),
        "machine": f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "date": datetime.date.today().isoformat(),
        "reps": reps,
        "configs": configs,
        "table": rows,
        "sweep": sweep,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.sweep_name if args.sweep_only else "anchors_quick" if args.quick else "anchors"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (args.out / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
