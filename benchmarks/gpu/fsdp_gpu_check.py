"""hp-fsdp on a GPU: parity with PyTorch's FSDP2, peak memory, step time and overlap.

One script for a machine with at least one GPU (about 2 minutes on one H100/H200 class GPU).
It runs with 1 process, and with 2 processes when two GPUs are visible (NCCL), and for each
world size and for fp32 and bf16 mixed precision:

- **parity**: hp-fsdp and ``torch.distributed.fsdp.fully_shard`` train copies of one model on
  the same data (different per rank) for a few AdamW steps; the sharded parameters must be
  bitwise equal after every step;
- **peak memory**: ``torch.cuda.max_memory_allocated`` over one step of each (ratio ours/torch);
- **step time**: median of CUDA-event timed steps of each (ratio ours/torch);
- **overlap**: from a profiler trace of two steps, the share of NCCL kernel time that overlaps
  compute kernels on another stream, for each implementation;
- **host syncs**: forward and backward of one step under the device's sync debug mode
  ``"error"`` (``torch.cuda.set_sync_debug_mode``): any operation that stops the host fails the
  row for hp-fsdp (torch's result is printed beside it);
- **symmetric memory** (2 processes, only where NCCL symmetric memory is available: compute
  capability 9.0+): hp-fsdp with ``set_symm_mem_for_comm`` on every unit trains beside hp-fsdp
  without it and beside PyTorch's FSDP2 with it (bf16); bitwise equality after every step, the
  pool's buffer, rendezvous and all-gather counts (rendezvous == buffers, no allocation after the
  first step) and the step-time ratio pooled/normal. Elsewhere the row says why it was skipped.

Without a GPU it prints a line saying so and exits with status 0 (nothing is checked).

Usage::

    python benchmarks/gpu/fsdp_gpu_check.py [--steps 6] [--out fsdp_gpu_check.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import hp_fsdp
from hp_dtensor.device import (
    device_count,
    get_device_type,
    init_process_group,
    is_accelerator,
    peak_memory_bytes,
    reset_peak_memory_stats,
    synchronize,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # _common.py is one up

from _common import TiedTransformer, free_port

VOCAB, DIM, HEADS, SEQ, BATCH, BLOCKS = 4096, 1024, 16, 512, 4, 6


def _shard(model: TiedTransformer, api: Any, mesh: Any, precision: str) -> None:
    kwargs: dict[str, Any] = {"mesh": mesh}
    if precision == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        api.fully_shard(layer, **kwargs)
    api.fully_shard(model, **kwargs)


def _batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    tokens, targets = batch
    logits = model(tokens)
    F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def _overlap(prof: Any) -> float:
    """Share of NCCL kernel time overlapped by non-NCCL kernels on other streams."""
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    comm = [e for e in kernels if "nccl" in e.name.lower()]
    compute = [e for e in kernels if "nccl" not in e.name.lower()]
    total = sum(e.time_range.elapsed_us() for e in comm)
    if total == 0:
        return 0.0
    covered = 0.0
    for c in comm:
        start, end = c.time_range.start, c.time_range.end
        spans = sorted(
            (max(start, k.time_range.start), min(end, k.time_range.end))
            for k in compute
            if k.time_range.end > start and k.time_range.start < end
        )
        reach = start
        for a, b in spans:
            a = max(a, reach)
            if b > a:
                covered += b - a
                reach = b
    return covered / total


def _run_one(rank: int, world: int, precision: str, steps: int) -> dict[str, Any]:
    device = torch.device(get_device_type(), rank)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    with torch.device(device):
        base = TiedTransformer(VOCAB, DIM, HEADS, BLOCKS)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    _shard(ours, hp_fsdp, mesh, precision)
    _shard(theirs, torch_fsdp, mesh, precision)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=True)
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=True)
    bitwise = True
    for step in range(steps):
        batch = _batch(step, rank, device)
        _step(ours, opt_o, batch)
        _step(theirs, opt_t, batch)
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            bitwise &= bool(torch.equal(p.to_local(), q.to_local()))
    result: dict[str, Any] = {"world": world, "precision": precision, "bitwise": bitwise}
    for name, model, opt in (("ours", ours, opt_o), ("torch", theirs, opt_t)):
        synchronize(device)
        reset_peak_memory_stats(device)
        _step(model, opt, _batch(99, rank, device))
        synchronize(device)
        result[f"peak_bytes_{name}"] = peak_memory_bytes(device)
        times = []
        for step in range(steps):
            start, end = (
                torch.Event(device.type, enable_timing=True),
                torch.Event(device.type, enable_timing=True),
            )
            start.record()
            _step(model, opt, _batch(200 + step, rank, device))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        result[f"step_ms_{name}"] = statistics.median(times)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in range(2):
                _step(model, opt, _batch(300 + step, rank, device))
            synchronize(device)
        result[f"overlap_{name}"] = _overlap(prof)
        result[f"host_syncs_{name}"] = _sync_free(model, _batch(400, rank, device))
    result["peak_ratio"] = result["peak_bytes_ours"] / max(result["peak_bytes_torch"], 1)
    result["step_ratio"] = result["step_ms_ours"] / result["step_ms_torch"]
    return result


def _sync_free(model: nn.Module, batch: Any) -> str:
    """Forward and backward of one step under the device's sync debug mode ``"error"``.

    The optimizer step is left out (AdamW reads its step counters on the host). Returns
    ``"none"`` when no operation synchronized the host, else the error's first line.
    """
    backend = getattr(torch, next(model.parameters()).device.type)
    tokens, targets = batch
    backend.synchronize()
    backend.set_sync_debug_mode("error")
    try:
        logits = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        backend.set_sync_debug_mode("default")
        model.zero_grad()
    return "none"


def _median_step_ms(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> float:
    device = next(model.parameters()).device
    times = []
    for step in range(steps):
        start = torch.Event(device.type, enable_timing=True)
        end = torch.Event(device.type, enable_timing=True)
        start.record()
        _step(model, opt, _batch(400 + step, rank, device))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _run_symm_mem(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Pooled symmetric-memory all-gathers against the normal path and torch's (bf16)."""
    from hp_fsdp.symm_mem import NCCLSymmetricMemory, SymmetricMemoryAllGather

    device = torch.device(get_device_type(), rank)
    mesh = init_device_mesh(device.type, (world,))
    row: dict[str, Any] = {"world": world, "precision": "bf16", "check": "symm_mem"}
    reason = NCCLSymmetricMemory().unavailable(device, [mesh.get_group()])
    if reason is not None:
        row["skipped"] = reason
        return row
    torch.manual_seed(0)
    with torch.device(device):
        base = TiedTransformer(VOCAB, DIM, HEADS, BLOCKS)
    pooled, normal, theirs = (copy.deepcopy(base) for _ in range(3))
    _shard(pooled, hp_fsdp, mesh, "bf16")
    _shard(normal, hp_fsdp, mesh, "bf16")
    _shard(theirs, torch_fsdp, mesh, "bf16")
    units = [m for m in pooled.modules() if isinstance(m, hp_fsdp.FSDPModule)]
    for unit in units:
        unit.set_symm_mem_for_comm()
    try:
        for module in theirs.modules():
            if isinstance(module, torch_fsdp.FSDPModule):
                module.set_symm_mem_for_comm()
        row["torch_symm_mem"] = True
    except Exception as exc:  # an older torch, or a build without NCCL symmetric memory
        row["torch_symm_mem"] = f"{type(exc).__name__}: {exc}"
    models = {"pooled": pooled, "normal": normal, "torch": theirs}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for k, m in models.items()}
    bitwise = {"normal": True, "torch": True}
    allocations = []
    comm = units[0]._get_fsdp_state().groups[0].options.custom_all_gather
    assert isinstance(comm, SymmetricMemoryAllGather)
    for step in range(steps):
        batch = _batch(step, rank, device)
        for name, model in models.items():
            _step(model, opts[name], batch)
        for name in bitwise:
            for p, q in zip(pooled.parameters(), models[name].parameters(), strict=True):
                bitwise[name] &= bool(torch.equal(p.to_local(), q.to_local()))
        assert comm.pool is not None
        allocations.append(comm.pool.allocations)
    pool = comm.pool
    assert pool is not None
    row.update(
        bitwise=bitwise["normal"] and bitwise["torch"],
        bitwise_vs_normal=bitwise["normal"],
        bitwise_vs_torch=bitwise["torch"],
        buffers=pool.allocations,
        rendezvous=pool.rendezvous_count,
        all_gathers=pool.acquisitions,
        allocations_per_step=allocations,
    )
    row["pooled_ok"] = (
        pool.rendezvous_count == pool.allocations and allocations == [allocations[0]] * steps
    )
    pooled_ms = _median_step_ms(pooled, opts["pooled"], rank, steps)
    normal_ms = _median_step_ms(normal, opts["normal"], rank, steps)
    row["step_ratio_pooled_vs_normal"] = pooled_ms / normal_ms
    return row


