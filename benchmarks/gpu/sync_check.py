"""Host syncs on a GPU: one training step of each layout under CUDA's sync debug mode.

One script for a machine with at least one GPU (about a minute). For each layout it builds a
small model, runs one warm-up step (first steps legitimately synchronize once: peer checks,
plans, lazy state), then one step (forward, backward, optimizer step) with
``torch.cuda.set_sync_debug_mode("warn")``, counting the synchronizing CUDA calls it reports
(each warning names the Python line), and, for layouts whose budget is zero, one more step with
``torch.cuda.set_sync_debug_mode("error")``, which raises at the first one. The forward and
backward and optimizer step are also counted with :func:`hp_dtensor.testing.count_host_syncs`
(device tensors: the GPU's; the optimizer's step counters declared host tensors, as PyTorch's
eager optimizers keep them there on purpose), so the CPU counter the tests rely on is checked
against the hardware's own report.

Layouts (world 1, and world 2 over NCCL when two GPUs are visible):

- ``fsdp``: ``hp_fsdp.fully_shard`` per block and on the root, AdamW; budget 0.
- ``tp``: ``hp_tp.parallelize_module`` colwise/rowwise MLP, AdamW; budget 0.
- ``ep``: ``hp_cp_ep.MoE`` (bf16, grouped GEMM) with ``ExpertParallel`` over all ranks, AdamW;
  budget 1 per MoE layer forward under EP (the split sizes of the token all-to-all), 0 at
  world 1.
- ``cp-ring``, ``cp-allgather``, ``cp-ulysses``: ``hp_cp_ep.ContextParallelAttention`` causal
  attention forward and backward on sequence shards; budget 0.
- ``pp``: ``hp_pp.PipelineStage`` (one stage per rank) with ``ScheduleGPipe``, 4 microbatches,
  AdamW; budget 0.

Without a GPU it prints a line saying so and exits with status 0 (nothing is checked).
``--cpu`` runs the same steps on gloo CPU ranks with the CPU counter only (a smoke test of the
script itself, and the counts the tests see).

Usage::

    python benchmarks/gpu/sync_check.py [--out sync_check.json] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hp_fsdp
import hp_pp
import hp_tp
from hp_cp_ep import ContextParallelAttention, ExpertParallel, MoE, MoEArgs
from hp_dtensor.device import device_count, get_device_type, init_process_group, is_accelerator
from hp_dtensor.testing import count_host_syncs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # _common.py is one up

from _common import TiedTransformer, free_port

VOCAB, DIM, HEADS, SEQ, BATCH, BLOCKS = 512, 128, 4, 64, 4, 2
Step = Callable[[], None]
Built = tuple[Step, torch.optim.Optimizer | None, int]  # forward + backward, optimizer, budget


def _adamw(model: nn.Module, foreach: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)


def _tokens(device: torch.device, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(17 + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _fsdp(device: torch.device, world: int, rank: int) -> Built:
    torch.manual_seed(0)
    with torch.device(device):
        model = TiedTransformer(VOCAB, DIM, HEADS, BLOCKS)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        hp_fsdp.fully_shard(layer, mesh=mesh)
    hp_fsdp.fully_shard(model, mesh=mesh)
    opt = _adamw(model)
    tokens, targets = _tokens(device, rank)

    def step() -> None:
        logits = model(tokens)
        F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()

    return step, opt, 0


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


def _tp(device: torch.device, world: int, rank: int) -> Built:
    torch.manual_seed(0)
    model = _MLP().to(device)
    mesh = init_device_mesh(device.type, (world,))
    plan = {"up": hp_tp.ColwiseParallel(), "down": hp_tp.RowwiseParallel()}
    hp_tp.parallelize_module(model, mesh, plan)
    opt = _adamw(model)
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(3)).to(device)

    def step() -> None:
        model(x).square().mean().backward()

    return step, opt, 0


def _ep(device: torch.device, world: int, rank: int) -> Built:
    torch.manual_seed(0)
    experts = 4 * world
    moe = MoE(MoEArgs(num_experts=experts, top_k=2), DIM, 2 * DIM).to(device, torch.bfloat16)
    if world > 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
        hp_tp.parallelize_module(moe.experts, mesh, ExpertParallel())
    opt = _adamw(moe, foreach=False)  # DTensor experts beside plain router weights
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(BATCH * SEQ, DIM, generator=gen).to(device, torch.bfloat16)

    def step() -> None:
        moe(x).float().square().mean().backward()

    return step, opt, 1 if world > 1 else 0


def _cp(mode: str) -> Callable[[torch.device, int, int], Built]:
    def build(device: torch.device, world: int, rank: int) -> Built:
        mesh = init_device_mesh(device.type, (world,))
        attention = ContextParallelAttention(mesh, mode=mode, load_balance=True)
        gen = torch.Generator().manual_seed(9 + rank)
        dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
        q, k, v = (
            torch.randn(BATCH, HEADS, SEQ // world, DIM // HEADS, generator=gen)
            .to(device, dtype)
            .requires_grad_()
            for _ in range(3)
        )

        def step() -> None:
            attention(q, k, v, is_causal=True).float().square().mean().backward()

        return step, None, 0

    return build


def _pp(device: torch.device, world: int, rank: int) -> Built:
    torch.manual_seed(0)
    chain = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(world)]
    module = chain[rank].to(device)
    stage = hp_pp.PipelineStage(module, rank, world, device)
    schedule = hp_pp.ScheduleGPipe(stage, 4, loss_fn=F.mse_loss)
    opt = _adamw(module)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(8, DIM, generator=gen).to(device)
    y = torch.randn(8, DIM, generator=gen).to(device)

    def step() -> None:
        if world == 1:
            schedule.step(x, target=y)
        elif rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()

    return step, opt, 0


LAYOUTS: dict[str, Callable[[torch.device, int, int], Built]] = {
    "fsdp": _fsdp,
    "tp": _tp,
    "ep": _ep,
    "cp-ring": _cp("ring"),
    "cp-allgather": _cp("allgather"),
    "cp-ulysses": _cp("ulysses"),
    "pp": _pp,
}


def _cuda_warnings(step: Step) -> list[str]:
    """The synchronizing CUDA calls of one step, as ``file:line`` of their Python caller."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [
        f"{os.path.relpath(w.filename)}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message).lower()
    ]


