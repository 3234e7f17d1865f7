"""Cost model: device profiles and roofline op times, for planning and time estimates.

    profile = device_profile("h100")                     # public-spec GPU profiles
    profile = device_profile("cpu")                      # calibrated once per machine, cached
    seconds = profile.op_time(flops, bytes_moved, dtype)  # max(flops / FLOP/s, bytes / bandwidth)

A :class:`DeviceProfile` holds what the planner needs to price its choices: compute throughput
per dtype, device memory bandwidth, the host link (PCIe) and disk bandwidths, and a fixed
per-op launch overhead. GPU numbers are the vendors' published peaks derated to what dense
kernels and pinned copies reach in practice (the derating factors are written out below); on CPU
they are measured by a short micro-benchmark on first use and cached in
``$XDG_CACHE_HOME/memcompile/`` (``~/.cache`` by default). On a CPU-only machine every GPU time
memcompile reports is an estimate from these profiles and is labelled as such.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

log = logging.getLogger(__name__)

__all__ = ["DeviceProfile", "calibrate_cpu", "device_profile", "resolve_profile_name"]

# Dense kernels reach ~70 % of the datasheet peak, copies ~80 % of the link's.
_COMPUTE_EFFICIENCY = 0.7
_COPY_EFFICIENCY = 0.8


@dataclass(frozen=True)
class DeviceProfile:
    """Throughputs of one device and its tiers.

    Attributes:
        name: ``cpu``, ``h100``, ``h200``, ``a100``.
        flops: achievable FLOP/s per dtype name (``float32``, ``bfloat16``, ...).
        memory_bandwidth: device memory bytes/s.
        host_bandwidth: device<->host copy bytes/s (PCIe for GPUs; memcpy on CPU).
        disk_bandwidth: host<->disk bytes/s.
        launch_overhead: seconds per op (kernel launch / Python dispatch).
        measured: the numbers were measured on this machine (else: from specs).
    """

    name: str
    flops: dict[str, float] = field(hash=False)
    memory_bandwidth: float
    host_bandwidth: float
    disk_bandwidth: float
    launch_overhead: float
    measured: bool = False

    def flops_for(self, dtype: torch.dtype | str) -> float:
        key = str(dtype).removeprefix("torch.")
        return self.flops.get(key, self.flops["float32"])

    def op_time(
        self, flops: float, bytes_moved: float, dtype: torch.dtype | str = "float32"
    ) -> float:
        """Roofline time of one op: the slower of compute and memory traffic, plus launch."""
        return self.launch_overhead + max(
            flops / self.flops_for(dtype), bytes_moved / self.memory_bandwidth
        )

    def copy_time(self, nbytes: float, tier: str = "host") -> float:
        """Seconds to move ``nbytes`` between the device and ``tier`` (``host`` or ``disk``)."""
        bandwidth = self.host_bandwidth if tier == "host" else self.disk_bandwidth
        return nbytes / bandwidth

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _spec(
    name: str, tflops: dict[str, float], hbm: float, pcie: float, disk: float
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        flops={k: v * 1e12 * _COMPUTE_EFFICIENCY for k, v in tflops.items()},
        memory_bandwidth=hbm * _COPY_EFFICIENCY,
        host_bandwidth=pcie * _COPY_EFFICIENCY,
        disk_bandwidth=disk,
        launch_overhead=5e-6,
    )


# Public datasheet peaks (dense, no sparsity): NVIDIA H100 SXM5 80GB (FP32 67 TFLOPS, TF32 tensor
# 494.7, BF16/FP16 989.4; HBM3 3.35 TB/s; PCIe 5.0 x16 64 GB/s), H200 SXM 141GB (the H100's
# compute; HBM3e 4.8 TB/s; PCIe 5.0 x16 64 GB/s) and A100 SXM4 80GB (FP32 19.5, TF32 156,
# BF16/FP16 312; HBM2e 2.039 TB/s; PCIe 4.0 x16 32 GB/s). Disk: one NVMe SSD, ~7 GB/s (PCIe 4)
# and ~12 GB/s (PCIe 5) sequential reads.
_SPECS: dict[str, DeviceProfile] = {
    "h100": _spec(
        "h100",
        {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
        3.35e12,
        64e9,
        12e9,
    ),
    "h200": _spec(
        "h200",
        {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
        4.8e12,
        64e9,
        12e9,
    ),
    "a100": _spec(
        "a100",
        {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
        2.039e12,
        32e9,
        7e9,
    ),
}


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    key = f"{platform.node()}-{os.cpu_count()}-{torch.get_num_threads()}t-torch{torch.__version__}"
    return base / "memcompile" / f"cpu_profile-{key}.json"


def _best_of(fn: object, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate_cpu() -> DeviceProfile:
    """Measure this machine's CPU: matmul FLOP/s, memory and disk bandwidth (~0.3 s).

    Safe to call from inside a backend: it leaves fake-tensor modes and the global RNG alone.
    """
    with _disable_current_modes(), torch.no_grad():
        return _calibrate_cpu()


def _calibrate_cpu() -> DeviceProfile:
    n = 384
    g = torch.Generator().manual_seed(0)  # never the global generator: that is the user's stream
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    flops = 2 * n**3 / _best_of(lambda: torch.mm(a, b))
    src = torch.empty(8 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    mem_bw = 2 * src.numel() / _best_of(lambda: dst.copy_(src))  # read + write
    host = np.empty(src.numel(), dtype=np.uint8)  # the host tier: memory outside torch
    host_bw = src.numel() / _best_of(lambda: np.copyto(host, src.numpy()))
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        payload = host.tobytes()

        def write() -> None:
            f.seek(0)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

        disk_bw = len(payload) / _best_of(write, repeats=2)
    # Eager FX runs one Python-dispatched op per node: ~10 us each.
    return DeviceProfile(
        name="cpu",
        flops={"float32": flops, "bfloat16": flops / 4, "float16": flops / 4, "float64": flops / 2},
        memory_bandwidth=mem_bw,
        host_bandwidth=host_bw,
        disk_bandwidth=disk_bw,
        launch_overhead=1e-5,
        measured=True,
    )


_loaded: dict[str, DeviceProfile] = {}


def device_profile(name: str) -> DeviceProfile:
    """The profile called ``name`` (``cpu``, ``h100``, ``h200``, ``a100``); ``cpu`` is calibrated on
    first use and cached on disk.

    Raises:
        ValueError: an unknown name.
    """
    if name in _SPECS:
        return _SPECS[name]
    if name != "cpu":
        raise ValueError(
            f"unknown device profile {name!r}; known: cpu, {', '.join(sorted(_SPECS))}"
        )
    if "cpu" not in _loaded:
        path = _cache_file()
        try:
            data = json.loads(path.read_text())
            _loaded["cpu"] = DeviceProfile(**data)
            log.debug("loaded the CPU profile from %s", path)
        except (OSError, ValueError, TypeError):
            _loaded["cpu"] = profile = calibrate_cpu()
            log.info(
                "calibrated the CPU profile: %.1f GFLOP/s, %.1f GB/s memory, %.1f GB/s disk",
                profile.flops["float32"] / 1e9,
                profile.memory_bandwidth / 1e9,
                profile.disk_bandwidth / 1e9,
            )
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Whole or not at all: processes calibrating at once (test workers) read it.
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(profile.to_dict(), indent=2))
                os.replace(tmp, path)
            except OSError as e:  # a read-only home: calibrate again next process
                log.debug("could not cache the CPU profile: %s", e)
    return _loaded["cpu"]


def resolve_profile_name(name: str, device: torch.device) -> str:
    """``"auto"`` -> the profile for ``device`` (GPUs by their name; unknown GPUs use h100)."""
    if name != "auto":
        return name
    if device.type != "cuda":
        return "cpu"
    gpu = torch.cuda.get_device_name(device).lower()
    for known in _SPECS:
        if known in gpu:
            return known
    log.warning("memcompile: no cost profile for GPU %r; planning with the h100 profile", gpu)
    return "h100"
