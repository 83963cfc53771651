"""Activation memory modes and distributed Muon on the llama3 debug model, 4 CPU ranks (hp-fsdp).

Part 1, activation modes: for ``none``, ``full``, ``swap`` and ``memory_budget`` (0.5; blocks
compiled with the ``aot_eager_decomp_partition`` backend, which runs the min-cut partitioner on
CPU), every rank builds the debug model with the same seed, applies the mode, shards it with
hp-fsdp and runs forward + backward on its own batch. Reported per mode: the peak tensor
memory of one step on the largest rank (PyTorch's tensor-level ``MemTracker``, not RSS; not for
``memory_budget``: ``torch.compile`` falls back to eager under that dispatch mode), the
bytes of the storages autograd keeps through an outer ``saved_tensors_hooks`` (what stays on the
device between forward and backward, parameters' unsharded copies included; swapped tensors and a
``full`` region's recomputed activations are not among them), and the slowest rank's median step
time as a ratio to ``none`` in the same run. On CPU the host is the device: swap shows its overhead
only (its host buffers live in the same memory); on a GPU it is where the saving shows.

Part 2, optimizers: on the same sharded model, the median ``optimizer.step()`` time of
``get_hyper_optimizer`` (Muon on the hidden matrices, AdamW on the rest) over AdamW's (for-loop)
on all parameters, steps alternating, warm-up discarded.

Usage::

    [AC_MODES=none,full,swap,memory_budget] python benchmarks/ac_and_muon.py [--steps 3]
        [--seq 128] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

WORLD = 4
MODES = tuple(os.environ.get("AC_MODES", "none,full,swap,memory_budget").split(","))


def _peak_bytes(step: Any) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _build(mode: str, mesh: Any) -> torch.nn.Module:
    import hp_fsdp
    from hp_trainer import (
        ActivationCheckpointConfig,
        CompileConfig,
        apply_ac,
        apply_compile,
        get_model_spec,
    )

    torch.manual_seed(0)
    model = get_model_spec("llama3").build("debugmodel")
    if mode != "none":
        apply_ac(model, ActivationCheckpointConfig(mode=mode, memory_budget=0.5))  # type: ignore[arg-type]
    if mode == "memory_budget":
        apply_compile(model, CompileConfig(enable=True, backend="aot_eager_decomp_partition"))
    for layer in model.layers.values():  # type: ignore[union-attr, operator]
        hp_fsdp.fully_shard(layer, mesh=mesh)
    hp_fsdp.fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, init_file: str, steps: int, seq: int, result_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 2048, (2, seq), generator=gen)
    models = {mode: _build(mode, mesh) for mode in MODES}
    saved_bytes: dict[str, int] = {}

    def step(mode: str) -> None:
        models[mode](tokens).float().logsumexp(-1).mean().backward()

    for mode in MODES:  # warm-up (compiles memory_budget's blocks)
        step(mode)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(steps):
        for mode in MODES:
            dist.barrier()
            t0 = time.perf_counter()
            step(mode)
            times[mode].append(time.perf_counter() - t0)
    # MemTracker is a dispatch mode, under which torch.compile falls back to eager: the compiled
    # mode is measured by what it keeps, not by MemTracker
    peaks = {
        mode: _peak_bytes(lambda m=mode: step(m))  # type: ignore[misc]
        for mode in MODES
        if mode != "memory_budget"
    }
    for mode in MODES:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = models[mode](tokens).float().logsumexp(-1).mean()
        loss.backward()
        saved_bytes[mode] = sum(storages.values())

    from hp_trainer import get_hyper_optimizer

    model = models["none"]
    optims = {
        "muon": get_hyper_optimizer(model, lr=1e-3),
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False),
    }
    opt_times: dict[str, list[float]] = {k: [] for k in optims}
    step("none")
    for i in range(steps + 1):
        for name, opt in optims.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if i > 0:
                opt_times[name].append(time.perf_counter() - t0)
    out = {
        "time": {m: statistics.median(v) for m, v in times.items()},
        "peak": peaks,
        "saved": saved_bytes,
        "opt": {k: statistics.median(v) for k, v in opt_times.items()},
    }
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(result_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _mib(value: float | None) -> str:
    return "n/a (compiled)" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(os.path.join(tmp, "init"), args.steps, args.seq, result),
            nprocs=WORLD,
        )
        ranks = json.loads(Path(result).read_text())
    base_time = max(r["time"]["none"] for r in ranks)
    rows = []
    for mode in MODES:
        rows.append(
            {
                "mode": mode,
                "peak_mib": max(r["peak"][mode] for r in ranks) / 2**20
                if mode in ranks[0]["peak"]
                else None,
                "kept_activations_mib": max(r["saved"][mode] for r in ranks) / 2**20,
                "step_time_vs_none": max(r["time"][mode] for r in ranks) / base_time,
            }
        )
    muon_ratio = max(r["opt"]["muon"] for r in ranks) / max(r["opt"]["adamw"] for r in ranks)
    lines = [
        f"llama3 debugmodel, {WORLD} CPU ranks (hp-fsdp), local batch 2 x {args.seq}, "
        f"{args.steps} timed steps",
        "",
        "| AC mode | peak tensor MiB (max rank) | activations kept MiB | step time / none |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {_mib(row['peak_mib'])} | {row['kept_activations_mib']:.1f} "
            f"| {row['step_time_vs_none']:.2f} |"
        )
    lines += ["", f"Muon (get_hyper_optimizer) step time / AdamW step time: {muon_ratio:.2f}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ac_and_muon.json").write_text(
        json.dumps({"rows": rows, "muon_over_adamw": muon_ratio, "ranks": ranks}, indent=2)
    )
    (out / "ac_and_muon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
