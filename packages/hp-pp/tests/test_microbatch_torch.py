"""Micro-batching and stage metadata errors next to torch.distributed.pipelining (no processes)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import microbatch as torch_mb
from torch.distributed.pipelining.stage import (  # type: ignore[attr-defined]
    PipeliningMetadataError as TorchMetadataError,
)

import hp_pp
from hp_dtensor.testing import fake_world, run_distributed


def _dims(specs: object) -> object:
    """The structure of split dimensions of a spec structure (ours or torch's)."""
    if isinstance(specs, dict):
        return {k: _dims(v) for k, v in specs.items()}
    if isinstance(specs, tuple | list):
        return type(specs)(_dims(s) for s in specs)
    return ("spec", specs.split_dim)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "dims",
    [(0, 0, 1), (), (1,), (0, [1, {"x": 2}]), [0, 1]],
    ids=["t3", "empty", "t1", "nest", "l"],
)
def test_from_tuple_matches_torch(dims: tuple[int, ...]) -> None:
    ours = hp_pp.TensorChunkSpec.from_tuple(dims)
    theirs = torch_mb.TensorChunkSpec.from_tuple(dims)
    assert _dims(ours) == _dims(theirs)
    # torch's lists come back as fx's immutable_list (a list); ours as a plain list.
    assert isinstance(ours, tuple) == isinstance(theirs, tuple)
    assert isinstance(ours, list) == isinstance(theirs, list)


def test_from_dict_matches_torch_and_splits_like_torch() -> None:
    dims = {"ids": 0, "mask": 1}
    ours = hp_pp.TensorChunkSpec.from_dict(dims)
    theirs = torch_mb.TensorChunkSpec.from_dict(dims)
    assert _dims(ours) == _dims(theirs) == {"ids": ("spec", 0), "mask": ("spec", 1)}
    assert list(ours) == ["ids", "mask"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 5, generator=g)
    y = torch.randn(8, 6, generator=g)
    ids = torch.randint(0, 9, (8, 2), generator=g)
    mask = torch.randn(3, 8, generator=g)
    arg_specs = (0, 1)
    a, k = hp_pp.split_args_kwargs_into_chunks(
        (x, y.t()),
        {"ids": ids, "mask": mask},
        4,
        hp_pp.TensorChunkSpec.from_tuple(arg_specs),
        ours,
    )
    ta, tk = torch_mb.split_args_kwargs_into_chunks(
        (x, y.t()),
        {"ids": ids, "mask": mask},
        4,
        torch_mb.TensorChunkSpec.from_tuple(arg_specs),
        theirs,
    )
    assert len(a) == len(ta) == 4
    for (a0, a1), (t0, t1), kk, tkk in zip(a, ta, k, tk, strict=True):
        assert torch.equal(a0, t0)
        assert torch.equal(a1, t1)
        assert a1.shape == (6, 2)
        assert torch.equal(kk["ids"], tkk["ids"])
        assert torch.equal(kk["mask"], tkk["mask"])
        assert kk["mask"].shape == (3, 2)


@pytest.mark.parametrize("bad", [("a",), (None,), (0, 1.5), {"m": True}])
def test_from_tuple_rejects_non_int_dims(bad: object) -> None:
    # torch builds TensorChunkSpec("a") silently and fails later; ours names the value now.
    make = (
        hp_pp.TensorChunkSpec.from_dict
        if isinstance(bad, dict)
        else hp_pp.TensorChunkSpec.from_tuple
    )
    with pytest.raises(TypeError, match="expected chunk dimensions"):
        make(bad)  # type: ignore[arg-type]


def test_metadata_error_is_torchs_type_and_a_value_error() -> None:
    assert issubclass(hp_pp.PipeliningMetadataError, TorchMetadataError)
    assert issubclass(hp_pp.PipeliningMetadataError, ValueError)
    assert issubclass(hp_pp.PipeliningMetadataError, RuntimeError)


def _stage0(**kw: object) -> hp_pp.PipelineStage:
    torch.manual_seed(0)
    return hp_pp.PipelineStage(nn.Linear(4, 4), 0, 2, torch.device("cpu"), **kw)  # type: ignore[arg-type]


def test_smaller_microbatch_travels_padded_larger_or_other_dtype_raises() -> None:
    with fake_world(2, rank=0):
        stage = _stage0()
        stage.forward_one_chunk(0, (torch.randn(2, 4),))
        first = stage.activation_send_parts(0)
        assert [p.ident[-1] for p in first] == ["meta", "shape", "data0"]
        assert first[1].tensor.tolist() == [2, 4]
        stage.forward_one_chunk(1, (torch.randn(2, 4),))
        assert [p.ident[-1] for p in stage.activation_send_parts(1)] == ["shape", "data0"]
        short = torch.randn(1, 4)
        out = stage.forward_one_chunk(2, (short,))  # a shorter micro-batch (uneven split)
        parts = stage.activation_send_parts(2)
        assert parts[0].tensor.tolist() == [1, 4]
        assert parts[1].tensor.shape == (2, 4)  # padded to the described buffer
        assert torch.equal(parts[1].tensor[:1], out.detach())
        assert torch.equal(parts[1].tensor[1:], torch.zeros(1, 4))
        stage.forward_one_chunk(3, (torch.randn(3, 4),))  # larger than the description
        with pytest.raises(TorchMetadataError, match=r"micro-batch 3: outputs are .*\(3, 4\)"):
            stage.activation_send_parts(3)
        stage.submod.double()
        stage.forward_one_chunk(4, (torch.randn(2, 4, dtype=torch.float64),))
        with pytest.raises(hp_pp.PipeliningMetadataError, match="float64"):
            stage.activation_send_parts(4)


