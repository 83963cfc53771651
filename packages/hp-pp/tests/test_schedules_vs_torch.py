"""Every schedule: loss and gradients equal one process and torch.distributed.pipelining."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import distributed, run_distributed
from hp_pp import generators

DIM = 16
BATCH = 8
LAYERS = 4

_TORCH_NAMES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
_SINGLE = ("GPipe", "1F1B")


def full_model(layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(layers)])


def stage_module(model: nn.Sequential, stage: int, num_stages: int) -> nn.Module:
    per = len(model) // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    return nn.ModuleDict({k: m for k, m in model.named_children() if k in keep})


class Chain(nn.Module):
    """The layers of one stage (keeps the full model's FQNs)."""

    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def n_layers(num_stages: int) -> int:
    return num_stages * max(1, LAYERS // num_stages)


def batch(n_mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(BATCH * n_mb // 4, DIM, generator=g), torch.randn(
        BATCH * n_mb // 4, DIM, generator=g
    )


def oracle(n_mb: int, layers: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One process, same micro-batches, each micro-batch loss divided by n_mb."""
    model = Chain(nn.ModuleDict(dict(full_model(layers).named_children())))
    x, y = batch(n_mb)
    losses = []
    for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb), strict=True):
        loss = nn.functional.mse_loss(model(xm), ym)
        (loss / n_mb).backward()
        losses.append(loss.detach())
    return losses, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def local_stage_indices(name: str, num_stages: int) -> list[int]:
    style = generators.STYLE[name]
    return generators.rank_to_stages(dist.get_rank(), dist.get_world_size(), num_stages, style)


def run_pipeline(name: str, impl: str, n_mb: int, stages_per_rank: int, table: Any = None) -> Any:
    ws = dist.get_world_size()
    num_stages = ws * stages_per_rank
    layers = n_layers(num_stages)
    model = full_model(layers)
    mods = [
        Chain(stage_module(model, s, num_stages)) for s in local_stage_indices(name, num_stages)
    ]
    indices = local_stage_indices(name, num_stages)
    x, y = batch(n_mb)
    if impl == "torch":
        import torch.distributed.pipelining as tpp

        stages = [
            tpp.PipelineStage(m, s, num_stages, torch.device("cpu"))
            for m, s in zip(mods, indices, strict=True)
        ]
        cls = getattr(tpp, _TORCH_NAMES[name])
    else:
        stages = [
            hp_pp.PipelineStage(m, s, num_stages, torch.device("cpu"))
            for m, s in zip(mods, indices, strict=True)
        ]
        cls = hp_pp.get_schedule_class(name)
    loss_fn = nn.functional.mse_loss
    if impl == "table":
        sched = hp_pp.PipelineScheduleRuntime(
            stages, n_mb, loss_fn, style=generators.STYLE[name], actions=table
        )
    elif name in _SINGLE:
        sched = cls(stages[0], n_mb, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_mb, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {}
    if 0 in indices:
        kwargs["args"] = (x,)
    if num_stages - 1 in indices:
        kwargs["target"] = y
    out = sched.step(*kwargs.pop("args", ()), losses=losses, **kwargs)
    grads = {k: p.grad for m in mods for k, p in m.named_parameters()}
    order = getattr(sched, "pipeline_order", None)
    return losses, grads, out, order


def torch_table(name: str, n_mb: int, stages_per_rank: int) -> Any:
    """torch's own compute table of a multi-stage schedule, in our Action vocabulary."""
    *_, order = run_pipeline(name, "torch", n_mb, stages_per_rank)
    return {
        r: [None if a is None else hp_pp.Action.parse(str(a)) for a in row]
        for r, row in order.items()
    }


def check_schedule(name: str, n_mb: int, stages_per_rank: int) -> dict[str, float]:
    ws = dist.get_world_size()
    num_stages = ws * stages_per_rank
    ref_losses, ref_grads = oracle(n_mb, n_layers(num_stages))
    ours, our_grads, our_out, _ = run_pipeline(name, "ours", n_mb, stages_per_rank)
    theirs, torch_grads, torch_out, _ = run_pipeline(name, "torch", n_mb, stages_per_rank)
    diffs = {"vs_one_process": 0.0, "vs_torch": 0.0, "vs_torch_same_table": 0.0}
    assert set(our_grads) == set(torch_grads)
    assert our_grads
    for k, g in our_grads.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, torch_grads[k], rtol=1e-6, atol=1e-6)
        diffs["vs_one_process"] = max(
            diffs["vs_one_process"], (g - ref_grads[k]).abs().max().item()
        )
        diffs["vs_torch"] = max(diffs["vs_torch"], (g - torch_grads[k]).abs().max().item())
    if num_stages - 1 in local_stage_indices(name, num_stages):
        assert len(ours) == n_mb
        for a, b, c in zip(ours, theirs, ref_losses, strict=True):
            assert torch.equal(a, b), (a, b)
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
        assert torch.equal(our_out, torch_out)
    if name not in _SINGLE:
        # The same table as torch's runs the same operations in the same order: bitwise.
        table = torch_table(name, n_mb, stages_per_rank)
        same, same_grads, _, _ = run_pipeline(name, "table", n_mb, stages_per_rank, table)
        for k, g in same_grads.items():
            assert torch.equal(g, torch_grads[k]), (k, (g - torch_grads[k]).abs().max())
        if same:
            assert all(torch.equal(a, b) for a, b in zip(same, theirs, strict=True))
    else:
        for k, g in our_grads.items():
            assert torch.equal(g, torch_grads[k]), (k, (g - torch_grads[k]).abs().max())
    return diffs


def _stages_per_rank(name: str) -> int:
    return 1 if name in _SINGLE else 2


@pytest.mark.parametrize("name", list(_TORCH_NAMES))
@distributed(world_size=2)
def test_schedule_matches_one_process_and_torch_ws2(name: str) -> None:
    check_schedule(name, 4, _stages_per_rank(name))


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
@distributed(world_size=3)
def test_schedule_matches_one_process_and_torch_ws3(name: str) -> None:
    check_schedule(name, 6, _stages_per_rank(name))


def test_schedule_diffs_reported() -> None:
    diffs = run_distributed(check_schedule, 2, "DualPipeV", 4, 2)
    assert all(d["vs_one_process"] <= 1e-6 for d in diffs)


@pytest.mark.parametrize("name", ["GPipe", "InterleavedZeroBubble", "DualPipeV"])
@distributed(world_size=4)
def test_schedule_matches_one_process_and_torch_ws4(name: str) -> None:
    check_schedule(name, 8, _stages_per_rank(name))
