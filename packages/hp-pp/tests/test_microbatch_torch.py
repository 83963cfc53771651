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


def test_output_shape_change_between_microbatches_raises_metadata_error() -> None:
    with fake_world(2, rank=0):
        stage = _stage0()
        stage.forward_one_chunk(0, (torch.randn(2, 4),))
        first = stage.activation_send_parts(0)
        assert [p.ident[-1] for p in first] == ["meta", "data0"]
        stage.forward_one_chunk(1, (torch.randn(2, 4),))
        assert [p.ident[-1] for p in stage.activation_send_parts(1)] == ["data0"]
        stage.forward_one_chunk(2, (torch.randn(1, 4),))  # a shorter micro-batch
        with pytest.raises(TorchMetadataError, match=r"micro-batch 2: outputs are .*\(1, 4\)"):
            stage.activation_send_parts(2)
        stage.submod.double()
        stage.forward_one_chunk(3, (torch.randn(2, 4, dtype=torch.float64),))
        with pytest.raises(hp_pp.PipeliningMetadataError, match="float64"):
            stage.activation_send_parts(3)


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


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_torch_2_13_cannot_run_uneven_microbatches_across_ranks(schedule: str) -> None:
    """Why hp-pp's schedules still refuse a batch n_microbatches does not divide: torch's own
    schedule has no per-micro-batch shapes between stages. Stage 1 receives the short
    micro-batch into a buffer of the first one's shape (its merged output has 8 rows for a
    batch of 7) and stage 0's backward fails on the gradient's shape. Recorded on torch 2.13;
    when this test starts failing, torch supports it and hp-pp should follow."""
    results = run_distributed(_torch_uneven_step, 2, schedule, timeout=120)
    assert results[0][0] == "raised"
    assert "Failed to run stage backward" in results[0][1]
    assert results[1] == ("returned", (8, 6))
    # hp-pp refuses the same step before any communication, naming both numbers.
    with fake_world(2, rank=0):
        stage = hp_pp.PipelineStage(nn.Linear(6, 6), 0, 2, torch.device("cpu"))
        sched = getattr(hp_pp, f"Schedule{schedule}")(stage, 4, loss_fn=nn.functional.mse_loss)
        with pytest.raises(ValueError, match=r"batch size 7 .* n_microbatches=4"):
            sched.step(torch.zeros(7, 6))
