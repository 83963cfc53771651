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

Part 2, optimizers: on the same sharded model (one forward + backward gives the gradients),
``optimizer.step()`` of four optimizers, steps alternating, warm-up discarded, the slowest rank's
median per optimizer; the run is repeated with the order reversed and the two ratios combined by
their geometric mean (DESIGN.md's statistic):

- ``Muon`` (``get_hyper_optimizer``: Muon on the hidden matrices, AdamW on the rest), each matrix
  orthogonalised on one owner rank, two all-to-alls per step;
- the same update computed the pre-issue-29 way (every rank gathers every matrix with a blocking
  ``full_tensor()`` and orthogonalises it: the work duplicated on every rank);
- ``torch.optim.AdamW`` (for-loop) on all parameters, the baseline;
- a second, identical AdamW: the noise row (AdamW / AdamW).

Newton-Schulz FLOPs per rank (``Muon.work_division``; deterministic, the primary evidence on a
loaded machine), bytes sent per rank and collectives per step are reported beside the ratios.
On CPU every rank is one process on a shared host: the times are ratios, never absolutes.

Usage::

    [AC_MODES=none,full,swap,memory_budget] python benchmarks/ac_and_muon.py [--steps 3]
        [--seq 128] [--parts ac,muon] [--opt-steps 8] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
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


def _ac_part(models: dict[str, Any], tokens: torch.Tensor, steps: int) -> dict[str, Any]:
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
    return {
        "time": {m: statistics.median(v) for m, v in times.items()},
        "peak": peaks,
        "saved": saved_bytes,
    }


def _gather_everywhere(base: type) -> type:
    """Muon as before issue 29: every rank gathers every matrix and orthogonalises it."""
    from torch.distributed.tensor import DTensor, Replicate

    from hp_trainer.components.optimizer import muon as muon_module

    class GatherEverywhere(base):  # type: ignore[misc, valid-type]
        def _muon_step(self) -> None:
            for group in self.param_groups:
                if not group["use_muon"]:
                    continue
                lr, mu = float(group["lr"]), group["momentum"]
                for p in group["params"]:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - mu)
                    update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                    ortho = muon_module._orthogonalize(
                        update.full_tensor(), group["ns_coefficients"], group["ns_steps"], 1e-7
                    )
                    mesh = p.device_mesh
                    mine = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim)
                    scale = muon_module._lr_scale(group["adjust_lr_fn"], *p.shape)
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(mine.redistribute(mesh, p.placements), alpha=-lr * scale)

    return GatherEverywhere


def _muon_part(model: torch.nn.Module, tokens: torch.Tensor, steps: int) -> dict[str, Any]:
    from hp_trainer import Muon, get_hyper_optimizer
    from hp_trainer.components.optimizer.muon import _newton_schulz_flops

    model(tokens).float().logsumexp(-1).mean().backward()
    muon = get_hyper_optimizer(model, lr=1e-3)
    before = _gather_everywhere(Muon)([dict(g) for g in muon.param_groups], lr=1e-3)
    optims = {
        "muon": muon,
        "gather_everywhere": before,
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False),
        "adamw_again": torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False),
    }
    runs = []
    for order in (list(optims), list(reversed(optims))):
        times: dict[str, list[float]] = {k: [] for k in optims}
        for i in range(steps + 1):
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                optims[name].step()
                if i > 0:  # the first round is warm-up (state allocation, the owner plan)
                    times[name].append(time.perf_counter() - t0)
        runs.append({k: statistics.median(v) for k, v in times.items()})
    division = muon.work_division()
    hidden = list(muon.param_groups[0]["params"])
    division["ns_flops_everywhere"] = sum(
        _newton_schulz_flops(p.shape[-2], p.shape[-1], 5) * (p.shape[0] if p.ndim == 3 else 1)
        for p in hidden
    )
    return {"runs": runs, "division": division}


def _worker(
    rank: int,
    init_file: str,
    steps: int,
    seq: int,
    result_file: str,
    parts: list[str],
    opt_steps: int,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 2048, (2, seq), generator=gen)
    out: dict[str, Any] = {}
    if "ac" in parts:
        models = {mode: _build(mode, mesh) for mode in MODES}
        out["ac"] = _ac_part(models, tokens, steps)
    if "muon" in parts:
        out["muon"] = _muon_part(_build("none", mesh), tokens, opt_steps)
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(result_file).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _mib(value: float | None) -> str:
    return "n/a (compiled)" if value is None else f"{value:.1f}"


