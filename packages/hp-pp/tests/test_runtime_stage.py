"""Runtime behaviour: values across a stage boundary, tables with transfers, overlap, eval."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import distributed
from hp_pp import generators

DIM = 12


class Head(nn.Module):
    """Stage 0: returns a float activation, an integer tensor and a Python float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        h = torch.tanh(self.lin(x))
        mask = (x[:, :1] > 0).long()
        return h, mask, 0.5


class Tail(nn.Module):
    """Stage 1: consumes all three."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * scale + mask.float()


def _models() -> tuple[Head, Tail]:
    torch.manual_seed(0)
    return Head(), Tail()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)


@distributed(world_size=2)
def test_several_tensors_and_a_python_value_cross_the_boundary() -> None:
    head, tail = _models()
    ref_head, ref_tail = _models()
    rank = dist.get_rank()
    module = head if rank == 0 else tail
    # Stage 1 declares its inputs; they are checked against what stage 0 announces.
    declared = (torch.zeros(2, DIM), torch.zeros(2, 1, dtype=torch.long), 0.5)
    stage = hp_pp.PipelineStage(
        module, rank, 2, torch.device("cpu"), input_args=declared if rank == 1 else None
    )
    sched = hp_pp.ScheduleGPipe(stage, 4, loss_fn=nn.functional.mse_loss)
    ref = ref_head if rank == 0 else ref_tail
    for step in range(2):
        module.zero_grad(set_to_none=True)
        ref_head.zero_grad(set_to_none=True)
        ref_tail.zero_grad(set_to_none=True)
        x, y = _data(step)
        losses: list[torch.Tensor] = []
        out = sched.step(x, losses=losses) if rank == 0 else sched.step(target=y, losses=losses)
        ref_losses = []
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = nn.functional.mse_loss(ref_tail(*ref_head(xm)), ym)
            (loss / 4).backward()
            ref_losses.append(loss.detach())
        if rank == 1:
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
            assert out.shape == (8, DIM)
        for p, q in zip(module.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def _chain(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(num_stages)]


def _run(
    name: str, n_mb: int, *, table: Any = None, lookahead: int = 1, steps: int = 1
) -> tuple[dict[str, torch.Tensor], list[list[tuple[str, int, int]]]]:
    ws = dist.get_world_size()
    style = generators.STYLE[name]
    num_stages = ws * (1 if name in ("GPipe", "1F1B") else 2)
    mods = _chain(num_stages)
    indices = generators.rank_to_stages(dist.get_rank(), ws, num_stages, style)
    stages = [hp_pp.PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in indices]
    if table is None:
        table = generators.generate(name, pp_size=ws, num_stages=num_stages, n_microbatches=n_mb)
    sched = hp_pp.PipelineScheduleRuntime(
        stages, n_mb, nn.functional.mse_loss, style=style, lookahead=lookahead
    )
    if isinstance(table, str):
        sched.load_csv(io.StringIO(table))
    else:
        sched.load_actions(table)
    events = []
    for step in range(steps):
        x, y = _data(step)
        args = (x,) if 0 in indices else ()
        target = y if num_stages - 1 in indices else None
        sched.step(*args, target=target)
        events.append(list(sched.executor.events))
    grads = {f"{s}.{k}": p.grad for s in indices for k, p in mods[s].named_parameters()}
    return grads, events


@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble", "DualPipeV"])
@distributed(world_size=2)
def test_table_with_transfers_from_csv_equals_compute_only_table(name: str) -> None:
    ws, n_mb = 2, 4
    num_stages = ws * (1 if name == "1F1B" else 2)
    style = generators.STYLE[name]
    compute = generators.generate(name, pp_size=ws, num_stages=num_stages, n_microbatches=n_mb)
    lowered = hp_pp.add_communication(compute, num_stages=num_stages, style=style)
    assert any(a is not None and a.type.is_communication for a in lowered[0])
    buffer = io.StringIO()
    hp_pp.write_schedule_csv(lowered, buffer)
    implicit, _ = _run(name, n_mb)
    explicit, events = _run(name, n_mb, table=buffer.getvalue())
    assert any(e[0] == "send_f" for e in events[0]) or dist.get_rank() == ws - 1
    for k, g in implicit.items():
        assert torch.equal(g, explicit[k]), k


@distributed(world_size=2)
def test_receive_of_next_microbatch_is_in_flight_during_compute() -> None:
    _, events = _run("1F1B", 4, steps=2)
    _, deferred = _run("1F1B", 4, steps=2, lookahead=0)
    if dist.get_rank() == 0:
        ev = events[1]
        # The gradients of micro-batch 0 are received while micro-batch 1's forward computes:
        # the receive is posted (with the send of micro-batch 0's activations) before it.
        assert (
            ev.index(("post_recv_b", 0, 0))
            < ev.index(("F", 0, 1))
            < ev.index(("wait_recv_b", 0, 0))
        )
        # lookahead=0 posts each receive only when its compute needs it.
        dv = deferred[1]
        assert dv.index(("F", 0, 1)) < dv.index(("post_recv_b", 0, 0))
    else:
        ev = events[1]
        # The last stage sends micro-batch 0's gradients and receives micro-batch 1's
        # activations in one batch (torch's 1F1B pairs them the same way).
        assert (
            ev.index(("B", 1, 0))
            < ev.index(("send_b", 1, 0))
            < ev.index(("post_recv_f", 1, 1))
            < ev.index(("wait_recv_f", 1, 1))
        )


@distributed(world_size=2)
def test_overlapped_forward_backward_posts_both_receives_first() -> None:
    _, events = _run("DualPipeV", 4, steps=2)
    if dist.get_rank() == 0:
        ev = events[1]
        # (3F2;0B0)OVERLAP_F_B: both receives are posted before the forward computes, and the
        # backward's gradients are awaited after it: the transfer overlaps the forward.
        f = ev.index(("F", 3, 2))
        assert ev.index(("post_recv_b", 0, 0)) < f
        assert ev.index(("post_recv_f", 3, 2)) < f
        assert ev.index(("wait_recv_b", 0, 0)) > f


@distributed(world_size=2)
def test_eval_runs_forward_only() -> None:
    rank = dist.get_rank()
    mods = _chain(2)
    stage = hp_pp.PipelineStage(mods[rank], rank, 2, torch.device("cpu"))
    sched = hp_pp.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    x, y = _data(0)
    losses: list[torch.Tensor] = []
    out = sched.eval(x) if rank == 0 else sched.eval(target=y, losses=losses)
    assert all(p.grad is None for p in mods[rank].parameters())
    if rank == 1:
        ref = mods[1](mods[0](x))
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(
            torch.stack(losses),
            torch.stack(
                [
                    nn.functional.mse_loss(r, t)
                    for r, t in zip(ref.chunk(2), y.chunk(2), strict=True)
                ]
            ),
        )


@distributed(world_size=2)
def test_eval_under_no_grad_between_steps() -> None:
    # Outputs made under no_grad lack requires_grad: the stages still exchange them, and the
    # next step's input gradients still reach the first stage.
    rank = dist.get_rank()
    mods = _chain(2)
    stage = hp_pp.PipelineStage(mods[rank], rank, 2, torch.device("cpu"))
    sched = hp_pp.Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    x, y = _data(0)
    sched.step(x) if rank == 0 else sched.step(target=y)
    mods[rank].zero_grad(set_to_none=True)
    with torch.no_grad():
        out = sched.eval(x) if rank == 0 else sched.eval(target=y)
        if rank == 1:
            torch.testing.assert_close(out, mods[1](mods[0](x)))
    assert all(p.grad is None for p in mods[rank].parameters())
    sched.step(x) if rank == 0 else sched.step(target=y)
    assert all(p.grad is not None for p in mods[rank].parameters())


class TiedEnds(nn.Module):
    """Embedding on the first stage, output head on the last, sharing one weight in the model."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part
        self.weight = nn.Parameter(torch.empty(16, DIM))
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.part == "first":
            return torch.tanh(self.lin(nn.functional.embedding(x, self.weight)))
        return torch.tanh(self.lin(x)) @ self.weight.t()


