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