def _ac_table(ranks: list[dict[str, Any]], args: argparse.Namespace) -> tuple[list[Any], list[str]]:
    ac = [r["ac"] for r in ranks]
    base_time = max(r["time"]["none"] for r in ac)
    rows = []
    for mode in MODES:
        rows.append(
            {
                "mode": mode,
                "peak_mib": max(r["peak"][mode] for r in ac) / 2**20
                if mode in ac[0]["peak"]
                else None,
                "kept_activations_mib": max(r["saved"][mode] for r in ac) / 2**20,
                "step_time_vs_none": max(r["time"][mode] for r in ac) / base_time,
            }
        )
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
    return rows, lines


def _muon_table(ranks: list[dict[str, Any]], args: argparse.Namespace) -> tuple[Any, list[str]]:
    muon = [r["muon"] for r in ranks]

    def ratio(name: str) -> float:
        per_run = [
            max(r["runs"][i][name] for r in muon) / max(r["runs"][i]["adamw"] for r in muon)
            for i in range(2)
        ]
        return math.sqrt(per_run[0] * per_run[1])

    divisions = [r["division"] for r in muon]
    total = divisions[0]["ns_flops_total"]
    flops = [d["ns_flops"] for d in divisions]
    result = {
        "muon_over_adamw": ratio("muon"),
        "gather_everywhere_over_adamw": ratio("gather_everywhere"),
        "adamw_again_over_adamw": ratio("adamw_again"),
        "ns_flops_per_rank": flops,
        "ns_flops_total": total,
        "ns_flops_everywhere_per_rank": divisions[0]["ns_flops_everywhere"],
        "owned_per_rank": [d["owned"] for d in divisions],
        "matrices": divisions[0]["matrices"],
        "gather_bytes_per_rank": [d["gather_bytes"] for d in divisions],
        "scatter_bytes_per_rank": [d["scatter_bytes"] for d in divisions],
        "collectives_per_step": divisions[0]["collectives"],
    }
    gflop = [f / 1e9 for f in flops]
    lines = [
        f"llama3 debugmodel, {WORLD} CPU ranks (hp-fsdp), optimizer.step() only, "
        f"{args.opt_steps} timed steps x 2 orders (geometric mean of the two ratios)",
        "",
        "| optimizer | step time / AdamW | Newton-Schulz GFLOP per rank (max) | / total |",
        "|---|---|---|---|",
        f"| Muon, owner ranks | {result['muon_over_adamw']:.2f} | {max(gflop):.2f} "
        f"| {max(flops) / total:.3f} |",
        f"| Muon, every rank gathers and orthogonalises every matrix (before) "
        f"| {result['gather_everywhere_over_adamw']:.2f} "
        f"| {result['ns_flops_everywhere_per_rank'] / 1e9:.2f} "
        f"| {result['ns_flops_everywhere_per_rank'] / total:.3f} |",
        f"| AdamW again (noise) | {result['adamw_again_over_adamw']:.2f} | 0 | 0 |",
        "",
        f"Matrices: {result['matrices']} (owned per rank: {result['owned_per_rank']}); "
        f"Newton-Schulz GFLOP per rank {[round(g, 3) for g in gflop]} of {total / 1e9:.2f}; "
        f"collectives per step: {result['collectives_per_step']}; bytes sent per rank per step: "
        f"gather {result['gather_bytes_per_rank']}, scatter {result['scatter_bytes_per_rank']}",
    ]
    return result, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--parts", default="ac,muon", help="comma-separated: ac, muon")
    parser.add_argument("--opt-steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if not set(parts) <= {"ac", "muon"}:
        raise ValueError(f"--parts takes ac and/or muon, got {args.parts!r}")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(
                os.path.join(tmp, "init"),
                args.steps,
                args.seq,
                result,
                parts,
                args.opt_steps,
            ),
            nprocs=WORLD,
        )
        ranks = json.loads(Path(result).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"ranks": ranks}
    lines: list[str] = []
    if "ac" in parts:
        report["rows"], ac_lines = _ac_table(ranks, args)
        lines += ac_lines
    if "muon" in parts:
        report["muon"], muon_lines = _muon_table(ranks, args)
        lines += ([""] if lines else []) + muon_lines
    name = "ac_and_muon" if len(parts) == 2 else f"ac_and_muon.{parts[0]}"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
