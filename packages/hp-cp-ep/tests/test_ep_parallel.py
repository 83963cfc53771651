"""Expert parallelism on gloo: EP 2/3/4, EP 2 x TP 2, TP for experts, bias, EP 2 x FSDP 2.

Oracle everywhere: the single-device :class:`MoE` run in each worker on the same tokens. Every
rank routes *different* tokens (seeded per rank; all ranks can rebuild every rank's batch), the
gate is skewed so expert 0 takes most choices and the last expert none. Under EP, expert
gradients gather contributions from every rank's tokens, so the oracle's expert gradients are
the sum over ranks of per-batch gradients, while router and shared-expert gradients are the
rank's own.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

import hp_fsdp
import hp_tp
from hp_cp_ep import (
    ExpertParallel,
    ExpertTensorParallel,
    MoE,
    MoEArgs,
    TensorParallel,
    TokenDispatcher,
    all_to_all_tokens,
    update_expert_bias,
)
from hp_dtensor.testing import distributed
from hp_kernels import permute_tokens

DIM, HIDDEN, TOKENS = 16, 32, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _skewed_moe(num_experts: int, **overrides: Any) -> MoE:
    """Same weights on every rank; expert 0 takes most choices, the last expert none."""
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": 2,
        "num_shared_experts": 1,
        "score_before_experts": False,
        "route_norm": True,
    }
    options.update(overrides)
    moe = MoE(MoEArgs(**options), DIM, HIDDEN)
    with torch.no_grad():
        gate = moe.router.gate.weight
        gate[0] = gate[0].abs() + 0.5
        gate[-1] = -gate[-1].abs() - 0.5
    return moe


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens (positive, so the skew is deterministic) and output weights."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.rand(TOKENS, DIM, generator=gen), torch.randn(TOKENS, DIM, generator=gen)


def _grads(moe: MoE, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    moe.zero_grad()
    out = moe(x)
    (out * target).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in moe.named_parameters()}


def _check_against_oracle(
    moe: MoE, reference: MoE, batch_of: list[int], my_batch: int, out: torch.Tensor
) -> None:
    """``moe`` ran ``my_batch``; the experts saw ``batch_of`` (one entry per contributing rank)."""
    per_batch = {b: _grads(reference, *_batch(b)) for b in sorted(set(batch_of))}
    torch.testing.assert_close(out, per_batch[my_batch][0], **TOL)
    routed = torch.stack([reference.router(_batch(b)[0])[2] for b in batch_of]).sum(0)
    assert routed[0] == routed.max()  # uneven routing: expert 0 takes the most choices
    assert routed[-1] == 0  # ... and the last expert none
    for name, param in moe.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        if name.startswith("experts."):
            expected = sum(per_batch[b][1][name] for b in batch_of)
        else:
            expected = per_batch[my_batch][1][name]
        torch.testing.assert_close(grad, expected, **TOL, msg=name)


def _ep_parity(num_experts: int, **overrides: Any) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _skewed_moe(num_experts, **overrides)
    moe = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch_parallelize_module(moe.experts, mesh, ExpertParallel())  # torch's entry point
    w1 = moe.experts.w1
    assert isinstance(w1, DTensor)
    assert w1.placements == (Shard(0),)
    assert w1.to_local().shape[0] == num_experts // world
    x, target = _batch(rank)
    copied = copy.deepcopy(moe)  # shares the process groups
    out = moe(x)
    (out * target).sum().backward()
    torch.testing.assert_close(moe.tokens_per_expert, reference.router(x)[2].float())
    torch.testing.assert_close(copied(x), out, rtol=0, atol=0)
    _check_against_oracle(moe, reference, list(range(world)), rank, out.detach())
    # called directly (as TorchTitan's MoE does), the experts dispatch and combine themselves
    rows, _, counts = permute_tokens(x, reference.router(x)[1], num_experts)
    torch.testing.assert_close(moe.experts(rows, counts), reference.experts(rows, counts), **TOL)


@distributed(world_size=2)
def test_expert_parallel_matches_single_device_ep2() -> None:
    _ep_parity(4)
    # score applied before the experts, softmax, dropping at capacity: still exact
    _ep_parity(4, score_before_experts=True, score_func="softmax", capacity_factor=1.0)


@distributed(world_size=3)
def test_expert_parallel_matches_single_device_ep3() -> None:
    _ep_parity(6, num_shared_experts=0, use_grouped_mm=False)


@distributed(world_size=4)
def test_expert_parallel_matches_single_device_ep4() -> None:
    _ep_parity(8, top_k=3)


@distributed(world_size=4)
def test_expert_tensor_parallel_ep2_tp2_matches_single_device() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep_rank = mesh.get_local_rank("ep")
    reference = _skewed_moe(4)
    moe = copy.deepcopy(reference)
    # hp-tp's parallelize_module takes the torch-protocol style and its 2-D mesh
    hp_tp.parallelize_module(moe, mesh, {"experts": ExpertTensorParallel()})
    assert moe.experts.w1.placements == (Shard(0), Shard(1))
    assert moe.experts.w2.placements == (Shard(0), Shard(2))
    assert moe.experts.w1.to_local().shape == (2, HIDDEN // 2, DIM)
    x, target = _batch(ep_rank)  # tensor-parallel ranks share their tokens
    out = moe(x)
    (out * target).sum().backward()
    _check_against_oracle(moe, reference, [0, 1], ep_rank, out.detach())


@distributed(world_size=2)
def test_tensor_parallel_experts_without_ep() -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    reference = _skewed_moe(4)
    moe = copy.deepcopy(reference)
    hp_tp.parallelize_module(moe.experts, mesh, TensorParallel())
    assert moe.experts.w3.placements == (Shard(1),)
    x, target = _batch(0)
    out = moe(x)
    (out * target).sum().backward()
    _check_against_oracle(moe, reference, [0], 0, out.detach())


# ------------------------------------------------------------------------------------------
# overlap, splits, errors
# ------------------------------------------------------------------------------------------


class _RecordedWork:
    def __init__(self, work: Any, events: list[str], name: str) -> None:
        self._work, self._events, self._name = work, events, name

    def wait(self) -> Any:
        self._events.append(f"wait {self._name}")
        return self._work.wait()


@distributed(world_size=2)
def test_dispatch_overlaps_shared_experts_and_errors_are_collective() -> None:
    rank = dist.get_rank()
    moe = _skewed_moe(4)
    mesh = init_device_mesh("cpu", (2,))
    torch_parallelize_module(moe.experts, mesh, ExpertParallel())
    events: list[str] = []
    real = dist.all_to_all_single

    def spy(output: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        kind = "tokens" if inp.dtype.is_floating_point else "counts"
        mode = "async" if kwargs.get("async_op") else "sync"
        events.append(f"{mode} {kind}")
        work = real(output, inp, *args, **kwargs)
        return _RecordedWork(work, events, kind) if work is not None else None

    assert moe.shared_experts is not None
    moe.shared_experts.register_forward_hook(lambda *_: events.append("shared experts"))
    dist.all_to_all_single = spy  # type: ignore[assignment]
    try:
        out = moe(_batch(rank)[0].requires_grad_())
        forward_events = list(events)
        out.sum().backward()
    finally:
        dist.all_to_all_single = real
    # split sizes first (sync), tokens issued async, shared experts run, then the wait, combine
    assert forward_events == [
        "sync counts",
        "async tokens",
        "shared experts",
        "wait tokens",
        "sync tokens",
    ]
    # backward: the combine's then the dispatch's all-to-all (splits swapped)
    assert events[len(forward_events) :] == ["sync tokens", "sync tokens"]

    # all_to_all_tokens: exchanged splits, verified splits, and a rank that disagrees
    rows = torch.arange(6.0).view(3, 2) + 10 * rank
    rows.requires_grad_()
    splits = [1, 2] if rank == 0 else [2, 1]
    got = all_to_all_tokens(rows, splits)
    expected_rows = {0: [[0, 1], [10, 11], [12, 13]], 1: [[2, 3], [4, 5], [14, 15]]}[rank]
    assert got.tolist() == expected_rows
    (got * (rank + 1)).sum().backward()
    assert rows.grad is not None
    assert rows.grad[:, 0].tolist() == ([1.0, 2.0, 2.0] if rank == 0 else [1.0, 1.0, 2.0])
    wrong = [3, 0] if rank == 1 else [1, 2]  # rank 1 expects rows nobody sends
    with pytest.raises(ValueError, match=r"inconsistent on ranks \[1\]"):
        all_to_all_tokens(rows.detach(), splits, wrong)
    with pytest.raises(ValueError, match=r"inconsistent on ranks \[0\]"):
        all_to_all_tokens(rows.detach(), [5, 5] if rank == 0 else splits)
    # ranks built with different expert counts fail together, before any token moves
    dispatcher = TokenDispatcher(2 if rank == 0 else 1, ep_group=mesh.get_group())
    counts = torch.ones(4 if rank == 0 else 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"disagree on \(local experts, hidden size\)"):
        dispatcher.dispatch(torch.randn(int(counts.sum()), DIM), counts)
    # bad input, named
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by the degree 3"):
        ExpertParallel()._apply(_skewed_moe(4).experts, _FakeMesh(3))
    with pytest.raises(TypeError, match="GroupedExperts-like"):
        torch_parallelize_module(nn.Linear(2, 2), mesh, ExpertParallel())
    with pytest.raises(ValueError, match="needs a 2-D"):
        torch_parallelize_module(_skewed_moe(4).experts, mesh, ExpertTensorParallel())


class _FakeMesh:
    """Enough of a 1-D mesh for the style's checks, which run before any communication."""

    ndim = 1

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self, dim: int = 0) -> int:
        return self._size


