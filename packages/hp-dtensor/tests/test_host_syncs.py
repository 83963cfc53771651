"""The host-sync counter: each synchronizing op counted once, at its site; nothing else counted."""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hp_dtensor import init_device_mesh
from hp_dtensor.testing import (
    HostSyncCounter,
    count_host_syncs,
    distributed,
    rank_seed,
)

_X = torch.arange(6)
_MASK = _X > 2
COPY = "copy_d2h"
_SCRATCH = _X.clone()


def _here(offset: int = 0) -> str:
    """The site string of the caller's line (plus ``offset`` lines)."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return f"{os.path.relpath(__file__)}:{frame.f_back.f_lineno + offset}"


# Each case: (name, expected op, a function whose first line of body is the synchronizing call).
def _item() -> None:
    _X[0].item()


def _int() -> None:
    int(_X[1])


def _float() -> None:
    float(_X[1])


def _bool() -> None:
    bool(_X[1])


def _if_tensor() -> None:
    if _X[2]:
        pass


def _tolist() -> None:
    _X.tolist()


def _nonzero() -> None:
    _X.nonzero()


def _where_one_arg() -> None:
    torch.where(_MASK)


def _argwhere() -> None:
    torch.argwhere(_MASK)


def _masked_select() -> None:
    _X.masked_select(_MASK)


def _unique() -> None:
    torch.unique(_X)


def _unique_consecutive() -> None:
    torch.unique_consecutive(_X)


def _repeat_interleave() -> None:
    torch.repeat_interleave(_X, _X)


def _repeat_interleave_self() -> None:
    _X.repeat_interleave(_X, dim=0)


def _bool_mask_index() -> None:
    _X[_MASK]


def _bool_mask_assign() -> None:
    _SCRATCH[_MASK] = 0


def _equal() -> None:
    torch.equal(_X, _X)


def _bincount() -> None:
    torch.bincount(_X)


def _cpu_copy() -> None:
    _X.cpu()


def _tensor_from_list() -> None:
    torch.tensor([1, 2, 3])


def _tensor_from_scalar() -> None:
    torch.tensor(3.0)


def _as_tensor() -> None:
    torch.as_tensor([1, 2])


def _asarray() -> None:
    torch.asarray([1, 2])


def _new_tensor() -> None:
    _X.new_tensor([4, 5])


_CASES: list[tuple[Callable[[], None], str]] = [
    (_item, "aten._local_scalar_dense"),
    (_int, "aten._local_scalar_dense"),
    (_float, "aten._local_scalar_dense"),
    (_bool, "aten._local_scalar_dense"),
    (_if_tensor, "aten._local_scalar_dense"),
    (_tolist, "tolist"),
    (_nonzero, "aten.nonzero"),
    (_where_one_arg, "aten.nonzero"),
    (_argwhere, "aten.nonzero"),
    (_masked_select, "aten.masked_select"),
    (_unique, "aten.unique"),
    (_unique_consecutive, "aten.unique"),
    (_repeat_interleave, "aten.repeat_interleave"),
    (_repeat_interleave_self, "aten.repeat_interleave"),
    (_bool_mask_index, "aten.index[bool]"),
    (_bool_mask_assign, "aten.index_put[bool]"),
    (_equal, "aten.equal"),
    (_bincount, "aten.bincount"),
    (_cpu_copy, "copy_d2h"),
    (_tensor_from_list, "tensor_from_python"),
    (_tensor_from_scalar, "tensor_from_python"),
    (_as_tensor, "tensor_from_python"),
    (_asarray, "tensor_from_python"),
    (_new_tensor, "tensor_from_python"),
]


@pytest.mark.parametrize(("fn", "op"), _CASES, ids=[fn.__name__ for fn, _ in _CASES])
def test_each_synchronizing_op_counts_once_at_its_site(fn: Callable[[], None], op: str) -> None:
    with count_host_syncs() as syncs:
        fn()
    line = inspect.getsourcelines(fn)[1] + 1  # the body's first line
    site = f"{os.path.relpath(__file__)}:{line}"
    assert isinstance(syncs, HostSyncCounter)
    assert syncs.total == 1, syncs.summary()
    assert syncs.by_op == {op: 1}
    assert syncs.by_site == {site: 1}
    assert syncs.events == [(op, site)]


def test_nothing_on_matmul_linear_and_mlp_forward_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x, target = torch.randn(5, 8), torch.randint(0, 4, (5,))
    a, b = torch.randn(5, 4), torch.randn(4, 3)
    total = int(_X.sum())
    ok = torch.tensor(True)
    with count_host_syncs() as syncs:
        a @ b
        torch.nn.functional.linear(a, b.t())
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        torch.repeat_interleave(_X, _X, output_size=total)
        _X.repeat_interleave(2)
        torch.nonzero_static(_MASK, size=3)
        torch._assert_async(ok)
        x.to("cpu")  # a CPU tensor to its own device: no copy
        torch.as_tensor(x)  # a tensor: no Python data
        torch.tensor(1.0, device="cpu")  # a host tensor by intent (torch.optim does this)
    assert syncs.total == 0, syncs.summary()
    assert all(p.grad is not None for p in model.parameters())


def test_backward_ops_are_counted_at_their_sites() -> None:
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, a: torch.Tensor) -> torch.Tensor:
            return a * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            grad.sum().item()
            return grad * 2

    backward_line = inspect.getsourcelines(ReadsInBackward.backward)[1] + 2
    x = torch.randn(6, requires_grad=True)
    picked = x[_MASK]  # forward: one boolean-mask index, outside the region
    out = ReadsInBackward.apply(picked).sum()
    with count_host_syncs() as syncs:
        site = _here(1)
        out.backward()
    # index's backward scatters through the same boolean mask (a sync on a GPU), and the custom
    # backward reads a scalar.
    assert syncs.by_op == {"aten.index_put[bool]": 1, "aten._local_scalar_dense": 1}
    assert syncs.by_site == {
        site: 1,
        f"{os.path.relpath(__file__)}:{backward_line}": 1,
    }
    assert x.grad is not None


def test_a_region_entered_on_another_thread_counts_that_threads_backward() -> None:
    results: list[HostSyncCounter] = []
    seen_outside: list[HostSyncCounter] = []

    def work() -> None:
        x = torch.randn(6, requires_grad=True)
        with count_host_syncs() as syncs:
            y = x.repeat_interleave(_X, dim=0)  # one sync forward; backward sums, no sync
            y.sum().backward()
            int(x.grad.sum())  # type: ignore[union-attr]
        results.append(syncs)

    with count_host_syncs() as outer:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    seen_outside.append(outer)
    assert results[0].by_op == {"aten.repeat_interleave": 1, "aten._local_scalar_dense": 1}
    # Modes are per thread: the main thread's region does not see the other thread's work.
    assert seen_outside[0].total == 0


def _nonzero_rows_kernel(x: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, (x.sum(1) != 0).nonzero().flatten())


_nonzero_rows = torch.library.custom_op("hp_dtensor_tests::nonzero_rows", mutates_args=())(
    _nonzero_rows_kernel
)


def test_ops_inside_custom_ops_are_counted() -> None:
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]])
    kernel_line = inspect.getsourcelines(_nonzero_rows_kernel)[1] + 1
    with count_host_syncs() as syncs:
        out = _nonzero_rows(x)
    assert syncs.events == [("aten.nonzero", f"{os.path.relpath(__file__)}:{kernel_line}")]
    assert out.tolist() == [[1.0, 2.0], [3.0, 0.0]]


def test_nested_regions_both_count() -> None:
    with count_host_syncs() as outer:
        _X[0].item()
        with count_host_syncs() as inner:
            _X.nonzero()
    assert outer.by_op == {"aten._local_scalar_dense": 1, "aten.nonzero": 1}
    assert inner.by_op == {"aten.nonzero": 1}


def test_device_tensors_predicate_and_host_tensors_decide_what_counts() -> None:
    host_scalar = torch.tensor(3)
    device = torch.arange(4)
    with count_host_syncs(device_tensors=lambda t: t is not host_scalar) as syncs:
        host_scalar.item()  # declared host: reading it does not sync
        device[0].item()
        host_scalar.copy_(device[1])  # into a host tensor: a device-to-host copy
    assert syncs.by_op == {"aten._local_scalar_dense": 1, COPY: 1}

    with count_host_syncs(host_tensors=[host_scalar]) as exempt:
        host_scalar.item()
        host_scalar.tolist()
    assert exempt.total == 0


def test_optimizer_step_counters_are_host_reads_unless_exempted() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # creates the state
    steps = [state["step"] for state in opt.state.values()]
    with count_host_syncs() as plain:
        opt.step()
    with count_host_syncs(host_tensors=steps) as exempt:
        opt.step()
    assert plain.total > 0
    assert set(plain.by_op) == {"aten._local_scalar_dense"}
    assert exempt.total == 0, exempt.summary()


def test_assert_at_most_lists_every_event_and_its_site() -> None:
    with count_host_syncs() as syncs:
        site = _here(1)
        _X[0].item(), _X.nonzero()
    syncs.assert_at_most(2)
    with pytest.raises(AssertionError, match=r"one step: 2 host synchronizations, budget 1") as err:
        syncs.assert_at_most(1, what="one step")
    assert f"aten._local_scalar_dense at {site}" in str(err.value)
    assert f"aten.nonzero at {site}" in str(err.value)
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        syncs.assert_at_most(-1)
    assert "total=2" in repr(syncs)


def test_bad_arguments_are_type_errors() -> None:
    with (
        pytest.raises(TypeError, match="device_tensors must be a callable"),
        count_host_syncs(device_tensors=True),  # type: ignore[arg-type]
    ):
        pass
    with (
        pytest.raises(TypeError, match="host_tensors must hold tensors, got int"),
        count_host_syncs(host_tensors=[1]),  # type: ignore[list-item]
    ):
        pass


def _collectives_and_dtensor_ops() -> tuple[int, dict[str, int], int]:
    rank = dist.get_rank()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(rank_seed(0))
    local = torch.randn(4, 3)
    full = torch.randn(2 * world + 1, 3)  # uneven shards
    out = torch.empty(world * 4, 3)
    with count_host_syncs() as quiet:
        summed = local.clone()
        dist.all_reduce(summed)
        dist.all_gather_into_tensor(out, local)
        dt = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=0)
        back = dt.redistribute(mesh, [Replicate()]).to_local()
        (dt * 2).sum()
    assert torch.equal(back, full) or rank != 0  # rank 0's data is the source
    with count_host_syncs() as loud:
        summed.sum().item()
        dist.all_gather_object([None] * world, {"rank": rank})
    return quiet.total, dict(loud.by_op), loud.by_op["aten._local_scalar_dense"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_inside_the_distributed_harness_each_rank_counts_its_own(world_size: int) -> None:
    from hp_dtensor.testing import run_distributed

    results = run_distributed(_collectives_and_dtensor_ops, world_size)
    for quiet, loud, items in results:
        assert quiet == 0
        # .item() once, plus the object collective's own size reads and host tensors.
        assert items >= 1, loud
        assert sum(loud.values()) > 1, loud


@distributed(world_size=2)
def test_distributed_decorator_counts_backward_on_each_rank() -> None:
    torch.manual_seed(rank_seed(1))
    x = torch.randn(6, requires_grad=True)
    with count_host_syncs() as syncs:
        y = x[_MASK].sum()
        dist.all_reduce(y.detach())
        y.backward()
    assert syncs.by_op == {"aten.index[bool]": 1, "aten.index_put[bool]": 1}
