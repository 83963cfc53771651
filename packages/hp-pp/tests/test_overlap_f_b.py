"""DualPipeV's ``OVERLAP_F_B``: what the executor really does with a pair.

The pair's two halves run one after the other (the forward, then the backward, nothing in
between), and the pair is exactly the two actions written one after the other: the same table
with every pair flattened gives bitwise the same losses and gradients. The pair's receives are
posted in the batches the transport lowering gives them, so the backward's transfers are not
guaranteed to be in flight while the forward computes; what DualPipe overlaps (one half's
compute with the other half's expert all-to-all) needs the model's layers split into compute
and communication chunks, which hp-pp does not do. ``ScheduleDualPipeV`` says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import run_distributed
from hp_pp import generators
from hp_pp.actions import Action, ActionType

DIM = 16
ROWS = 2
_COMPUTE = {"F", "B", "I", "W"}


def _setup(n_mb: int) -> tuple[list[nn.Module], list[hp_pp.PipelineStage], list[int]]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    num_stages = 2 * ws
    torch.manual_seed(0)
    mods: list[nn.Module] = [
        nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(num_stages)
    ]
    indices = generators.rank_to_stages(rank, ws, num_stages, generators.STYLE["DualPipeV"])
    stages = [hp_pp.PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in indices]
    return mods, stages, indices


def _step(sched: Any, indices: list[int], n_mb: int) -> list[torch.Tensor]:
    num_stages = 2 * dist.get_world_size()
    g = torch.Generator().manual_seed(50 + dist.get_rank())  # different data on each rank
    x, y = torch.randn(n_mb * ROWS, DIM, generator=g), torch.randn(n_mb * ROWS, DIM, generator=g)
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {"losses": losses}
    if num_stages - 1 in indices:
        kwargs["target"] = y
    sched.step(*((x,) if 0 in indices else ()), **kwargs)
    return losses


def _flattened(table: dict[int, list[Action | None]]) -> dict[int, list[Action | None]]:
    out: dict[int, list[Action | None]] = {}
    for rank, row in table.items():
        out[rank] = []
        for a in row:
            if a is not None and a.type is ActionType.OVERLAP_F_B:
                assert a.sub_actions is not None
                out[rank] += list(a.sub_actions)
            else:
                out[rank].append(a)
    return out


def _check(n_mb: int) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    num_stages = 2 * ws
    table = generators.generate("DualPipeV", pp_size=ws, num_stages=num_stages, n_microbatches=n_mb)
    pairs = [a.sub_actions for a in table[rank] if a is not None and a.sub_actions is not None]
    assert pairs, "DualPipeV has overlapped pairs on every rank"

    mods, stages, indices = _setup(n_mb)
    sched = hp_pp.ScheduleDualPipeV(stages, n_mb, loss_fn=nn.functional.mse_loss)
    losses = _step(sched, indices, n_mb)
    events = [e for e in sched._executor.events if e[0] in _COMPUTE]
    # Each pair: its forward, then its backward, with no other compute in between.
    for f, b in pairs:
        i = events.index(("F", f.stage_index, f.microbatch_index))
        assert events[i + 1] == (b.type.value, b.stage_index, b.microbatch_index), events[i : i + 2]
    grads = {(s, n): p.grad.clone() for s in indices for n, p in mods[s].named_parameters()}

    # The same table with the pairs written as two actions: bitwise the same step.
    mods2, stages2, _ = _setup(n_mb)
    flat = hp_pp.PipelineScheduleRuntime(
        stages2,
        n_mb,
        nn.functional.mse_loss,
        style=generators.STYLE["DualPipeV"],
        actions=_flattened(table),
    )
    losses2 = _step(flat, indices, n_mb)
    assert len(losses) == len(losses2)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses2, strict=True))
    for (s, n), g in grads.items():
        assert torch.equal(g, dict(mods2[s].named_parameters())[n].grad), (s, n)


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_overlapped_pair_runs_forward_then_backward(ws: int) -> None:
    run_distributed(_check, ws, 4 * ws)
