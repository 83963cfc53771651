"""The runtime surfaces torch users program against: a hand-written ``pipeline_order`` in a
``PipelineScheduleMulti`` subclass, ``pipeline_order_with_comms`` set by a caller,
``_prepare_schedule_with_comms``, ``_load_csv`` and ``register_custom_function``.

Oracles: torch's ``PipelineScheduleMulti`` subclass with the same table, and one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import FORWARD, SEND_F, _Action

import hp_pp
from hp_dtensor.testing import fake_world, run_distributed
from hp_pp.p2p_model import program_from_json, program_to_json, replay

DIM = 8
N_MB = 2
# Breadth first over the two stages of each rank, written by hand (loop placement).
BFS = {
    0: ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
    1: ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"],
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4)])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2 * N_MB, DIM, generator=g), torch.randn(2 * N_MB, DIM, generator=g)


def _oracle() -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _data()
    for xm, ym in zip(x.chunk(N_MB), y.chunk(N_MB), strict=True):
        (nn.functional.mse_loss(model(xm), ym) / N_MB).backward()  # type: ignore[no-untyped-call]
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _stages(impl: str, model: nn.Sequential) -> tuple[list[Any], list[int]]:
    import torch.distributed.pipelining as tpp

    rank = dist.get_rank()
    indices = [rank, rank + 2]
    cls: Any = hp_pp.PipelineStage if impl == "hp" else tpp.PipelineStage
    return [cls(model[s], s, 4, torch.device("cpu")) for s in indices], indices


def _step(sched: Any, indices: list[int]) -> list[torch.Tensor]:
    x, y = _data()
    losses: list[torch.Tensor] = []
    sched.step(*((x,) if 0 in indices else ()), target=y if 3 in indices else None, losses=losses)
    return losses


def _grads(model: nn.Sequential, indices: list[int]) -> dict[str, torch.Tensor]:
    return {
        f"{s}.{k}": p.grad
        for s in indices
        for k, p in model[s].named_parameters()
        if p.grad is not None
    }


class HpBFS(hp_pp.PipelineScheduleMulti):
    """torch's documented way: subclass, call super().__init__, set pipeline_order."""

    def __init__(self, stages: Any, n_microbatches: int, loss_fn: Any) -> None:
        super().__init__(stages, n_microbatches, loss_fn=loss_fn)
        self.pipeline_order = {r: [_Action.from_str(a) for a in row] for r, row in BFS.items()}


def _torch_bfs(stages: Any, n_microbatches: int, loss_fn: Any) -> Any:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    class TorchBFS(PipelineScheduleMulti):
        def __init__(self) -> None:
            super().__init__(stages, n_microbatches, loss_fn=loss_fn)
            self.pipeline_order = {r: [_Action.from_str(a) for a in row] for r, row in BFS.items()}

    return TorchBFS()


