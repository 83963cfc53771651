"""The combine's backward all-to-all overlapped with the shared experts' backward.

With ``overlap_backward`` the backward all-to-all of the combine is issued asynchronously, the
shared experts' backward runs, and only then is the all-to-all waited for (before the experts'
backward reads its result). Observed: the order of issue, wait and the shared experts' backward,
recorded by spies on ``all_to_all_single`` and the module's hooks; and the numbers: gradients
equal to the blocking path's, plain and de-duplicating dispatchers, EP 2 and 3.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hp_cp_ep import BackwardOverlap, ExpertParallel, MoE, MoEArgs, TokenDispatcher
from hp_dtensor.testing import count_host_syncs, distributed

DIM, HIDDEN, TOKENS = 16, 32, 12
EXACT: dict[str, Any] = {"rtol": 1e-6, "atol": 1e-6}


def _moe(num_experts: int, **overrides: Any) -> MoE:
    torch.manual_seed(0)
    options: dict[str, Any] = {
        "num_experts": num_experts,
        "top_k": 2,
        "num_shared_experts": 1,
        "score_before_experts": False,
    }
    options.update(overrides)
    return MoE(MoEArgs(**options), DIM, HIDDEN)


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + rank)
    return torch.randn(TOKENS, DIM, generator=gen), torch.randn(TOKENS, DIM, generator=gen)


class _RecordedWork:
    def __init__(self, work: Any, events: list[str]) -> None:
        self._work, self._events = work, events

    def wait(self) -> Any:
        self._events.append("wait tokens")
        return self._work.wait()


def _recorded_step(moe: MoE, x: torch.Tensor, target: torch.Tensor) -> tuple[list[str], int]:
    """(events, index where the backward starts) of one forward and backward."""
    events: list[str] = []
    real = dist.all_to_all_single

    def spy(output: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if inp.dtype.is_floating_point:
            events.append(("async" if kwargs.get("async_op") else "sync") + " tokens")
        work = real(output, inp, *args, **kwargs)
        return _RecordedWork(work, events) if work is not None else None

    assert moe.shared_experts is not None
    hooks = [
        moe.shared_experts.register_forward_hook(lambda *_: events.append("shared forward")),
        moe.shared_experts.register_full_backward_hook(lambda *_: events.append("shared backward")),
    ]
    dist.all_to_all_single = spy  # type: ignore[assignment]
    try:
        out = moe(x.clone().requires_grad_())
        start = len(events)
        (out * target).sum().backward()
    finally:
        dist.all_to_all_single = real
        for hook in hooks:
            hook.remove()
    return events, start


def _grads(moe: MoE) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in moe.named_parameters():
        grad = param.grad
        assert grad is not None, name
        out[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return out


def _compare(num_experts: int, dedup: bool) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    blocking, overlapped = _moe(num_experts), _moe(num_experts)
    parallelize_module(blocking.experts, mesh, ExpertParallel(dedup=dedup))
    parallelize_module(overlapped.experts, mesh, ExpertParallel(dedup=dedup, overlap_backward=True))
    x, target = _batch(rank)
    blocking_events, start = _recorded_step(blocking, x, target)
    events, start = _recorded_step(overlapped, x, target)
    # the blocking path: the combine's backward all-to-all completes before anything else runs
    assert blocking_events[start:] == ["sync tokens", "shared backward", "sync tokens"], (
        blocking_events
    )
    assert events[:start] == blocking_events[:start]  # the forward is unchanged
    for name, grad in _grads(overlapped).items():
        torch.testing.assert_close(grad, _grads(blocking)[name], **EXACT, msg=name)
    return events[start:]


@distributed(world_size=2)
def test_combine_backward_issued_before_shared_backward_ep2() -> None:
    for dedup in (False, True):
        backward = _compare(4, dedup)
        # issued, the shared experts' backward runs, then the wait, then the dispatch's backward
        assert backward == ["async tokens", "shared backward", "wait tokens", "sync tokens"], (
            dedup,
            backward,
        )


@distributed(world_size=3)
def test_overlapped_backward_ep3_equals_blocking_and_adds_no_sync() -> None:
    backward = _compare(6, dedup=False)
    assert backward == ["async tokens", "shared backward", "wait tokens", "sync tokens"]
    mesh = init_device_mesh("cpu", (3,))
    moe = _moe(6)
    parallelize_module(moe.experts, mesh, ExpertParallel(overlap_backward=True))
    x, target = _batch(dist.get_rank())
    (moe(x) * target).sum().backward()
    with count_host_syncs() as forward:
        out = moe(x)
    with count_host_syncs() as backward_syncs:
        (out * target).sum().backward()
    assert (forward.total, backward_syncs.total) == (1, 0)


def test_overlap_on_one_device_and_errors() -> None:
    reference = _moe(4)
    moe = copy.deepcopy(reference)
    moe.experts.token_dispatcher = TokenDispatcher(4, overlap_backward=True)
    x, target = _batch(0)
    (moe(x) * target).sum().backward()
    (reference(x) * target).sum().backward()
    for name, param in moe.named_parameters():
        torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, **EXACT)
    with torch.no_grad():  # no graph: the shared experts run as usual
        torch.testing.assert_close(moe(x), reference(x), **EXACT)
    branch = BackwardOverlap(x, torch.nn.Identity())
    torch.testing.assert_close(branch.output, x)
    with pytest.raises(TypeError, match="overlap_backward must be a bool"):
        TokenDispatcher(4, overlap_backward="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="overlap_backward must be a bool"):
        ExpertParallel(overlap_backward=None)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# composition: de-duplicated dispatch + overlapped backward under EP 2 x FSDP 2
# ------------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe_enabled = True
        self.norm = torch.nn.RMSNorm(DIM)
        self.moe = _moe(4, load_balance_coeff=0.05, route_norm=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.moe(self.norm(x))
        return out


class _Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.tok_embeddings = torch.nn.Embedding(32, DIM)
        self.layers = torch.nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.lm_head = torch.nn.Linear(DIM, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x)
        out: torch.Tensor = self.lm_head(x)
        return out


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank + 7 * step)
    tokens = torch.randint(0, 32, (2, 9), generator=gen)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))


@distributed(world_size=4)
def test_dedup_overlap_decoder_ep2_fsdp2_trains_like_one_process() -> None:
    from torch.distributed.tensor import Shard

    import hp_fsdp
    from hp_cp_ep import update_expert_bias

    rank, world = dist.get_rank(), dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)][rank]
    reference = _Decoder()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp_mesh = mesh._flatten("dp")
    expert_info = hp_fsdp.FSDPMeshInfo(mesh["efsdp"], shard_mesh_dim=0)
    blocks: list[Any] = list(model.layers.values())
    for block in blocks:
        style = ExpertParallel(dedup=True, overlap_backward=True)
        parallelize_module(block.moe.experts, mesh["ep"], style)
        experts = set(block.moe.experts.parameters())

        def placement(param: torch.nn.Parameter, experts: set[Any] = experts) -> Any:
            return hp_fsdp.ShardPlacementResult(Shard(0), expert_info) if param in experts else None

        hp_fsdp.fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement)
    hp_fsdp.fully_shard(model, mesh=dp_mesh)
    for module in model.modules():  # the losses are summed over ranks: sum the gradients
        if isinstance(module, hp_fsdp.FSDPModule):
            module.set_gradient_divide_factor(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        opt.zero_grad()
        loss = _loss(model, rank, step)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        update_expert_bias(model, dist.group.WORLD)
        ref_opt.zero_grad()
        ref_losses = [_loss(reference, r, step) for r in range(world)]
        torch.stack(ref_losses).sum().backward()  # type: ignore[no-untyped-call]
        ref_opt.step()
        update_expert_bias(reference, own)
        torch.testing.assert_close(loss.detach(), ref_losses[rank].detach(), rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        torch.testing.assert_close(
            param.full_tensor(), reference.get_parameter(name), rtol=1e-5, atol=1e-5, msg=name
        )