# ------------------------------------------------------------------------------------------
# training: auxiliary-loss-free bias under EP, and EP 2 x FSDP 2
# ------------------------------------------------------------------------------------------


def _own_group() -> dist.ProcessGroup:
    """A one-rank group (so the in-worker single-process oracle reduces nothing)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


@distributed(world_size=2)
def test_expert_bias_identical_on_replicas_and_equal_to_single_process() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    own = _own_group()
    reference = _skewed_moe(4, load_balance_coeff=0.05)
    moe = copy.deepcopy(reference)
    torch_parallelize_module(moe.experts, init_device_mesh("cpu", (world,)), ExpertParallel())
    opt = torch.optim.SGD(moe.parameters(), lr=0.2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2)
    for step in range(3):
        x, target = _batch(rank + 10 * step)
        opt.zero_grad()
        (moe(x) * target).sum().backward()
        for name, param in moe.named_parameters():  # data parallel: sum replicated grads
            if not name.startswith("experts."):
                dist.all_reduce(param.grad)
        opt.step()
        loads = update_expert_bias(moe, dist.group.WORLD)
        ref_opt.zero_grad()
        for r in range(world):
            xr, tr = _batch(r + 10 * step)
            (reference(xr) * tr).sum().backward()
        ref_opt.step()
        ref_loads = update_expert_bias(reference, own)
        assert torch.equal(loads[""].tokens_per_expert, ref_loads[""].tokens_per_expert)
    assert moe.expert_bias is not None
    assert reference.expert_bias is not None
    assert moe.expert_bias.abs().sum() > 0
    biases = [torch.empty_like(moe.expert_bias) for _ in range(world)]
    dist.all_gather(biases, moe.expert_bias)
    assert all(torch.equal(b, biases[0]) for b in biases)
    torch.testing.assert_close(moe.expert_bias, reference.expert_bias, rtol=0, atol=1e-7)
    for name, param in moe.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        torch.testing.assert_close(value, reference.get_parameter(name), **TOL, msg=name)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe_enabled = True
        self.norm = nn.RMSNorm(DIM)
        self.moe = _skewed_moe(4, load_balance_coeff=0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class _Decoder(nn.Module):
    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.tok_embeddings = nn.Embedding(vocab, DIM)
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.lm_head(self.norm(x))


def _tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(rank + 7 * step))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@distributed(world_size=4)
def test_moe_decoder_ep2_fsdp2_trains_like_one_process() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    own = _own_group()
    reference = _Decoder()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp_mesh = mesh._flatten("dp")
    expert_info = hp_fsdp.FSDPMeshInfo(mesh["efsdp"], shard_mesh_dim=0)
    for block in model.layers.values():
        torch_parallelize_module(block.moe.experts, mesh["ep"], ExpertParallel())
        expert_params = set(block.moe.experts.parameters())

        def placement(param: nn.Parameter, experts: set[Any] = expert_params) -> Any:
            return hp_fsdp.ShardPlacementResult(Shard(0), expert_info) if param in experts else None

        hp_fsdp.fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement)
    hp_fsdp.fully_shard(model, mesh=dp_mesh)
    for module in model.modules():  # the losses are summed over ranks: sum the gradients
        if isinstance(module, hp_fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)
    w1 = model.layers["0"].moe.experts.w1
    assert w1.device_mesh.mesh_dim_names == ("efsdp", "ep")
    assert w1.to_local().shape == (1, HIDDEN, DIM)  # 4 experts / ep 2 / efsdp 2
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        loss = _loss(model, _tokens(rank, step))
        loss.backward()
        opt.step()
        update_expert_bias(model, dist.group.WORLD)
        ref_opt.zero_grad()
        ref_losses = [_loss(reference, _tokens(r, step)) for r in range(world)]
        torch.stack(ref_losses).sum().backward()
        ref_opt.step()
        update_expert_bias(reference, own)
        torch.testing.assert_close(loss.detach(), ref_losses[rank].detach(), **TOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), reference.get_parameter(name), **TOL, msg=name
        )
    for name, buffer in reference.named_buffers():
        if name.endswith("expert_bias"):
            assert buffer.abs().sum() > 0
            torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=1e-7)
