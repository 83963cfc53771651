"""``hp-plan calibrate``: measure this machine into a device profile.

Each of ``world_size`` ranks (gloo on the CPU; the accelerator's backend elsewhere) measures at
the same time, so a shared machine's contention is in the figures: the matrix-multiply rate
(FLOP/s of a square fp32 multiply, the median of several), the cost of launching one small
operator and the extra cost of one on a DTensor, the memory bandwidth (a large copy), and
all-reduce / all-gather times at two sizes,
from which the alpha-beta line is solved (latency = the intercept, bandwidth = the slope).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from hp_trainer.planner.profiles import DeviceProfile

__all__ = ["calibrate_device_profile"]


def _timed(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(matmul_dim: int, repeat: int) -> dict[str, float]:
    """One rank's measurements (runs on every rank at once)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(matmul_dim, matmul_dim)
    b = torch.randn(matmul_dim, matmul_dim)
    torch.mm(a, b)
    t_mm = _timed(lambda: torch.mm(a, b), repeat)
    x = torch.randn(16)
    t_op = _timed(lambda: [x.add(1.0) for _ in range(200)], repeat) / 200
    big = torch.randn(8 * 2**20)  # 32 MiB
    dst = torch.empty_like(big)
    t_copy = _timed(lambda: dst.copy_(big), repeat)
    out: dict[str, float] = {
        "flops": 2 * matmul_dim**3 / t_mm,
        "op": t_op,
        "mem_bw": 2 * big.numel() * 4 / t_copy,
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        n = dist.get_world_size()
        mesh = init_device_mesh(x.device.type, (n,))
        dx = distribute_tensor(x, mesh, [Replicate()])
        t_dt = _timed(lambda: [dx.add(1.0) for _ in range(50)], repeat) / 50
        out["dtensor"] = max(t_dt - t_op, 0.0)
        small, large = torch.randn(256), torch.randn(2**20)  # 1 KiB, 4 MiB
        for name, t in (("small", small), ("large", large)):
            dist.barrier()
            out[f"ar_{name}"] = _timed(lambda t=t: dist.all_reduce(t), repeat)
        # ring all-reduce: 2 (n-1) alpha + 2 (n-1)/n bytes / beta
        steps = 2 * (n - 1)
        vol = 2 * (n - 1) / n
        slope = (out["ar_large"] - out["ar_small"]) / ((large.numel() - small.numel()) * 4 * vol)
        out["beta"] = 1.0 / max(slope, 1e-15)
        out["alpha"] = max(out["ar_small"] - small.numel() * 4 * vol * slope, 0.0) / steps
    return out


def calibrate_device_profile(
    world_size: int = 4, *, name: str = "cpu", matmul_dim: int = 512, repeat: int = 5
) -> DeviceProfile:
    """Measure this machine with ``world_size`` ranks and return its profile.

    Args:
        world_size: Ranks measured at the same time (as many as the jobs the profile is for).
        name: The profile's name.
        matmul_dim: Size of the square matrix multiply timed.
        repeat: Repetitions per figure (the median is kept).

    Returns:
        The measured profile (the network is one node: every group intra-node; host = device).

    See Also:
        :titan:`torchtitan.tools.utils.get_peak_flops`: TorchTitan's peak is a table, not a
        measurement.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if world_size == 1:
        m = _measure(matmul_dim, repeat)
        m.update(alpha=1e-5, beta=m["mem_bw"], dtensor=0.0)
    else:
        from hp_dtensor.testing import run_distributed

        results = run_distributed(_measure, world_size, matmul_dim, repeat, timeout=300)
        m = {k: statistics.median(r[k] for r in results) for k in results[0]}
    import os

    host = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return DeviceProfile(
        name=name,
        description=f"measured by hp-plan calibrate on this machine with {world_size} ranks",
        peak_flops=m["flops"],
        sustained_fraction=1.0,
        memory_bytes=host / world_size,
        memory_bandwidth=m["mem_bw"],
        devices_per_node=max(world_size, 1),
        intra_node_bandwidth=m["beta"],
        intra_node_efficiency=1.0,
        intra_node_latency=m["alpha"],
        inter_node_bandwidth=m["beta"],
        inter_node_efficiency=1.0,
        inter_node_latency=m["alpha"],
        host_bandwidth=m["mem_bw"],
        host_memory_bandwidth=m["mem_bw"],
        host_memory_bytes=host,
        kernel_overhead=m["op"],
        dtensor_overhead=m["dtensor"],
    )
