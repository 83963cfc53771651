"""hp-pp on two GPUs over NCCL: every schedule runs, and its losses equal one process.

One script for a machine with at least two GPUs (well under a minute). Two processes, one GPU
each, the default process group on NCCL (the backend the device layer picks), run every built-in
schedule (GPipe, 1F1B, Interleaved 1F1B, LoopedBFS, Interleaved zero bubble, ZBV, DualPipeV) and
MPipe for 3 training steps (SGD) of a small MLP chain in fp32, with different data per step.
For each schedule and step it checks:

- **losses and parameters vs one process**: a single-GPU replica of the whole model trained on
  the same micro-batches (each loss divided by the number of micro-batches) gives the same
  per-micro-batch losses and parameters (``rtol = atol = 1e-5``; TF32 is turned off);
- **no hang**: each rank's stage has a 60 s timeout, so a point-to-point order NCCL cannot
  serve fails with a message naming the ranks instead of hanging the machine;
- **the NCCL model agrees**: each rank's recorded point-to-point program
  (``PipelineExecutor.trace``) is gathered and replayed under :mod:`hp_pp.p2p_model`: no
  deadlock, every receive gets the send of the same (stage, micro-batch, kind, part), and
  shapes and dtypes agree;
- **device tensors only**: NCCL itself refuses a host tensor on the default group, so a
  stage description, a tie flag or a preprocess output left on the CPU fails the schedule.

Without two GPUs it prints a line saying so and exits with status 0 (nothing is checked).
``--cpu`` runs the same checks on two gloo processes on the CPU (a dry run of the script).

Usage::

    python benchmarks/gpu/pp_gpu_check.py [--steps 3] [--out pp_gpu_check.json] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import hp_pp
from hp_dtensor.device import device_count, get_device, init_process_group, is_accelerator
from hp_pp import generators
from hp_pp.p2p_model import program_from_json, program_to_json, replay

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # _common.py is one up

from _common import free_port

DIM, ROWS, N_MB, WORLD = 64, 32, 4, 2
SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "MPipe",
]


class Pre(nn.Sequential):
    """MPipe's preprocess block (stage 0's first layers)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(DIM, DIM), nn.Tanh())


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = Pre()
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.pre(x))


def _modules(num_stages: int, device: torch.device) -> list[nn.Module]:
    torch.manual_seed(0)
    mods: list[nn.Module] = [First()]
    mods += [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(num_stages - 1)]
    return [m.to(device) for m in mods]


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)
    return x.to(device), y.to(device)


def _reference(num_stages: int, steps: int, device: torch.device) -> list[Any]:
    """One process: the whole chain, the same micro-batches, SGD after each step."""
    mods = _modules(num_stages, device)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    out = []
    for step in range(steps):
        x, y = _batch(step, device)
        losses = []
        for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB), strict=True):
            h = xm
            for m in mods:
                h = m(h)
            loss = nn.functional.mse_loss(h, ym)
            (loss / N_MB).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        per_stage = [[p.detach().cpu().clone() for p in m.parameters()] for m in mods]
        out.append((torch.stack(losses).cpu(), per_stage))
    return out


def _run_schedule(name: str, rank: int, steps: int, device: torch.device) -> dict[str, Any]:
    import datetime

    multi = name not in ("GPipe", "1F1B")
    num_stages = WORLD * (2 if multi else 1)
    style = generators.STYLE["Interleaved1F1B" if name == "MPipe" else name]
    mods = _modules(num_stages, device)
    idx = generators.rank_to_stages(rank, WORLD, num_stages, style)
    stages = [
        hp_pp.PipelineStage(mods[s], s, num_stages, device, timeout=datetime.timedelta(seconds=60))
        for s in idx
    ]
    loss_fn = nn.functional.mse_loss
    if name == "MPipe":
        copy = None if 0 in idx else Pre().to(device)
        sched: Any = hp_pp.ScheduleMPipe(
            stages, N_MB, loss_fn=loss_fn, preprocess_fqn="pre", preprocess=copy
        )
    else:
        cls = hp_pp.get_schedule_class(name)
        sched = cls(stages if multi else stages[0], N_MB, loss_fn=loss_fn)
    params = [p for s in idx for p in mods[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    reference = _reference(num_stages, steps, device)
    row: dict[str, Any] = {"schedule": name, "rank": rank, "steps": []}
    for step in range(steps):
        x, y = _batch(step, device)
        losses: list[torch.Tensor] = []
        first = 0 in idx or name == "MPipe"
        sched.step(
            *((x,) if first else ()),
            target=y if num_stages - 1 in idx else None,
            losses=losses,
            return_outputs=False,
        )
        opt.step()
        opt.zero_grad()
        ref_losses, ref_stages = reference[step]
        loss_ok = True
        if num_stages - 1 in idx:
            loss_ok = torch.allclose(torch.stack(losses).cpu(), ref_losses, rtol=1e-5, atol=1e-5)
        param_ok = all(
            torch.allclose(p.detach().cpu(), q, rtol=1e-5, atol=1e-5)
            for s in idx
            for p, q in zip(mods[s].parameters(), ref_stages[s], strict=True)
        )
        row["steps"].append(
            {
                "loss_ok": bool(loss_ok),
                "param_ok": bool(param_ok),
                "trace": program_to_json(sched.executor.trace),
                "losses": [float(v) for v in losses],
            }
        )
    return row


def _worker(rank: int, port: int, steps: int, out: str, cpu: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        init_process_group(world_size=WORLD, rank=rank, device_type="cpu")
        device = torch.device("cpu")
    else:
        init_process_group(world_size=WORLD, rank=rank, device_id=rank)
        device = get_device()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    rows = []
    for name in SCHEDULES:
        try:
            rows.append(_run_schedule(name, rank, steps, device))
        except Exception as err:
            rows.append({"schedule": name, "rank": rank, "error": f"{type(err).__name__}: {err}"})
            break  # the group may be unusable after a failed transfer
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="pp_gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="dry run on two gloo CPU processes")
    args = parser.parse_args()
    if not args.cpu and (not is_accelerator() or device_count() < WORLD):
        print("pp_gpu_check: no GPU (two are needed) on this machine; nothing was checked")
        return 0
    out = Path(args.out)
    out.unlink(missing_ok=True)
    mp.spawn(_worker, args=(free_port(), args.steps, str(out), args.cpu), nprocs=WORLD)
    per_rank = json.loads(out.read_text(encoding="utf-8"))
    failed = False
    for i, name in enumerate(SCHEDULES):
        rows = [r[i] if i < len(r) else {"error": "not run"} for r in per_rank]
        errors = [r["error"] for r in rows if "error" in r]
        if errors:
            print(f"{name}: FAILED: {errors}")
            failed = True
            continue
        for step in range(args.steps):
            report = replay(
                {r: program_from_json(rows[r]["steps"][step]["trace"]) for r in range(WORLD)}
            )
            ok = all(
                rows[r]["steps"][step]["loss_ok"] and rows[r]["steps"][step]["param_ok"]
                for r in range(WORLD)
            )
            print(
                f"{name} step {step}: losses/params vs one process "
                f"{'ok' if ok else 'DIFFER'}; NCCL model: "
                f"{'ok' if report.ok else report.problems[:2]} ({report.matched} transfers)"
            )
            failed |= not ok or not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