def _raises_on_sync(step: Step) -> str | None:
    """Run one step with ``set_sync_debug_mode("error")``; the error, if a sync happened."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as exc:
        return "".join(traceback.format_exception_only(exc)).strip()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def _check(name: str, device: torch.device, world: int, rank: int, on_gpu: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"layout": name, "world": world}
    try:
        forward_backward, opt, budget = LAYOUTS[name](device, world, rank)

        def step() -> None:
            forward_backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()

        row["budget"] = budget
        step()  # warm-up: first-step peer checks, plans and lazy state
        is_device: Callable[[torch.Tensor], bool] | None = (
            (lambda t: t.device.type == device.type) if on_gpu else None
        )
        # PyTorch's eager optimizers keep their step counters on the host on purpose.
        steps = [s["step"] for s in opt.state.values() if "step" in s] if opt is not None else []
        with count_host_syncs(device_tensors=is_device, host_tensors=steps) as counted:
            step()
        row["counter"] = counted.total
        row["counter_sites"] = dict(Counter(f"{op} at {site}" for op, site in counted.events))
        if on_gpu:
            sites = _cuda_warnings(step)
            row["cuda"] = len(sites)
            row["cuda_sites"] = dict(Counter(sites))
            if budget == 0:
                row["error_mode"] = _raises_on_sync(step) or "no sync"
        seen = row["cuda"] if on_gpu else row["counter"]
        row["ok"] = seen <= budget and row.get("error_mode", "no sync") == "no sync"
    except Exception as exc:  # reported as a failed row; the other layouts still run
        row["ok"] = False
        row["error"] = "".join(traceback.format_exception_only(exc)).strip()
    return row


def _worker(rank: int, world: int, port: int, out: str, on_gpu: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if on_gpu:
        init_process_group(world_size=world, rank=rank, device_id=rank)
        device = torch.device(get_device_type(), rank)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        device = torch.device("cpu")
    rows = [_check(name, device, world, rank, on_gpu) for name in LAYOUTS]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out, "a", encoding="utf-8") as handle:
            for i, row in enumerate(rows):
                merged = dict(row)
                merged["ok"] = all(g[i]["ok"] for g in gathered)
                for key in ("counter", "cuda"):
                    if key in row:
                        merged[key] = max(g[i].get(key, 0) for g in gathered)
                errors = [g[i]["error"] for g in gathered if "error" in g[i]]
                if errors:
                    merged["error"] = errors[0]
                handle.write(json.dumps(merged) + "\n")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sync_check.json")
    parser.add_argument("--cpu", action="store_true", help="gloo CPU ranks, CPU counter only")
    args = parser.parse_args()
    on_gpu = not args.cpu
    if on_gpu and not is_accelerator():
        print(
            "sync_check: no GPU on this machine; nothing was checked (--cpu runs a CPU smoke test)"
        )
        return 0
    out = Path(args.out)
    out.unlink(missing_ok=True)
    worlds = [1] + ([2] if not on_gpu or device_count() >= 2 else [])
    for world in worlds:
        mp.spawn(_worker, args=(world, free_port(), str(out), on_gpu), nprocs=world)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    failed = False
    for row in rows:
        head = f"world={row['world']} {row['layout']:<12}"
        if "error" in row:
            print(f"{head} FAILED {row['error']}")
        else:
            cuda = f" cuda={row['cuda']}" if "cuda" in row else ""
            error_mode = f" error-mode: {row['error_mode']}" if "error_mode" in row else ""
            print(
                f"{head} budget={row['budget']} counter={row['counter']}{cuda}{error_mode} "
                f"{'ok' if row['ok'] else 'OVER BUDGET'}"
            )
            if not row["ok"]:
                sites = row.get("cuda_sites") or row["counter_sites"]
                for site, count in sorted(sites.items(), key=lambda kv: -kv[1]):
                    print(f"    {count} x {site}")
        failed |= not row["ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