def _worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_process_group(world_size=world, rank=rank, device_id=rank)
    results = [_run_one(rank, world, precision, steps) for precision in ("fp32", "bf16")]
    if world >= 2:
        try:
            results.append(_run_symm_mem(rank, world, steps))
        except Exception as exc:  # reported as a failed row; the other rows still print
            results.append(
                {"world": world, "check": "symm_mem", "error": f"{type(exc).__name__}: {exc}"}
            )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = []
        for i, row in enumerate(results):
            per_rank = [g[i] for g in gathered]
            row = dict(row)
            if row.get("check") == "symm_mem":
                errors = [r["error"] for r in per_rank if "error" in r]
                if errors:
                    row["error"] = errors[0]
                elif "skipped" not in row:
                    row["bitwise"] = all(r["bitwise"] for r in per_rank)
                    row["pooled_ok"] = all(r["pooled_ok"] for r in per_rank)
                merged.append(row)
                continue
            row["bitwise"] = all(r["bitwise"] for r in per_rank)
            row["step_ratio"] = max(r["step_ratio"] for r in per_rank)
            row["peak_ratio"] = max(r["peak_ratio"] for r in per_rank)
            merged.append(row)
        with open(out, "a", encoding="utf-8") as handle:
            for row in merged:
                handle.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


