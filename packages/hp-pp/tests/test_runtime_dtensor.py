"""DTensor activations cross a stage boundary with their placements (PP 2 x TP 2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import hp_pp
from hp_dtensor.testing import distributed

DIM = 8


class ShardedOut(nn.Module):
    """Stage 0: its output is a DTensor sharded on the feature dim over the TP mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> DTensor:
        h = torch.tanh(self.lin(x))
        return DTensor.from_local(h, self.mesh, [Replicate()]).redistribute(self.mesh, [Shard(1)])


class ShardedIn(nn.Module):
    """Stage 1: reads the DTensor it receives (checks its placement)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.seen: list[Any] = []

    def forward(self, x: DTensor) -> torch.Tensor:
        self.seen.append(tuple(x.placements))
        return self.lin(x.full_tensor())


@distributed(world_size=4)
def test_dtensor_activation_keeps_placements_and_gradients() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp = mesh["tp"]
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(0)
    first, second = ShardedOut(tp), ShardedIn()
    ref_first, ref_second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
    ref_first.load_state_dict(first.lin.state_dict())
    ref_second.load_state_dict(second.lin.state_dict())
    module = first if pp_rank == 0 else second
    stage = hp_pp.PipelineStage(
        module,
        pp_rank,
        2,
        torch.device("cpu"),
        group=mesh["pp"].get_group(),
        get_mesh=lambda names, layout: tp,
    )
    sched = hp_pp.ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)
    if pp_rank == 0:
        sched.step(x)
    else:
        sched.step(target=y)
        assert second.seen == [(Shard(1),), (Shard(1),)]
    for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
        (nn.functional.mse_loss(ref_second(torch.tanh(ref_first(xm))), ym) / 2).backward()
    ref = ref_first if pp_rank == 0 else ref_second
    for p, q in zip(module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
