"""Micro-batching and bad input: clear errors before any communication (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining.microbatch import TensorChunkSpec as TorchChunkSpec

import hp_pp
from hp_dtensor.testing import fake_world


def test_split_accepts_torch_and_own_specs() -> None:
    x = torch.arange(24.0).reshape(4, 6)
    mask = torch.arange(12).reshape(2, 6)
    args, kwargs = hp_pp.split_args_kwargs_into_chunks(
        (x, 7),
        {"mask": mask},
        2,
        (hp_pp.TensorChunkSpec(0), None),
        {"mask": TorchChunkSpec(1)},
    )
    assert [a[0].shape for a in args] == [(2, 6), (2, 6)]
    assert [a[1] for a in args] == [7, 7]
    assert [k["mask"].shape for k in kwargs] == [(2, 3), (2, 3)]
    assert torch.equal(hp_pp.merge_chunks([a[0] for a in args]), x)
    merged = hp_pp.merge_chunks([k["mask"] for k in kwargs], TorchChunkSpec(1))
    assert torch.equal(merged, mask)


def test_merge_with_reducer_and_structures() -> None:
    class Sum:
        init_value = 0.0

        @staticmethod
        def reduce_fn(acc: float, v: torch.Tensor) -> float:
            return acc + float(v)

    chunks = [(torch.ones(2, 3), torch.tensor(1.0)), (torch.zeros(2, 3), torch.tensor(2.0))]
    out, total = hp_pp.merge_chunks(chunks, (hp_pp.TensorChunkSpec(0), Sum()))
    assert out.shape == (4, 3)
    assert total == 3.0


def test_uneven_batch_splits_as_torch_and_too_small_is_refused() -> None:
    from torch.distributed.pipelining.microbatch import (
        split_args_kwargs_into_chunks as torch_split,
    )

    x = torch.arange(20.0).reshape(10, 2)
    mask = torch.arange(30).reshape(3, 10)
    ours = hp_pp.split_args_kwargs_into_chunks(
        (x,), {"mask": mask}, 4, None, {"mask": TorchChunkSpec(1)}
    )
    theirs = torch_split((x,), {"mask": mask}, 4, None, {"mask": TorchChunkSpec(1)})
    assert [a[0].shape[0] for a in ours[0]] == [3, 3, 2, 2]
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert torch.equal(a[0], b[0])
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(a["mask"], b["mask"])
    assert torch.equal(hp_pp.merge_chunks([a[0] for a in ours[0]]), x)
    with pytest.raises(ValueError, match=r"batch size 3 .* smaller than n_microbatches=4"):
        hp_pp.split_args_kwargs_into_chunks((torch.zeros(3, 2),), None, 4)
    with pytest.raises(ValueError, match="args_chunk_spec has 2 entries"):
        hp_pp.split_args_kwargs_into_chunks((torch.zeros(4),), None, 2, (None, None))
    with pytest.raises(TypeError, match="split_dim"):
        hp_pp.split_args_kwargs_into_chunks((torch.zeros(4),), None, 2, ("dim0",))


def _stage(index: int, num_stages: int) -> hp_pp.PipelineStage:
    return hp_pp.PipelineStage(nn.Linear(4, 4), index, num_stages, torch.device("cpu"))


def test_bad_schedule_input_raises_before_communication() -> None:
    with fake_world(2, rank=0):
        with pytest.raises(ValueError, match=r"stage_index must be in \[0, 2\)"):
            _stage(2, 2)
        # ZBV needs the V mapping: rank 0 holds stages 0 and 3, not 0 and 2.
        with pytest.raises(ValueError, match=r"holds stages \[0, 2\].*'v' mapping.*\[0, 3\]"):
            hp_pp.ScheduleZBVZeroBubble([_stage(0, 4), _stage(2, 4)], 4)
        with pytest.raises(ValueError, match="num_stages == 2 \\* pp_size = 4"):
            hp_pp.ScheduleDualPipeV([_stage(0, 6), _stage(5, 6)], 4)
        with pytest.raises(ValueError, match="n_microbatches must be an int >= 1"):
            hp_pp.ScheduleGPipe(_stage(0, 2), 0)
        with pytest.raises(ValueError, match="backward_requires_autograd=False"):
            hp_pp.ScheduleInterleaved1F1B(
                [_stage(0, 4), _stage(2, 4)], 4, backward_requires_autograd=False
            )
        sched = hp_pp.Schedule1F1B(_stage(0, 2), 4, loss_fn=nn.functional.mse_loss)
        with pytest.raises(ValueError, match=r"batch size 3 .* n_microbatches=4"):
            sched.step(torch.zeros(3, 4))
        with pytest.raises(ValueError, match="needs the model inputs"):
            sched.step()
    with fake_world(2, rank=1):
        sched = hp_pp.Schedule1F1B(_stage(1, 2), 4, loss_fn=nn.functional.mse_loss)
        with pytest.raises(ValueError, match="needs target="):
            sched.step()
        no_loss = hp_pp.Schedule1F1B(_stage(1, 2), 4)
        with pytest.raises(ValueError, match="no loss_fn"):
            no_loss.step(target=torch.zeros(4, 4))


def test_table_must_cover_every_forward() -> None:
    with fake_world(2, rank=0):
        table = {
            0: [hp_pp.Action.parse(a) for a in ("0F0", "0B0")],
            1: [hp_pp.Action.parse(a) for a in ("1F0", "1B0")],
        }
        # The whole table is validated offline before any communication.
        with pytest.raises(ValueError, match="no forward 0F1"):
            hp_pp.PipelineScheduleRuntime([_stage(0, 2)], 2, actions=table)
        stuck = {
            0: [hp_pp.Action.parse(a) for a in ("0F0", "0B0")],
            1: [hp_pp.Action.parse(a) for a in ("1B0", "1F0")],
        }
        with pytest.raises(ValueError, match="invalid pipeline schedule"):
            hp_pp.PipelineScheduleRuntime([_stage(0, 2)], 1, actions=stuck)
        # A compute-only table needs every row: transfers are placed from the whole table.
        with pytest.raises(ValueError, match="compute-only table needs every rank's row"):
            hp_pp.PipelineScheduleRuntime([_stage(0, 2)], 1, actions={0: table[1]})
        written = [hp_pp.Action.parse(a) for a in ("1RECV_F0", "1F0", "1B0", "1SEND_B0")]
        with pytest.raises(ValueError, match="names stage 1, but this rank holds stages"):
            hp_pp.PipelineScheduleRuntime([_stage(0, 2)], 1, actions={0: written})
        with pytest.raises(ValueError, match="no row for pipeline rank 0"):
            hp_pp.PipelineScheduleRuntime([_stage(0, 2)], 1, actions={1: table[1]})


def test_get_schedule_class_names() -> None:
    assert hp_pp.get_schedule_class("ScheduleZBVZeroBubble") is hp_pp.ScheduleZBVZeroBubble
    assert hp_pp.get_schedule_class("zbv") is hp_pp.ScheduleZBVZeroBubble
    assert hp_pp.get_schedule_class("1f1b") is hp_pp.Schedule1F1B
    assert hp_pp.get_schedule_class("MPipe") is hp_pp.ScheduleMPipe
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        hp_pp.get_schedule_class("nope")


def test_signatures_match_torch() -> None:
    import inspect

    import torch.distributed.pipelining as tpp
    from torch.distributed.pipelining import schedules as tsched

    def params(fn: object) -> list[tuple[str, object]]:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        return [
            (p.name, p.default)
            for p in sig.parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY
        ]

    pairs = [
        (hp_pp.PipelineStage.__init__, tpp.PipelineStage.__init__),
        (hp_pp.ScheduleGPipe.__init__, tpp.ScheduleGPipe.__init__),
        (hp_pp.Schedule1F1B.__init__, tpp.Schedule1F1B.__init__),
        (hp_pp.ScheduleLoopedBFS.__init__, tpp.ScheduleLoopedBFS.__init__),
        (hp_pp.ScheduleInterleaved1F1B.__init__, tpp.ScheduleInterleaved1F1B.__init__),
        (hp_pp.ScheduleInterleavedZeroBubble.__init__, tpp.ScheduleInterleavedZeroBubble.__init__),
        (hp_pp.ScheduleZBVZeroBubble.__init__, tpp.ScheduleZBVZeroBubble.__init__),
        (hp_pp.ScheduleDualPipeV.__init__, tpp.ScheduleDualPipeV.__init__),
        (hp_pp.PipelineScheduleRuntime.step, tsched.PipelineScheduleMulti.step),
        (hp_pp.PipelineScheduleRuntime.eval, tsched.PipelineScheduleMulti.eval),
        (hp_pp.PipelineStage.forward_one_chunk, tpp.PipelineStage.forward_one_chunk),
        (hp_pp.PipelineStage.backward_one_chunk, tpp.PipelineStage.backward_one_chunk),
        (
            hp_pp.PipelineStage.backward_weight_one_chunk,
            tpp.PipelineStage.backward_weight_one_chunk,
        ),
        (hp_pp.build_stage, tpp.build_stage),
        (
            hp_pp.PipelineScheduleRuntime.register_custom_function,
            tsched._PipelineScheduleRuntime.register_custom_function,
        ),
        (
            hp_pp.PipelineScheduleRuntime._prepare_schedule_with_comms,
            tsched._PipelineScheduleRuntime._prepare_schedule_with_comms,
        ),
        (
            hp_pp.PipelineScheduleRuntime._load_csv,
            tsched._PipelineScheduleRuntime._load_csv,
        ),
    ]
    for ours, theirs in pairs:
        assert params(ours) == params(theirs), ours
