"""Comm interfaces and the fused FSDP path on real gloo collectives, at world size 3.

The strongest oracle here is PyTorch FSDP2 itself: our reduce-scatter copy-in + reduce-scatter +
post-reduce on locally computed gradients must give torch ``fully_shard``'s sharded gradients bit
for bit (fp32, and bf16 params with fp32 reduction), including a ``Shard(1)`` parameter and an
uneven dim 0.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as torch_collectives
from torch.distributed.tensor import Shard

import hp_kernels as hk
from hp_dtensor.testing import distributed, rank_seed

WS = 3


def _rank_data(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Data that differs per rank and that every rank can regenerate for the oracle."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank))


def test_torch_comm_classes_are_accepted() -> None:
    assert isinstance(torch_collectives.DefaultAllGather(), hk.AllGather)
    assert isinstance(torch_collectives.DefaultReduceScatter(), hk.ReduceScatter)
    assert isinstance(torch_collectives.DefaultAllGather(), hk.Comm)
    assert not isinstance(torch_collectives.DefaultAllGather(), hk.ReduceScatter)
    buf = hk.DefaultAllGather().allocate((2, 3), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert buf.shape == (2, 3)
    assert buf.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="abstract"):
        hk.AllReduce()  # type: ignore[abstract]


def test_call_contract_matches_torch_signatures() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_api

    def params(fn: object) -> list[tuple[str, object, object]]:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    for ours, theirs in [
        (hk.Comm.allocate, _fsdp_api.Comm.allocate),
        (hk.AllGather.__call__, _fsdp_api.AllGather.__call__),
        (hk.ReduceScatter.__call__, _fsdp_api.ReduceScatter.__call__),
        (hk.DefaultAllGather.__call__, _fsdp_api.AllGather.__call__),
        (hk.DefaultReduceScatter.__call__, _fsdp_api.ReduceScatter.__call__),
        (hk.Bf16AllToAllReduceScatter.__call__, _fsdp_api.ReduceScatter.__call__),
        (hk.DefaultAllGather.allocate, _fsdp_api.Comm.allocate),
    ]:
        assert params(ours) == params(theirs), (ours, theirs)


@distributed(world_size=WS)
def test_default_comms_match_oracle() -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    inp = _rank_data(rank, (5,))
    ag = hk.DefaultAllGather()
    out = ag.allocate((ws * 5,), dtype=torch.float32, device=inp.device)
    assert ag(out, inp, group) is None
    assert torch.equal(out, torch.cat([_rank_data(r, (5,)) for r in range(ws)]))

    rs_in = _rank_data(rank, (ws * 4,))
    rs_out = torch.empty(4)
    work = hk.DefaultReduceScatter()(rs_out, rs_in, group, dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    work.wait()
    expected = sum(_rank_data(r, (ws * 4,)) for r in range(ws)).view(ws, 4)[rank]
    torch.testing.assert_close(rs_out, expected, rtol=1e-6, atol=1e-6)

    t = _rank_data(rank, (6,))
    hk.DefaultAllReduce()(t, group)
    torch.testing.assert_close(t, sum(_rank_data(r, (6,)) for r in range(ws)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("async_op", [False, True])
@distributed(world_size=WS)
def test_bf16_all_to_all_reduce_scatter_numerics(average: bool, async_op: bool) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    n = 257
    inputs = [_rank_data(r, (ws * n,)) * 100 for r in range(ws)]
    out = torch.full((n,), float("nan"))
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    work = hk.Bf16AllToAllReduceScatter()(out, inputs[rank], group, op, async_op=async_op)
    if async_op:
        assert work is not None
        assert not work.is_completed()
        assert work.wait()
        assert work.is_completed()
    else:
        assert work is None
    # Oracle: each rank's contribution rounded to bf16, summed in fp32 in rank order.
    acc = inputs[0].view(ws, n)[rank].to(torch.bfloat16).float()
    for r in range(1, ws):
        acc = acc + inputs[r].view(ws, n)[rank].to(torch.bfloat16).float()
    if average:
        acc = acc / ws
    assert torch.equal(out, acc)
    # Error bound against the exact fp64 reduction: ws half-ulps of bf16 per input.
    exact = sum(x.double().view(ws, n)[rank] for x in inputs) / (ws if average else 1)
    bound = (
        sum(x.double().view(ws, n)[rank].abs() for x in inputs) * 2.0**-8 / (ws if average else 1)
    )
    assert ((out.double() - exact).abs() <= bound + 1e-6).all()
    # A bf16 reduce-scatter (bf16 partial sums) is no better than ours on this data.
    bf16_out = torch.empty(n, dtype=torch.bfloat16)
    dist.reduce_scatter_single(
        bf16_out, inputs[rank].to(torch.bfloat16), op=dist.ReduceOp.SUM, group=group
    )
    bf16_err = (bf16_out.double() / (ws if average else 1) - exact).abs().mean()
    assert (out.double() - exact).abs().mean() <= bf16_err
    with pytest.raises(ValueError, match="SUM and AVG"):
        hk.Bf16AllToAllReduceScatter()(out, inputs[rank], group, dist.ReduceOp.MAX)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 7)  # weight [7, 6]: Shard(1) (6 % 3 == 0)
        self.mid = nn.Linear(7, 5)  # weight [5, 7]: uneven dim 0 at ws=3
        self.out = nn.Linear(5, 2, bias=False)  # weight [2, 5]: fewer rows than ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.relu(self.inp(x)))))


def _placement(param: nn.Parameter) -> Shard:
    return Shard(1) if param.shape == (7, 6) else Shard(0)


_POLICIES = {
    "fp32": (None, None),
    "bf16-fp32": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float16),
}


@pytest.mark.parametrize("policy", list(_POLICIES))
@distributed(world_size=WS)
def test_fused_fsdp_path_bitwise_equals_torch_fully_shard(policy: str) -> None:
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same model everywhere
    model = _Net()
    replica = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (ws,))
    param_dtype_or_none, reduce_dtype_or_none = _POLICIES[policy]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype_or_none, reduce_dtype=reduce_dtype_or_none)
    fully_shard(model, mesh=mesh, shard_placement_fn=_placement, mp_policy=mp)
    torch.manual_seed(rank_seed(0))  # different data on each rank
    x = torch.randn(4, 6)
    model(x).square().sum().backward()

    # Our path on the unsharded replica: all-gather copy-in/out reconstructs the parameters...
    fsdp_params = model._get_fsdp_state()._fsdp_param_group.fsdp_params  # type: ignore[operator]
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(fp.sharded_param)] for fp in fsdp_params]
    full = dict(replica.named_parameters())
    param_dtype = param_dtype_or_none or torch.float32
    reduce_dtype = reduce_dtype_or_none or torch.float32
    shards, splits, padded_shapes, dims = [], [], [], []
    for name in order:
        p = full[name]
        dim = _placement(p).dim
        chunks = torch.chunk(p.detach(), ws, dim=dim)
        padded = list(chunks[0].shape)
        shards.append(chunks[rank] if rank < len(chunks) else p.new_empty(0))
        splits.append(math.prod(padded))
        padded_shapes.append(padded)
        dims.append(dim)
    ag_inp, ag_out = hk.all_gather_copy_in(shards, splits, ws, rank, param_dtype)
    hk.DefaultAllGather()(ag_out, ag_inp, dist.group.WORLD)
    outs = [torch.empty(ws * s, dtype=param_dtype) for s in splits]
    hk.all_gather_copy_out(ag_out, splits, ws, outs)
    unsharded = {}
    for name, o, padded, dim in zip(order, outs, padded_shapes, dims, strict=True):
        unsharded[name] = hk.unpadded_views(o, padded, full[name].shape, dim, ws)
        assert torch.equal(unsharded[name], full[name].detach().to(param_dtype))

    # ... and the reduce path gives torch FSDP2's sharded gradients bit for bit.
    compute = copy.deepcopy(replica).to(param_dtype)
    compute(x.to(param_dtype)).square().sum().backward()
    grads = [dict(compute.named_parameters())[n].grad for n in order]
    if reduce_dtype == torch.float16:  # torch: SUM with a pre/post division split
        pre, post = hk.gradient_divide_factors(ws, reduce_dtype)
        op = dist.ReduceOp.SUM
    else:  # fp32/bf16: AVG, no extra division
        pre, post, op = None, None, dist.ReduceOp.AVG
    rs_in = hk.reduce_scatter_copy_in(grads, dims, ws, reduce_dtype, predivide_factor=pre)
    rs_out = torch.empty(rs_in.numel() // ws, dtype=reduce_dtype)
    hk.DefaultReduceScatter()(rs_out, rs_in, dist.group.WORLD, op)
    reduced = hk.post_reduce(rs_out, divide_factor=post, out_dtype=torch.float32)
    offset = 0
    for name, fp in zip(order, fsdp_params, strict=True):
        local = fp.sharded_param.grad._local_tensor
        ours = reduced[offset : offset + local.numel()].view(local.shape)
        assert torch.equal(ours, local), (name, (ours - local).abs().max())
        offset += math.prod(fp.padded_sharded_param_size)


@distributed(world_size=WS)
def test_our_reduce_scatters_plug_into_torch_fully_shard() -> None:
    ws = dist.get_world_size()
    torch.manual_seed(0)
    ref = _Net()
    ours = copy.deepcopy(ref)
    low = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (ws,))
    for m in (ref, ours, low):
        fully_shard(m, mesh=mesh)
    calls = []

    class _Spy(hk.DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
            calls.append(input_tensor.numel())
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    ours.set_custom_reduce_scatter(_Spy())
    low.set_custom_reduce_scatter(hk.Bf16AllToAllReduceScatter())
    torch.manual_seed(rank_seed(1))
    x = torch.randn(4, 6)
    for m in (ref, ours, low):
        m(x).sum().backward()
    shapes = [p.shape for p in _Net().parameters()]
    assert calls == [hk.reduce_scatter_numel(shapes, [0] * len(shapes), ws)]
    params = zip(ref.named_parameters(), ours.named_parameters(), low.parameters(), strict=True)
    differs = False
    for (n, a), (_, b), c in params:
        assert torch.equal(a.grad.to_local(), b.grad.to_local()), n
        # bf16 on the wire (AVG over ranks): within bf16 rounding of the fp32 reduction.
        torch.testing.assert_close(c.grad.to_local(), a.grad.to_local(), rtol=2**-7, atol=1e-3)
        differs = differs or not torch.equal(c.grad.to_local(), a.grad.to_local())
    assert differs  # it really communicated in bf16
