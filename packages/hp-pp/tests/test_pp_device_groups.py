"""Nothing of the host reaches the pipeline's device group: every schedule and MPipe, checked
with hp_dtensor's device-group double (host tensors and object collectives are refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
import hp_pp.stage as stage_module
from hp_dtensor.testing import (
    HostTensorOnDeviceGroupError,
    check_device_groups,
    distributed,
    load_test_module,
)
from hp_pp import generators

DIM = 8
CPU = torch.device("cpu")
_ALL = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


class Tied(nn.Module):
    """A linear layer whose weight is tied between the first and the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _schedule(name: str, *, tie: bool = False) -> tuple[Any, list[int], int]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    style = generators.STYLE[name]
    num_stages = ws * (1 if name in ("GPipe", "1F1B") else 2)
    torch.manual_seed(0)
    mods = [Tied() for _ in range(num_stages)]
    idx = generators.rank_to_stages(rank, ws, num_stages, style)
    ties = {0: {"lin.weight": "w"}, num_stages - 1: {"lin.weight": "w"}} if tie else {}
    stages = [
        hp_pp.PipelineStage(mods[s], s, num_stages, CPU, tied_parameters=ties.get(s)) for s in idx
    ]
    cls = hp_pp.get_schedule_class(name)
    loss = nn.functional.mse_loss
    sched = (
        cls(stages[0], 4, loss_fn=loss)
        if name in ("GPipe", "1F1B")
        else cls(stages, 4, loss_fn=loss)
    )
    return sched, idx, num_stages


def _step(sched: Any, idx: list[int], num_stages: int, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    # The batch is moved to the device, as a real job does.
    x, y = torch.randn(8, DIM, generator=g).to(CPU), torch.randn(8, DIM, generator=g).to(CPU)
    sched.step(*((x,) if 0 in idx else ()), target=y if num_stages - 1 in idx else None)


@distributed(world_size=2)
def test_every_schedule_puts_only_device_tensors_on_the_pipeline_group() -> None:
    for name in _ALL:
        sched, idx, num_stages = _schedule(name, tie=True)
        with check_device_groups(device=CPU) as checker:
            for step in range(2):
                _step(sched, idx, num_stages, step)
        assert not checker.violations
        assert checker.count("batch_isend_irecv") > 0
        assert checker.count("all_gather_object") == 0
        assert checker.count("broadcast_object_list") == 0
        # Ties: found once (two all_gathers at set-up), then per step one exchange between the
        # two ranks holding the tie (a batch of one send and one receive of the weight's size);
        # on the V placement both copies sit on rank 0: nothing at all. No all-reduce.
        tied = sched.tied_gradients
        assert tied is not None
        assert checker.count("all_gather") == 2
        assert checker.count("all_reduce") == 0
        if generators.STYLE[name] == "v":
            assert list(tied.holders.values()) == [(0,)]
            assert tied.collectives == 0
        else:
            assert tied.holders == {"w": (0, 1)}
            assert tied.collectives == 2
            assert tied.bytes_reduced == 2 * DIM * DIM * 4


@distributed(world_size=2)
def test_mpipe_puts_only_device_tensors_on_the_pipeline_group() -> None:
    mpipe = load_test_module(Path(__file__).with_name("test_runtime_mpipe.py"), "hp_pp_mpipe")
    rank = dist.get_rank()
    mods = mpipe._modules(True)
    stages = [hp_pp.PipelineStage(mods[s], s, 4, CPU) for s in (rank, rank + 2)]
    copy = None if rank == 0 else mpipe.CountingPre()
    sched = hp_pp.ScheduleMPipe(
        stages, 4, loss_fn=nn.functional.mse_loss, preprocess_fqn="pre", preprocess=copy
    )
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(8, mpipe.DIM, generator=g), torch.randn(8, mpipe.DIM, generator=g)  # device
    with check_device_groups(device=CPU) as checker:
        for _ in range(2):
            sched.step(x, target=y if rank == 1 else None)
    assert not checker.violations
    # The preprocess parameters: one bucketed broadcast per step (was one per tensor).
    assert checker.count("broadcast") == 2


def _host_meta(plain: Any, device: torch.device, what: str) -> torch.Tensor:
    """The description as the stage sent it before the fix: bytes in host memory."""
    raw = json.dumps(plain).encode().ljust(stage_module._META_BYTES)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@distributed(world_size=2)
def test_a_host_description_is_caught() -> None:
    """Mutation check: a stage description left in host memory (the pre-fix path) fails."""
    sched, idx, num_stages = _schedule("1F1B")
    original = stage_module._meta_to_tensor
    stage_module._meta_to_tensor = _host_meta
    try:
        with check_device_groups(device=CPU, strict=False) as checker:
            _step(sched, idx, num_stages, 0)
    finally:
        stage_module._meta_to_tensor = original
    if dist.get_rank() == 0:
        assert any(
            "batch_isend_irecv on a device group got a host tensor" in v for v in checker.violations
        )
    with pytest.raises(HostTensorOnDeviceGroupError), check_device_groups(device=CPU):
        dist.all_reduce(torch.tensor([1], dtype=torch.int64))  # the pre-fix tie check


def _tied_run(ties: dict[int, dict[str, str]]) -> tuple[Any, list[torch.Tensor]]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    mods = [Tied() for _ in range(3)]
    stage = hp_pp.PipelineStage(mods[rank], rank, 3, CPU, tied_parameters=ties.get(rank))
    sched = hp_pp.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    _step(sched, [rank], 3, 0)
    return sched, [p.grad.clone() for p in mods[rank].parameters() if p.grad is not None]


@distributed(world_size=3)
def test_tied_gradients_are_summed_over_their_holders_only_at_ws3() -> None:
    rank = dist.get_rank()
    _, untied = _tied_run({})
    weight = untied[0]  # lin.weight's gradient of this rank's stage, without ties
    # Two holders (the first and the last stage): ranks 0 and 2 exchange, rank 1 takes no part.
    with check_device_groups(device=CPU) as checker:
        sched, grads = _tied_run({0: {"lin.weight": "w"}, 2: {"lin.weight": "w"}})
    assert not checker.violations
    gathered = [torch.empty_like(weight) for _ in range(3)]
    dist.all_gather(gathered, weight)
    tied = sched.tied_gradients
    assert tied is not None
    if rank == 1:
        assert tied.collectives == 0
        assert torch.equal(grads[0], weight)
    else:
        assert tied.collectives == 1
        assert torch.equal(grads[0], gathered[0] + gathered[2])
    # Three holders: every rank's copy gets the sum of all three (an all-reduce).
    sched, grads = _tied_run({r: {"lin.weight": "w"} for r in range(3)})
    torch.testing.assert_close(grads[0], gathered[0] + gathered[1] + gathered[2])
