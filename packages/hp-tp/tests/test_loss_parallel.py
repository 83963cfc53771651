"""``hp_tp.loss_parallel`` against ``F.cross_entropy`` on full logits and torch's loss_parallel.

The vocabulary (10 classes) does not divide the 3 ranks evenly (shards of 4, 4 and 2 classes).
The logits are the same on every rank (they are one replicated tensor, sharded by
``distribute_tensor``); what each rank computes on, its slice of the vocabulary, differs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import hp_tp
from hp_dtensor.testing import distributed

N, V, IGNORE = 7, 10, 3


class LocalShapeRecorder(TorchDispatchMode):
    """Records the largest plain (non-DTensor) tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if type(t) is torch.Tensor:
                self.max_numel = max(self.max_numel, t.numel())
        return out


def loss_and_grad(
    ns: Any, logits: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and input gradient through ``ns.loss_parallel`` (ns=None: plain F.cross_entropy)."""
    if ns is None:
        x = logits.clone().requires_grad_()
        loss = F.cross_entropy(x, target, **kw)
        loss.backward(upstream)
        assert x.grad is not None
        return loss.detach(), x.grad
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with ns.loss_parallel():
        loss = F.cross_entropy(x, target, **kw)
        assert isinstance(loss, DTensor)
        if ns is torch_tp:  # torch needs the backward inside the context
            loss.backward(distribute_tensor(upstream, mesh, [Replicate()]))
    if ns is hp_tp:  # ours may run it after the block
        loss.backward(distribute_tensor(upstream, mesh, [Replicate()]))
    assert x.grad is not None
    return loss.full_tensor().detach(), x.grad.full_tensor()


CONFIGS: list[dict[str, Any]] = [
    {},
    {"reduction": "sum", "ignore_index": IGNORE},
    {"reduction": "none", "ignore_index": IGNORE},
    {"reduction": "mean", "ignore_index": IGNORE, "weight": True},
    {"reduction": "none", "weight": True},
]
# label smoothing, which torch's loss_parallel rejects: compared with the single process only
SMOOTHED: list[dict[str, Any]] = [
    {"label_smoothing": 0.2},
    {"label_smoothing": 0.1, "reduction": "sum", "ignore_index": IGNORE, "weight": True},
    {"label_smoothing": 0.3, "reduction": "none", "ignore_index": IGNORE},
    {"label_smoothing": 0.15, "reduction": "mean", "ignore_index": IGNORE, "weight": True},
]


def run_loss_cases() -> None:
    torch.manual_seed(5)  # the logits are one global tensor: the same on every rank
    logits2d = torch.randn(N, V)
    target2d = torch.randint(0, V, (N,))
    target2d[1] = IGNORE
    target2d[4] = IGNORE
    weight = torch.rand(V) + 0.5
    logits3d = torch.randn(2, V, 3)  # [batch, class, extra]: the class dim is 1
    target3d = torch.randint(0, V, (2, 3))
    for logits, target in ((logits2d, target2d), (logits3d, target3d)):
        for cfg in CONFIGS + SMOOTHED:
            kw = dict(cfg)
            if kw.pop("weight", False):
                kw["weight"] = weight
            shape = target.shape if kw.get("reduction") == "none" else ()
            upstream = torch.rand(shape) + 0.5
            ref = loss_and_grad(None, logits, target, upstream, **kw)
            ours = loss_and_grad(hp_tp, logits, target, upstream, **kw)
            for r, o, what in zip(ref, ours, ("loss", "grad"), strict=True):
                torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5, msg=f"{what} {cfg}")
            if "label_smoothing" in cfg:
                continue  # torch's loss_parallel rejects label smoothing
            theirs = loss_and_grad(torch_tp, logits, target, upstream, **kw)
            for o, t, what in zip(ours, theirs, ("loss", "grad"), strict=True):
                # same arithmetic in the same order as torch's handlers: bitwise equal
                assert torch.equal(o, t), (what, cfg, (o - t).abs().max())


def run_module_form_and_memory() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(6)
    logits, target = torch.randn(N, V), torch.randint(0, V, (N,))
    x = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
    recorder = LocalShapeRecorder()
    with hp_tp.loss_parallel(), recorder:
        loss = nn.CrossEntropyLoss()(x, target)
        loss.backward()
    shard = -(-V // dist.get_world_size())
    # no rank ever materializes the full [N, V] logits, forward or backward
    assert 0 < recorder.max_numel <= N * shard, recorder.max_numel
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits, target))
    # the two halves: log_softmax keeps the vocabulary sharding, nll_loss reduces over it
    weight = torch.rand(V) + 0.5
    z = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    ref_in = logits.clone().requires_grad_()
    with hp_tp.loss_parallel():
        log_probs = F.log_softmax(z, dim=-1)
        assert isinstance(log_probs, DTensor)
        assert log_probs.placements == (Shard(1),)
        nll = F.nll_loss(log_probs * 1.5, target, weight=weight, ignore_index=int(target[0]))
    nll.backward()
    ref_nll = F.nll_loss(
        F.log_softmax(ref_in, dim=-1) * 1.5, target, weight=weight, ignore_index=int(target[0])
    )
    ref_nll.backward()
    torch.testing.assert_close(nll.full_tensor(), ref_nll, rtol=1e-5, atol=1e-5)
    assert z.grad is not None
    assert ref_in.grad is not None
    torch.testing.assert_close(z.grad.full_tensor(), ref_in.grad, rtol=1e-5, atol=1e-5)
    # logits not sharded on the class dim: refused inside the block (as torch refuses them),
    # left to DTensor's own cross_entropy outside it
    y = distribute_tensor(logits, mesh, [Shard(0)])
    t = distribute_tensor(target, mesh, [Shard(0)])
    with hp_tp.loss_parallel(), pytest.raises(ValueError, match=r"loss_parallel\(\) requires"):
        F.cross_entropy(y, t, reduction="sum")
    plain = F.cross_entropy(y, t, reduction="sum")
    torch.testing.assert_close(
        plain.full_tensor(), F.cross_entropy(logits, target, reduction="sum")
    )
    # what loss_parallel does not support is an error, not a silently wrong number
    with hp_tp.loss_parallel():
        with pytest.raises(ValueError, match="label_smoothing"):
            F.cross_entropy(x, target, label_smoothing=1.5)
        with pytest.raises(ValueError, match="class-index targets"):
            F.cross_entropy(x, torch.rand(N, V))
        with pytest.raises(ValueError, match="does not match"):
            F.cross_entropy(x, target[:-1])


def run_two_dim_mesh() -> None:
    """Logits sharded on the batch over "dp" and on the vocabulary over "tp": every reduction,
    including the global mean (which torch's loss_parallel rejects on a 2-D mesh)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(8)
    logits, target = torch.randn(N + 1, V), torch.randint(0, V, (N + 1,))  # uneven rows
    target[2] = IGNORE
    weight = torch.rand(V) + 0.5
    for reduction in ("none", "sum", "mean"):
        for extra in ({}, {"weight": weight, "ignore_index": IGNORE}, {"label_smoothing": 0.1}):
            x = distribute_tensor(logits, mesh, [Shard(0), Shard(1)]).requires_grad_()
            t = distribute_tensor(target, mesh, [Shard(0), Replicate()])
            with hp_tp.loss_parallel():
                loss = F.cross_entropy(x, t, reduction=reduction, **extra)
            ref_in = logits.clone().requires_grad_()
            ref = F.cross_entropy(ref_in, target, reduction=reduction, **extra)
            if reduction == "none":
                assert loss.placements == (Shard(0), Replicate())
                upstream = torch.rand(N + 1) + 0.5
                loss.backward(distribute_tensor(upstream, mesh, loss.placements))
                ref.backward(upstream)
            else:  # a partial sum over "dp", complete over "tp"
                assert loss.placements == (Partial(), Replicate())
                loss.backward()
                ref.backward()
            what = f"{reduction} {sorted(extra)}"
            torch.testing.assert_close(loss.full_tensor(), ref, rtol=1e-5, atol=1e-5, msg=what)
            assert x.grad is not None
            assert ref_in.grad is not None
            torch.testing.assert_close(
                x.grad.full_tensor(), ref_in.grad, rtol=1e-5, atol=1e-5, msg=what
            )
    x = distribute_tensor(logits, mesh, [Shard(0), Shard(1)])
    with hp_tp.loss_parallel(), pytest.raises(ValueError, match="pass the target as a DTensor"):
        F.cross_entropy(x, target)


@distributed(world_size=4)
def test_loss_parallel_on_a_two_dim_mesh() -> None:
    run_two_dim_mesh()


@distributed(world_size=3)
def test_loss_parallel_matches_cross_entropy_and_torch() -> None:
    run_loss_cases()


@distributed(world_size=3)
def test_loss_parallel_module_form_memory_and_errors() -> None:
    run_module_form_and_memory()
