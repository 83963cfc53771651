"""TorchTitan's ``create_context_parallel_ctx``, now hp-trainer's: one step at cp = 3 equals one
process (loss and gradient), for every rotate method, and bad methods fail clearly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from hp_dtensor.testing import run_distributed
from hp_trainer.distributed.context_parallel import create_context_parallel_ctx

SEQ, HEADS, DIM = 12, 3, 4


def _step(x: torch.Tensor, scale: torch.nn.Parameter) -> torch.Tensor:
    q = (x * scale).view(1, -1, HEADS, DIM).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q.flip(-1), q, is_causal=True)
    return (out * out).sum()


def _one_process() -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(1, SEQ, HEADS * DIM)
    scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, HEADS * DIM))
    loss = _step(x, scale)
    loss.backward()  # type: ignore[no-untyped-call]
    assert scale.grad is not None
    return float(loss), scale.grad.clone()


def _cp(method: str) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(1, SEQ, HEADS * DIM)
    scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, HEADS * DIM))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with create_context_parallel_ctx(mesh, [x], [1], {x}, method):
        assert x.shape[1] == SEQ // 3  # this rank's shard
        loss = _step(x, scale)
        loss.backward()  # type: ignore[no-untyped-call]
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert scale.grad is not None
    grad = scale.grad.clone()
    dist.all_reduce(grad)
    return float(total), grad


@pytest.mark.parametrize("method", ["allgather", "alltoall", "ring", "ulysses"])
def test_one_step_at_cp3_equals_one_process(method: str) -> None:
    want_loss, want_grad = _one_process()
    for loss, grad in run_distributed(_cp, 3, method, timeout=60):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)


def test_unknown_rotate_method_is_refused() -> None:
    x: Any = torch.zeros(1, 4)
    with pytest.raises(ValueError, match=r"cp_rotate_method must be one of .*got 'hybrid'"):
        create_context_parallel_ctx(None, [x], [1], set(), "hybrid")  # type: ignore[arg-type]