def test_declared_outputs_mismatch_raises_metadata_error() -> None:
    with fake_world(2, rank=0):
        stage = _stage0(output_args=(torch.zeros(2, 5),))
        stage.forward_one_chunk(0, (torch.randn(2, 4),))
        with pytest.raises(TorchMetadataError, match=r"declared outputs are .*\(2, 5\)"):
            stage.activation_send_parts(0)


def _torch_uneven_step(schedule: str) -> tuple[str, Any]:
    """torch's own schedule on a batch of 7 rows in 4 micro-batches (2, 2, 2, 1), 2 stages."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)]
    stage = PipelineStage(mods[rank], rank, 2, torch.device("cpu"))
    cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
    sched = cls(stage, 4, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's mse broadcast warning
            out = sched.step(x) if rank == 0 else sched.step(target=y)
    except RuntimeError as exc:
        return "raised", str(exc)
    return "returned", None if out is None else tuple(out.shape)


def _hp_uneven_steps(schedule: str, stages_per_rank: int, batches: list[int]) -> Any:
    """hp-pp's schedule on batches that 4 micro-batches do not divide (and one that it does):
    per step, the losses and gradients (sum-reduced loss, scale_grads=False: the full
    batch's gradients exactly) and the output, plus each step's point-to-point trace."""
    from hp_pp import generators
    from hp_pp.p2p_model import program_to_json

    rank, ws = dist.get_rank(), dist.get_world_size()
    num_stages = ws * stages_per_rank
    style = generators.STYLE[schedule]
    indices = generators.rank_to_stages(rank, ws, num_stages, style)
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(num_stages)]
    stages = [hp_pp.PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in indices]
    cls = hp_pp.get_schedule_class(schedule)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).sum()

    one = stages[0] if schedule in ("GPipe", "1F1B") else stages
    sched = cls(one, 4, loss_fn=loss_fn, scale_grads=False)  # type: ignore[arg-type]
    steps = []
    for step, rows in enumerate(batches):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(rows, 6, generator=g), torch.randn(rows, 6, generator=g)
        for m in mods:
            m.zero_grad()
        losses: list[torch.Tensor] = []
        out = sched.step(
            *((x,) if 0 in indices else ()),
            target=y if num_stages - 1 in indices else None,
            losses=losses,
        )
        grads = {
            f"{s}.{k}": p.grad.clone()
            for s in indices
            for k, p in mods[s].named_parameters()
            if p.grad is not None
        }
        steps.append((losses, grads, out, program_to_json(sched.executor.trace)))
    return steps


def _one_process_uneven(num_stages: int, rows: int, step: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(num_stages)])
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(rows, 6, generator=g), torch.randn(rows, 6, generator=g)
    out = model(x)
    ((out - y) ** 2).sum().backward()
    losses = [
        ((model(xm) - ym) ** 2).sum()
        for xm, ym in zip(x.tensor_split(4), y.tensor_split(4), strict=True)
    ]
    grads = {f"{i}.{k}": p.grad for i, blk in enumerate(model) for k, p in blk.named_parameters()}
    return losses, grads, out.detach()


@pytest.mark.parametrize(
    ("ws", "schedule", "per_rank"),
    [(2, "GPipe", 1), (2, "1F1B", 1), (3, "1F1B", 1), (2, "Interleaved1F1B", 2)],
)
def test_uneven_microbatches_equal_one_process(ws: int, schedule: str, per_rank: int) -> None:
    """Batches of 7 and 5 rows in 4 micro-batches (2,2,2,1 and 2,1,1,1; torch's split), then 8:
    losses, gradients and outputs equal one process; each step's trace replays under NCCL's
    rules. torch 2.13 cannot run these steps (below)."""
    from hp_pp.p2p_model import program_from_json, replay

    batches = [7, 5, 8]
    per = run_distributed(_hp_uneven_steps, ws, schedule, per_rank, batches, timeout=120)
    num_stages = ws * per_rank
    for step, rows in enumerate(batches):
        ref_losses, ref_grads, ref_out = _one_process_uneven(num_stages, rows, step)
        grads = {k: g for r in range(ws) for k, g in per[r][step][1].items()}
        assert set(grads) == set(ref_grads)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_grads[k], rtol=1e-5, atol=1e-5)
        last = next(r for r in range(ws) if per[r][step][2] is not None)
        assert per[last][step][2].shape == (rows, 6)
        torch.testing.assert_close(per[last][step][2], ref_out, rtol=1e-6, atol=1e-6)
        for a, b in zip(per[last][step][0], ref_losses, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
        report = replay({r: program_from_json(per[r][step][3]) for r in range(ws)})
        assert report.ok, (step, report.problems)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_torch_2_13_cannot_run_uneven_microbatches_across_ranks(schedule: str) -> None:
    """torch's own schedule has no per-micro-batch shapes between stages: stage 1 receives the
    short micro-batch into a buffer of the first one's shape (its merged output has 8 rows for
    a batch of 7) and stage 0's backward fails on the gradient's shape. Recorded on torch 2.13
    (hp-pp runs the same step: the test above); when this test starts failing, torch
    supports it."""
    results = run_distributed(_torch_uneven_step, 2, schedule, timeout=120)
    assert results[0][0] == "raised"
    assert "Failed to run stage backward" in results[0][1]
    assert results[1] == ("returned", (8, 6))
    # hp-pp refuses only a batch smaller than the micro-batch count.
    with fake_world(2, rank=0):
        stage = hp_pp.PipelineStage(nn.Linear(6, 6), 0, 2, torch.device("cpu"))
        sched = getattr(hp_pp, f"Schedule{schedule}")(stage, 4, loss_fn=nn.functional.mse_loss)
        with pytest.raises(ValueError, match=r"batch size 3 .* smaller than n_microbatches=4"):
            sched.step(torch.zeros(3, 6))
