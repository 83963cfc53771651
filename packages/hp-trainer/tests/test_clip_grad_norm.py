"""``clip_grad_norm_`` on DTensor gradients: the norm and the clipped gradients equal PyTorch's
DTensor clipping bitwise and one process's to rounding, and the scaling runs on local tensors
(no DTensor ``_foreach_mul_`` is dispatched, so no list of shardings is propagated).

Gradients on a 1-D mesh of 3 ranks (uneven shards) and on a 2 x 2 mesh (Shard, Replicate and
Partial placements, two meshes in one call): random global gradients sharded over the ranks,
and a Partial one whose summand differs on each tp rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from hp_dtensor.testing import run_distributed
from hp_trainer.trainer import clip_grad_norm_


class _ForeachMuls(TorchDispatchMode):
    """Records each ``_foreach_mul_`` and whether a DTensor was among its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is torch.ops.aten._foreach_mul_:
            self.calls.append(any(isinstance(t, DTensor) for t in args[0]))
        return func(*args, **(kwargs or {}))


def _params(layouts: list[tuple[Any, tuple[int, ...], list[Any]]]) -> list[nn.Parameter]:
    torch.manual_seed(0)  # the same global values on every rank ...
    params = []
    for mesh, shape, placements in layouts:
        value, grad = torch.randn(shape), torch.randn(shape)
        if any(isinstance(p, Partial) for p in placements):
            # ... except a Partial gradient of a replicated parameter: each tp rank holds its
            # own summand
            param = nn.Parameter(distribute_tensor(value, mesh, [Replicate()] * mesh.ndim))
            summand = torch.Generator().manual_seed(100 + mesh.get_local_rank(mesh.ndim - 1))
            local = torch.randn(shape, generator=summand)
            param.grad = DTensor.from_local(local, mesh, placements)
        else:
            param = nn.Parameter(distribute_tensor(value, mesh, placements))
            param.grad = distribute_tensor(grad, mesh, placements)
        params.append(param)
    return params


def _layouts(world: int) -> list[tuple[Any, tuple[int, ...], list[Any]]]:
    if world == 3:
        mesh = init_device_mesh("cpu", (3,))
        return [
            (mesh, (7, 5), [Shard(0)]),
            (mesh, (4, 10), [Shard(1)]),
            (mesh, (6,), [Replicate()]),
        ]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (4,))  # a second mesh (experts under EP)
    return [
        (mesh, (6, 4), [Shard(0), Replicate()]),
        (mesh, (5, 8), [Shard(0), Shard(1)]),
        (mesh, (3, 3), [Replicate(), Partial()]),
        (other, (9, 2), [Shard(0)]),
    ]


def _clip(max_norm: float, foreach: bool | None) -> dict[str, Any]:
    world = dist.get_world_size()
    ours, torchs = _params(_layouts(world)), _params(_layouts(world))
    with _ForeachMuls() as mode:
        norm = clip_grad_norm_(ours, max_norm, foreach=foreach)
    # PyTorch's DTensor clipping, one call per mesh (its foreach ops take one mesh)
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in torchs:
        by_mesh.setdefault(param.grad.device_mesh, []).append(param)  # type: ignore[union-attr]
    norms = [
        torch.nn.utils.get_total_norm([p.grad for p in g]).full_tensor() for g in by_mesh.values()
    ]
    total = torch.nn.utils.get_total_norm(norms) if len(norms) > 1 else norms[0]
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    pairs = list(zip(ours, torchs, strict=True))
    return {
        "norm": (norm, total),
        "grads": [(a.grad.full_tensor(), b.grad.full_tensor()) for a, b in pairs],  # type: ignore[union-attr]
        "locals": [(a.grad.to_local(), b.grad.to_local()) for a, b in pairs],  # type: ignore[union-attr]
        "dtensor_muls": mode.calls,
    }


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize(("max_norm", "foreach"), [(0.5, None), (0.5, False), (100.0, None)])
def test_clipping_equals_torch_dtensor_clipping_bitwise(
    world: int, max_norm: float, foreach: bool | None
) -> None:
    for rank_result in run_distributed(_clip, world, max_norm, foreach):
        ours, theirs = rank_result["norm"]
        assert torch.equal(ours, theirs)
        # 0.5: below the norm, the gradients shrink; 100: above it, they stay (factor 1)
        assert (ours.item() > max_norm) == (max_norm == 0.5)
        for (a, b), (la, lb) in zip(rank_result["grads"], rank_result["locals"], strict=True):
            assert torch.equal(a, b)
            assert torch.equal(la, lb)
        # foreach (None) multiplies the local tensors once per (device, dtype); never a DTensor
        assert rank_result["dtensor_muls"] == ([False] if foreach is None else [])


def _one_process() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    params = _params(_layouts(dist.get_world_size()))
    before = [p.grad.full_tensor().clone() for p in params]  # type: ignore[union-attr]
    norm = clip_grad_norm_(params, 0.5)
    return norm, before, [p.grad.full_tensor() for p in params]  # type: ignore[union-attr]


@pytest.mark.parametrize("world", [3, 4])
def test_clipping_equals_one_process(world: int) -> None:
    norm, before, after = run_distributed(_one_process, world)[0]
    plain = [nn.Parameter(torch.zeros_like(g)) for g in before]
    for param, grad in zip(plain, before, strict=True):
        param.grad = grad.clone()
    want = torch.nn.utils.clip_grad_norm_(plain, 0.5)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    for param, got in zip(plain, after, strict=True):
        torch.testing.assert_close(got, param.grad, rtol=1e-6, atol=1e-7)