def _check(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    assert grads
    for k, g in grads.items():
        torch.testing.assert_close(g, ref[k], rtol=tol, atol=tol)


def _custom_runs(tmp: str) -> dict[str, Any]:
    loss_fn = nn.functional.mse_loss
    ref = _oracle()
    out: dict[str, Any] = {}
    # 1. A PipelineScheduleMulti subclass with a hand-written table, hp and torch.
    m_hp, m_t = _model(), _model()
    stages, indices = _stages("hp", m_hp)
    sched = HpBFS(stages, N_MB, loss_fn)
    losses = _step(sched, indices)
    # torch's oracle: its runtime given the same compute table.
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    t_stages, _ = _stages("torch", m_t)
    runtime = _PipelineScheduleRuntime(t_stages, N_MB, loss_fn=loss_fn)  # type: ignore[no-untyped-call]
    runtime._prepare_schedule_with_comms(
        {r: [_Action.from_str(a) for a in row] for r, row in BFS.items()}
    )
    t_losses = _step(runtime, indices)
    ours, theirs = _grads(m_hp, indices), _grads(m_t, indices)
    _check(ours, ref, 1e-5)
    _check(ours, theirs, 0.0)  # the same table runs the same operations: bitwise
    # torch's own PipelineScheduleMulti subclass with this table (reported, not asserted).
    m_s = _model()
    s_stages, _ = _stages("torch", m_s)
    _step(_torch_bfs(s_stages, N_MB, loss_fn), indices)
    out["torch_subclass_max_err"] = max(
        (g - ref[k]).abs().max().item() for k, g in _grads(m_s, indices).items()
    )
    assert [float(v) for v in losses] == [float(v) for v in t_losses]
    assert [str(a) for a in sched.pipeline_order[dist.get_rank()]] == BFS[dist.get_rank()]
    out["bfs"] = program_to_json(sched.executor.trace)

    # 2. A caller replaces the lowered table (pipeline_order_with_comms) directly, in torch's
    # compact notation (here: hp-pp's own lowering of the table, transfers written out).
    lowered = hp_pp.add_communication(
        {r: [hp_pp.Action.parse(a) for a in row] for r, row in BFS.items()},
        num_stages=4,
        style="loop",
    )
    m2 = _model()
    stages, _ = _stages("hp", m2)
    sched2 = HpBFS(stages, N_MB, loss_fn)
    sched2.pipeline_order_with_comms = {r: [str(a) for a in row] for r, row in lowered.items()}
    _step(sched2, indices)
    _check(_grads(m2, indices), theirs, 0.0)
    out["with_comms"] = program_to_json(sched2.executor.trace)

    # 3. _prepare_schedule_with_comms, both formats, and _load_csv, both formats.
    # TorchTitan's way for a CSV schedule: get_schedule_class("PipelineScheduleMulti").
    hows = ("compute_only", "compute_comms", "csv_compute_only", "csv_compute_comms", "multi")
    for how in hows:
        m3 = _model()
        stages, _ = _stages("hp", m3)
        if how == "multi":
            cls = hp_pp.get_schedule_class("PipelineScheduleMulti")
            assert cls is hp_pp.PipelineScheduleMulti
            sched3: hp_pp.PipelineScheduleRuntime = cls(stages, N_MB, loss_fn)
            how = "csv_compute_only"
        else:
            sched3 = hp_pp.PipelineScheduleRuntime(stages, N_MB, loss_fn)
        fmt = how.removeprefix("csv_")
        table: Any = BFS if fmt == "compute_only" else lowered
        if how.startswith("csv"):
            path = Path(tmp) / f"{how}_{dist.get_rank()}.csv"
            hp_pp.write_schedule_csv(
                {r: [hp_pp.Action.parse(str(a)) for a in row] for r, row in table.items()}, path
            )
            sched3._load_csv(str(path), format=fmt)
        else:
            sched3._prepare_schedule_with_comms(table, format=fmt)
        _step(sched3, indices)
        _check(_grads(m3, indices), theirs, 0.0)

    # 4. A custom function for FORWARD: called once per forward with the step's context; it
    # runs the stage's forward itself and the step is unchanged.
    calls: list[tuple[str, int, int]] = []

    def forward(action: Any, ctx: Any) -> None:
        stage = next(s for s in ctx.schedule_ref._stages if s.stage_index == action.stage_index)
        mb = action.microbatch_index
        args = ctx.arg_mbs[mb] if stage.is_first else ()
        calls.append((str(action), len(ctx.arg_mbs), len(ctx.kwarg_mbs)))
        stage.forward_one_chunk(mb, args, ctx.kwarg_mbs[mb])

    m4 = _model()
    stages, _ = _stages("hp", m4)
    sched4 = HpBFS(stages, N_MB, loss_fn)
    sched4.register_custom_function(FORWARD, forward)
    _step(sched4, indices)
    _check(_grads(m4, indices), theirs, 0.0)
    assert sorted(c[0] for c in calls) == sorted(a for a in BFS[dist.get_rank()] if "F" in a)
    assert all(c[1:] == (N_MB, N_MB) for c in calls)
    with pytest.raises(ValueError, match="Invalid computation type"):
        sched4.register_custom_function(SEND_F, forward)
    return out


def test_custom_tables_and_functions_equal_torch_and_one_process(tmp_path: Path) -> None:
    per_rank = run_distributed(_custom_runs, 2, str(tmp_path), timeout=180)
    print(
        "torch's PipelineScheduleMulti subclass, max |grad - one process|:",
        [p["torch_subclass_max_err"] for p in per_rank],
    )
    for name in ("bfs", "with_comms"):
        report = replay({r: program_from_json(p[name]) for r, p in enumerate(per_rank)})
        assert report.ok, (name, report.problems)
        assert report.matched > 0


def test_prepare_schedule_refuses_bad_tables() -> None:
    with fake_world(2, rank=0):
        stages = [hp_pp.PipelineStage(nn.Linear(2, 2), s, 4, torch.device("cpu")) for s in (0, 2)]
        sched = hp_pp.PipelineScheduleRuntime(stages, N_MB)
        with pytest.raises(ValueError, match=r"compute_only.*transfer 0SEND_F0"):
            sched._prepare_schedule_with_comms({0: ["0F0", "0SEND_F0"], 1: []})
        with pytest.raises(NotImplementedError, match="format='nope'"):
            sched._prepare_schedule_with_comms({0: ["0F0"]}, format="nope")
        with pytest.raises(ValueError, match="neither the loop"):
            sched._prepare_schedule_with_comms({0: ["1F0"], 1: ["0F0"]})
        with pytest.raises(ValueError, match="no action table"):
            sched.step(torch.zeros(2, 2))
