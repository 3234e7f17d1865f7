"""memcompile beside PyTorch's memory features on a CUDA GPU: peak from the CUDA allocator, time.

    python benchmarks/cuda_anchors.py                          # gpt + gpt_manual, default configs
    python benchmarks/cuda_anchors.py --models gpt --configs eager,mc_r50,mc_h25,mc_h25s
    python benchmarks/cuda_anchors.py --size large --models gpt --configs eager,inductor,mci_r25
    OMP_NUM_THREADS=1 python benchmarks/cuda_anchors.py --device cpu --size tiny   # plumbing only

The GPU counterpart of ``anchors.py`` (same models, at size ``bench`` by default or the GPU
check's ``large`` GPT: 6 layers, d 1024, T 1024, B 8; same configurations and budget rule:
``resident + f * eager step peak``), all in one process per model. ``mci_`` runs a ``mc_``
configuration with ``inner="inductor"`` (``mci_none``: no budget), ``mca_`` with ``inner="auto"``
(Inductor on CUDA, eager kernels where no plan of Inductor's fits); ``mci_amb50`` / ``mci_amb10``
take the measured peak of ``inductor_amb50`` / ``inductor_amb10`` as their budget (issue 42's
comparison: memcompile given the memory Inductor's own budget ended at). For each configuration:

* the model is built twice from one seed (an eager reference and the configured copy), moved to
  the GPU, and each runs 2 warm-up steps (compiles happen here);
* one step (``zero_grad(set_to_none)``, forward, backward, no optimizer) is measured with
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (absolute, like the
  budget), and ``max_memory_reserved`` beside it (what the caching allocator held);
* losses and gradients are compared bitwise with the eager copy (same dropout seed);
* ``--reps`` steps are timed interleaved with the eager copy (each step synchronized), and the
  median of the paired wall-time ratios is reported.

A trailing ``s`` (``mc_h25s``) runs the same plan with synchronous host copies
(``TieredStore(asynchronous=False)``): the difference to ``mc_h25`` is what the side stream and
the prefetching buy. ``--device cpu`` runs the same code on the CPU (peak from the CPU profiler,
``memcompile.measure``; no reserved bytes): a dry run of the script, not a CPU benchmark
(``anchors.py`` is that). Each row is printed as one JSON line as soon as it is measured
(``gpu_check.py`` reads them). Results: ``benchmarks/results/cuda_anchors.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from anchors import _memcompile_options, _mib, budget_for, build, configure

import memcompile
from memcompile.report import find_compiler

RESULTS = Path(__file__).parent / "results" / "cuda_anchors"
DEFAULT_CONFIGS = (
    "eager,checkpoint,sac,inductor_amb50,inductor_amb10,mc_none,mc_r50,mc_r35,mc_r25,"
    "mc_s50,mc_s50s,mc_s35,mc_s35s,mc_h25,mc_h15,mc_h10"
)
#: The GPU check's GPT: a step takes >= 50 ms on an H100 in fp32 (issue 42: ~4.5 TFLOP a step),
#: with 6 layers rather than 12 and twice the batch: the same work in half the graph, so that
#: Inductor's and memcompile's compiles leave the check's 8 minutes room for more rows.
LARGE = dict(layers=6, d_model=1024, heads=16, seq_len=1024, batch=8, vocab=8192)


def workload(model: str, size: str) -> Any:
    """``model`` at ``size``: the zoo's sizes, or ``large`` (GPT only)."""
    if size == "bench":
        return build(model)
    if size == "large":
        if model not in ("gpt", "gpt_manual"):
            raise ValueError("--size large applies to gpt and gpt_manual only")
        from memcompile.zoo import gpt

        return gpt.workload(LARGE, manual=model == "gpt_manual")
    from memcompile import zoo

    return zoo.build(model, size=size, seed=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(fn: Any, net: torch.nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    net.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout draws the same mask in both copies
    loss = fn(*batch)
    loss.backward()
    return loss.detach()


def _timed(fn: Any, net: torch.nn.Module, batch: tuple[Any, ...], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    _step(fn, net, batch)
    _sync(device)
    return time.perf_counter() - t0


def _split(config: str) -> tuple[str, str, bool]:
    """``(base config, inner compiler, synchronous copies)``: ``mci_h25s`` is ``mc_h25`` with
    ``inner="inductor"`` and a synchronous store; ``mca_r25`` is ``mc_r25`` with
    ``inner="auto"``."""
    sync = config.startswith("mc") and config.endswith("s")
    base = config[:-1] if sync else config
    for prefix, inner in (("mci_", "inductor"), ("mca_", "auto")):
        if base.startswith(prefix):
            return "mc_" + base[4:], inner, sync
    return base, "eager", sync


def _budget(config: str, rows: dict[str, dict[str, Any]]) -> int | None:
    """The absolute budget of ``config`` from the rows measured before it in this process."""
    base, _, _ = _split(config)
    if base.startswith("mc_amb"):
        source = rows.get("inductor_" + base[3:])
        if source is None or "peak" not in source:
            raise ValueError(f"{config} needs inductor_{base[3:]} measured before it")
        return int(source["peak"])
    return budget_for(base, rows["eager"]) if "eager" in rows else None


def _configured(config: str, wl: Any, budget: int | None, disk_dir: str) -> Any:
    base, inner, _ = _split(config)
    if not base.startswith("mc_"):
        return configure(base, wl, budget, disk_dir)
    opts = (
        {"budget": budget, "on_infeasible": "error"}
        if base.startswith("mc_amb")
        else _memcompile_options(base, budget, disk_dir)
    )
    return memcompile.compile(wl.model, **opts, inner=inner)


def run(
    model: str,
    config: str,
    reps: int,
    rows: dict[str, dict[str, Any]],
    *,
    size: str = "bench",
    device: str = "cuda",
) -> dict[str, Any]:
    """One configuration: peak, bit-identity and paired time against an eager copy.

    ``rows`` holds the rows measured before it in this process, by configuration (``eager``
    first: the budgets are set from it).
    """
    dev = torch.device(device)
    torch._dynamo.reset()
    torch._functorch.config.activation_memory_budget = 1.0
    gc.collect()  # the last configuration's models must not stay on the device
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    _, _, sync = _split(config)
    budget = _budget(config, rows)
    ref, wl = workload(model, size), workload(model, size)
    ref.model.to(dev)
    wl.model.to(dev)
    ref.model.load_state_dict(wl.model.state_dict())
    out: dict[str, Any] = {"model": wl.name, "size": size, "config": config, "budget": budget}
    batch = tuple(t.to(dev) for t in wl.batch(0))
    # The reference copy's parameters are on the device too; memcompile counts what is already
    # allocated on a GPU against its budget, so it gets them on top (they are subtracted below
    # as well). The CPU profiler sees only what the step reaches: nothing to add there.
    ref_bytes = (
        sum(p.numel() * p.element_size() for p in ref.model.parameters())
        if dev.type == "cuda"
        else 0
    )
    with tempfile.TemporaryDirectory(prefix="memcompile-cuda-") as disk_dir:
        fn = _configured(config, wl, None if budget is None else budget + ref_bytes, disk_dir)
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _step(fn, wl.model, batch)
                if sync:
                    find_compiler(fn)[0].store.asynchronous = False
                _step(fn, wl.model, batch)
        except memcompile.MemoryBudgetError as e:
            out.update(fits=False, min_feasible=e.min_feasible, error=str(e).splitlines()[0])
            out["device_other"] = find_compiler(fn)[0].device_other_bytes
            return out
        out["first_steps_s"] = time.perf_counter() - t0
        out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
        loss = _step(fn, wl.model, batch)
        ref_loss = _step(ref.model, ref.model, batch)
        out["loss_equal"] = bool(torch.equal(loss, ref_loss))
        out["loss_diff"] = float((loss.float() - ref_loss.float()).abs())
        diffs = [
            float((a.grad.float() - b.grad.float()).abs().max())
            for a, b in zip(wl.model.parameters(), ref.model.parameters(), strict=True)
            if a.grad is not None and b.grad is not None
        ]
        out["grads_equal"] = all(
            (a.grad is None and b.grad is None)
            or (a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad))
            for a, b in zip(wl.model.parameters(), ref.model.parameters(), strict=True)
        )
        out["grad_max_abs_diff"] = max(diffs, default=0.0)
        wl.model.zero_grad(set_to_none=True)
        ref.model.zero_grad(set_to_none=True)
        _sync(dev)
        if dev.type == "cuda":
            # The reference copy stays resident (the same for every config): subtract it too.
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(fn, wl.model, batch)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            reserved: int | None = torch.cuda.max_memory_reserved()
        else:
            m = memcompile.measure(lambda: _step(fn, wl.model, batch), device="cpu")
            peak, resident, reserved = m.peak, m.resident_bytes, None
        out.update(
            peak=peak - ref_bytes,
            resident=resident - ref_bytes,
            step_peak=peak - resident,
            reserved=reserved,
        )
        if budget is not None:
            out["within_budget"] = out["peak"] <= budget * 1.02
        if config.startswith("mc"):
            rep = memcompile.report(fn)
            assert rep.predicted_peak is not None  # a step ran
            out["predicted_peak"] = rep.predicted_peak - ref_bytes
            out["prediction_error"] = out["predicted_peak"] / out["peak"] - 1
            plans = rep.plan.fragments
            out["recomputed"] = sum(len(p.recomputed) for p in plans)
            out["swapped"] = sum(len(p.swapped) for p in plans)
            out["prefetched"] = sum(len(p.prefetch) for p in plans)
            out["predicted_stall_s"] = sum(p.swap_stall or 0.0 for p in plans)
            out["predicted_overhead_s"] = sum(p.recompute_time + p.swap_time for p in plans)
            out["in_flight_after"] = find_compiler(fn)[0].store.in_flight()
            out["device_other"] = find_compiler(fn)[0].device_other_bytes
            # Which inner compiler each fragment ran (inner="auto": eager kernels where no plan
            # of Inductor's fit).
            out["inner"] = sorted({f.inner for f in rep.fragments})
        ratios, times, eager_times = [], [], []
        for _ in range(reps):
            a = _timed(ref.model, ref.model, batch, dev)
            b = _timed(fn, wl.model, batch, dev)
            ratios.append(b / a)
            times.append(b)
            eager_times.append(a)
        out["time_ratio"] = statistics.median(ratios)
        out["step_ms"] = 1e3 * statistics.median(times)
        out["eager_step_ms"] = 1e3 * statistics.median(eager_times)
        out["fits"] = True
    return out


def render(result: dict[str, Any]) -> str:
    lines = [
        "# memcompile on CUDA: peak (CUDA allocator) and time vs PyTorch's features"
        if "CPU" not in result["machine"]
        else "# memcompile on the CPU device: peak (CPU profiler) and time vs PyTorch's features",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']}  ",
        f"Date: {result['date']}",
        "",
        "step peak = max_memory_allocated − memory allocated at the step's start (parameters, "
        "batch); vs eager = step peak / eager's; time = median paired wall-time ratio vs an "
        "eager copy (each step synchronized). bit-id = loss and every gradient equal to eager "
        "(else the largest gradient difference). pred. = predicted peak / measured − 1. "
        '`mci_` = memcompile with inner="inductor", `mca_` with inner="auto".',
        "",
        "| model | config | budget MiB | peak MiB | predicted MiB | pred. | step peak MiB "
        "| vs eager | reserved MiB | time × eager | step ms | bit-id | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager: dict[str, float] = {}
    for r in result["rows"]:
        if r["config"] == "eager" and "step_peak" in r:
            eager[r["model"]] = r["step_peak"]
        if not r.get("fits", False):
            lines.append(
                f"| {r['model']} | {r['config']} | {_mib(r.get('budget'))} | does not fit: "
                f"{r.get('error', '')[:90]} ||||||||||"
            )
            continue
        vs = r["step_peak"] / eager[r["model"]] if r["model"] in eager else None
        plan = (
            f"R{r['recomputed']} S{r['swapped']} P{r['prefetched']} "
            f"stall {1e3 * r['predicted_stall_s']:.2f} ms"
            + (f" ({'+'.join(r['inner'])})" if r.get("inner") and r["config"][:4] == "mca_" else "")
            if "recomputed" in r
            else ""
        )
        pred = f"{100 * r['prediction_error']:+.1f} %" if "prediction_error" in r else ""
        bit_id = (
            "yes"
            if r["loss_equal"] and r["grads_equal"]
            else f"no ({r.get('grad_max_abs_diff', float('nan')):.1e})"
        )
        lines.append(
            f"| {r['model']} | {r['config']} | {_mib(r.get('budget'))} | {_mib(r['peak'])} "
            f"| {_mib(r.get('predicted_peak'))} | {pred} | {_mib(r['step_peak'])} "
            f"| {'—' if vs is None else f'{vs:.2f}×'} | {_mib(r['reserved'])} "
            f"| {r['time_ratio']:.2f} | {r['step_ms']:.2f} | {bit_id} | {plan} |"
        )
    return "\n".join(lines) + "\n"


def machine(device: str) -> str:
    """The device, torch and the platform, in one line."""
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    return f"{name}, torch {torch.__version__}, {platform.platform()}"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="gpt,gpt_manual")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--size", default="bench", choices=("tiny", "small", "bench", "large"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_anchors.py needs a CUDA device (--device cpu runs it as a dry run)")
    rows = []
    for model in args.models.split(","):
        done: dict[str, dict[str, Any]] = {}
        for config in ["eager", *(c for c in args.configs.split(",") if c != "eager")]:
            try:
                row = run(model, config, args.reps, done, size=args.size, device=args.device)
            except Exception as e:  # one broken configuration must not lose the others
                row = {"model": model, "config": config, "error": f"{type(e).__name__}: {e}"}
            done[config] = row
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine(args.device),
        "date": dt.date.today().isoformat(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