def _print_symm_mem(row: dict[str, Any]) -> bool:
    """Print the symmetric-memory row; True when it failed."""
    prefix = f"world={row['world']} symm_mem:"
    if "error" in row:
        print(f"{prefix} FAILED {row['error']}")
        return True
    if "skipped" in row:
        print(f"{prefix} skipped ({row['skipped']})")
        return False
    print(
        f"{prefix} bitwise vs normal={row['bitwise_vs_normal']} vs torch={row['bitwise_vs_torch']} "
        f"(torch symm_mem: {row['torch_symm_mem']}) buffers={row['buffers']} "
        f"rendezvous={row['rendezvous']} all-gathers={row['all_gathers']} "
        f"allocations/step={row['allocations_per_step']} "
        f"step pooled/normal={row['step_ratio_pooled_vs_normal']:.3f}"
    )
    return not (row["bitwise"] and row["pooled_ok"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="fsdp_gpu_check.json")
    args = parser.parse_args()
    if not is_accelerator():
        print("fsdp_gpu_check: no GPU on this machine; nothing was checked")
        return 0
    out = Path(args.out)
    out.unlink(missing_ok=True)
    worlds = [1] + ([2] if device_count() >= 2 else [])
    for world in worlds:
        mp.spawn(_worker, args=(world, free_port(), args.steps, str(out)), nprocs=world)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    failed = False
    for row in rows:
        if row.get("check") == "symm_mem":
            failed |= _print_symm_mem(row)
            continue
        print(
            f"world={row['world']} {row['precision']}: bitwise={row['bitwise']} "
            f"step ours/torch={row['step_ratio']:.3f} peak ours/torch={row['peak_ratio']:.3f} "
            f"overlap ours={row['overlap_ours']:.2f} torch={row['overlap_torch']:.2f} "
            f"host syncs in forward+backward ours={row['host_syncs_ours']} "
            f"torch={row['host_syncs_torch']}"
        )
        failed |= not row["bitwise"] or row["host_syncs_ours"] != "none"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
