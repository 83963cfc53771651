"""MPipe: the preprocess block of the first micro-batches runs on other ranks; same numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import distributed

DIM, N_MB = 8, 4


class CountingPre(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(DIM, DIM), nn.Tanh())
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        self.calls += 1
        return super().forward(x)


class FirstStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = CountingPre()
        self.body = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.pre(x))


def _modules(trainable: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    mods: list[nn.Module] = [FirstStage()]
    mods += [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3)]
    if not trainable:
        mods[0].pre.requires_grad_(False)
    return mods


def _run(trainable: bool) -> None:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)
    ref = _modules(trainable)
    for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB), strict=True):
        h = xm
        for m in ref:
            h = m(h)
        (nn.functional.mse_loss(h, ym) / N_MB).backward()

    mods = _modules(trainable)
    indices = [rank, rank + 2]
    stages = [hp_pp.PipelineStage(mods[s], s, 4, torch.device("cpu")) for s in indices]
    copy = None
    if rank != 0:
        torch.manual_seed(123)  # a different initialization: the step broadcasts stage 0's
        copy = CountingPre()
    sched = hp_pp.ScheduleMPipe(
        stages,
        N_MB,
        loss_fn=nn.functional.mse_loss,
        preprocess_fqn="pre",
        preprocess=copy,
        trainable_preprocess=trainable,
    )
    losses: list[torch.Tensor] = []
    # Rank 1 runs the preprocess of micro-batch 1: it gets the inputs too.
    sched.step(x, target=y if rank == 1 else None, losses=losses)
    events = sched.executor.events
    if rank == 0:
        pre_calls = mods[0].pre.calls
        # mb 0: PRE_F here (+ PRE_B recompute if trainable); mb 1: only the recompute;
        # mbs 2 and 3: inline in stage 0's forward.
        assert pre_calls == (5 if trainable else 3), pre_calls
        assert (("PRE_B", 0, 1) in events) == trainable
    else:
        assert copy is not None
        assert copy.calls == 1
        assert events.index(("PRE_F", 0, 1)) < events.index(("F", 1, 0))
        torch.testing.assert_close(copy[0].weight, ref[0].pre[0].weight)
    for s in indices:
        for (name, p), q in zip(mods[s].named_parameters(), ref[s].parameters(), strict=True):
            if not p.requires_grad:
                assert p.grad is None
                continue
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("trainable", [True, False])
@distributed(world_size=2)
def test_mpipe_equals_one_process(trainable: bool) -> None:
    _run(trainable)
