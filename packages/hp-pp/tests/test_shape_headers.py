"""``PipelineStage(shape_headers=False)``: no per-message shape header, no host read per message.

With headers (the default, for uneven micro-batches) every activation message carries its
shapes and the receiver reads them: one host read per received message, on every step. A job
whose batches always divide evenly (hp-trainer's) builds its stages without them: the step is
bitwise the same, no ``shape`` transfer appears in the trace, and the receiving stage's step
has no host read left; a micro-batch whose shapes differ then raises on the sender, naming the
option (the harness then rebuilds its pool: the receiver's wait would end at its timeout).
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hp_pp
from hp_dtensor.testing import DistributedTestError, count_host_syncs, run_distributed


def _model(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(num_stages)]


def _steps(headers: bool, rows: list[int], timeout_s: float = 60.0) -> Any:
    from hp_pp.p2p_model import program_to_json

    rank = dist.get_rank()
    mods = _model(2)
    stage = hp_pp.PipelineStage(
        mods[rank],
        rank,
        2,
        torch.device("cpu"),
        shape_headers=headers,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    sched = hp_pp.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss)
    out: list[Any] = []
    for step, n in enumerate(rows):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)
        mods[rank].zero_grad()
        # a refusal (sender) or a timeout (receiver) raises out of the worker: a timed-out gloo
        # wait closes its pairs, and the harness rebuilds its pool after a failure
        with count_host_syncs() as syncs:
            losses: list[torch.Tensor] = []
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses)
        shapes = [
            op
            for event in program_to_json(sched.executor.trace)
            for op in event.get("ops", [])
            if op["ident"][-1] == "shape"
        ]
        grads = [p.grad.clone() for p in mods[rank].parameters() if p.grad is not None]
        out.append(("ok", losses, grads, len(shapes), syncs.total))
    return out


def test_without_headers_the_step_is_the_same_and_reads_nothing() -> None:
    with_headers = run_distributed(_steps, 2, True, [8, 8], timeout=120)
    without = run_distributed(_steps, 2, False, [8, 8], timeout=120)
    for rank in range(2):
        for a, b in zip(with_headers[rank], without[rank], strict=True):
            assert a[0] == b[0] == "ok"
            for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
                assert torch.equal(x, y)  # bitwise the same step
            assert b[3] == 0  # no shape transfer in the trace
    # the receiving stage reads one header per received activation message (4 micro-batches)
    # on every step; without headers its steps read nothing
    assert [s[4] for s in with_headers[1]] == [
        without[1][0][4] + 4,
        without[1][1][4] + 4,
    ], (with_headers[1], without[1])
    assert without[1][1][4] == 0
    assert with_headers[1][1][3] > 0


def test_without_headers_a_smaller_microbatch_is_refused_on_the_sender() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_steps, 2, False, [8, 7], 8.0, timeout=120)
    text = str(info.value)
    assert text.startswith("failed on rank(s) [0]")  # the sender refuses before sending
    assert "PipeliningMetadataError" in text
    assert "shape_headers=False" in text


def test_shape_headers_must_be_a_bool() -> None:
    from hp_dtensor.testing import fake_world

    with fake_world(2, rank=0), pytest.raises(TypeError, match="shape_headers must be a bool"):
        hp_pp.PipelineStage(nn.Linear(2, 2), 0, 2, torch.device("cpu"), shape_headers=1)  # type: ignore[arg-type]