def _tied_models() -> tuple[TiedEnds, TiedEnds]:
    torch.manual_seed(0)
    first, last = TiedEnds("first"), TiedEnds("last")
    nn.init.normal_(first.weight)
    last.weight.data.copy_(first.weight.data)
    return first, last


@pytest.mark.parametrize("name", ["1F1B", "ZBVZeroBubble"])
@distributed(world_size=2)
def test_tied_parameters_get_the_summed_gradient(name: str) -> None:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 16, (4, 6), generator=g)
    target = torch.randint(0, 16, (4, 6), generator=g)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    # One process: the tied model (one weight used twice), plus middle layers for ZBV.
    first, last = _tied_models()
    torch.manual_seed(1)
    middles = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2)]
    ref_first, ref_last = _tied_models()
    ref_last.weight = ref_first.weight
    ref_mid = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(2)]
    for a, b in zip(ref_mid, middles, strict=True):
        b.load_state_dict(a.state_dict())
    v_shape = name == "ZBVZeroBubble"
    chain = [ref_first, *ref_mid, ref_last] if v_shape else [ref_first, ref_last]
    for xm, ym in zip(tokens.chunk(2), target.chunk(2), strict=True):
        h = xm
        for m in chain:
            h = m(h)
        (loss_fn(h, ym) / 2).backward()
    modules = [first, *middles, last] if v_shape else [first, last]
    num_stages = len(modules)
    indices = generators.rank_to_stages(rank, 2, num_stages, generators.STYLE[name])
    ties = {0: {"weight": "embedding"}, num_stages - 1: {"weight": "embedding"}}
    stages = [
        hp_pp.PipelineStage(
            modules[s], s, num_stages, torch.device("cpu"), tied_parameters=ties.get(s)
        )
        for s in indices
    ]
    sched = hp_pp.get_schedule_class(name)
    schedule = sched(stages if v_shape else stages[0], 2, loss_fn=loss_fn)
    schedule.step(
        *((tokens,) if 0 in indices else ()),
        target=target if num_stages - 1 in indices else None,
    )
    for s in indices:
        if s in ties:
            torch.testing.assert_close(modules[s].weight.grad, ref_first.weight.grad)
        torch.testing.assert_close(
            modules[s].lin.weight.grad if s in ties else modules[s][0].weight.grad,
            chain[s].lin.weight.grad if s in ties else chain[s][0].weight.grad,
        )


class FailsAtMicrobatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("stage 1 broke on micro-batch 1")
        return self.lin(x)


def _failing_pipeline() -> None:
    import datetime

    rank = dist.get_rank()
    module = nn.Linear(DIM, DIM) if rank == 0 else FailsAtMicrobatch()
    stage = hp_pp.PipelineStage(
        module, rank, 2, torch.device("cpu"), timeout=datetime.timedelta(seconds=2)
    )
    sched = hp_pp.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    x, y = _data(0)
    sched.step(x) if rank == 0 else sched.step(target=y)


def test_a_failing_rank_makes_the_other_fail_naming_it() -> None:
    from hp_dtensor.testing import DistributedTestError, run_distributed

    with pytest.raises(DistributedTestError) as info:
        run_distributed(_failing_pipeline, 2, timeout=30)
    text = str(info.value)
    assert "stage 1 broke on micro-batch 1" in text
    assert "rank 0, stage 0" in text
    assert "with rank 1 did not complete" in text


@distributed(world_size=3)
def test_a_later_step_posts_only_its_transfers_in_batches() -> None:
    """1F1B over 3 ranks: after the first step (stage descriptions), a step is exactly its
    transfers (an activation: its shape header and its data; a gradient: its data), posted in
    batches (batch_isend_irecv, no tags): no lone isend/irecv, barrier or other collective."""
    calls: list[str] = []
    ops: list[str] = []
    names = ["isend", "irecv", "batch_isend_irecv", "barrier", "all_reduce", "all_gather_object"]
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if name == "batch_isend_irecv":
                for op in args[0]:
                    ops.append(op.op.__name__)
                    assert op.tag == 0
            return originals[name](*args, **kwargs)

        return call

    rank, n_mb = dist.get_rank(), 4
    mods = _chain(3)
    stage = hp_pp.PipelineStage(mods[rank], rank, 3, torch.device("cpu"))
    sched = hp_pp.Schedule1F1B(stage, n_mb, loss_fn=nn.functional.mse_loss)
    per_step = []
    try:
        for name in names:
            setattr(dist, name, counting(name))
        for step in range(2):
            calls.clear()
            ops.clear()
            x, y = _data(step)
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == 2 else None)
            per_step.append((sorted(set(calls)), sorted(ops), calls.count("batch_isend_irecv")))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    # Activations go to the next stage (their shapes, then the data) and gradients come back
    # (the data): per micro-batch and boundary, all inside batches.
    boundaries = (rank > 0) + (rank < 2)
    sends = n_mb * (2 * (rank < 2) + (rank > 0))
    recvs = n_mb * (2 * (rank > 0) + (rank < 2))
    kinds, step_ops, batches = per_step[1]
    assert kinds == ["batch_isend_irecv"]
    assert step_ops == ["irecv"] * recvs + ["isend"] * sends
    assert batches <= 2 * n_mb * boundaries
    # The first step also carries each stage's output description (one tensor).
    assert per_step[0][1].count("isend") == sends + (rank < 2)
    assert per_step[0][1].count("irecv") == recvs + (rank > 0)
