"""Drop-in, round 2: behaviours PyTorch's own FSDP2 tests rely on, checked against torch.

- the reduce-scatter writes into its input only on backends that promise it (NCCL, gloo); on
  torch's threaded test group every rank's gradients equal torch's;
- a member of a list-of-modules unit used on its own after a forward that skipped it has its
  gradients reduced in that backward;
- ``set_all_reduce_hook(stream=...)``, a 3-D mesh and a scalar parameter: torch's messages and
  torch's acceptance of a CPU stream;
- a forward without backward between steps leaves exactly what torch leaves.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hp_fsdp
from hp_dtensor.testing import distributed, fake_world, load_test_module
from hp_fsdp.collectives import issue_reduce_scatter, reduce_scatter_in_place

_CASES = Path(__file__).with_name("_threaded_pg_cases.py")


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


def _threaded(case: str, world_size: int) -> dict[str, Any]:
    """Run a case of ``_threaded_pg_cases.py`` in a fresh interpreter; its per-rank results."""
    done = subprocess.run(
        [sys.executable, str(_CASES), case, str(world_size)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for rank, result in results.items():
        assert "error" not in result, f"rank {rank}: {result['error']}"
    return results


# ---------------------------------------------------------------- item 7: in-place reduce-scatter
def test_threaded_test_group_gets_torch_gradients_on_every_rank() -> None:
    """On torch's threaded group an in-place reduce-scatter let rank 0's output overwrite the
    others' inputs: ranks 1 and 2 got wrong gradients. Out of place there, every rank's
    gradients equal torch's bitwise (ws 3, different data per rank)."""
    results = _threaded("reduce_scatter", 3)
    assert sorted(results) == ["0", "1", "2"]
    for rank, result in results.items():
        assert result["in_place"] is False, rank
        assert all(result["equal"]), (rank, result["equal"])


def test_in_place_only_for_nccl_and_gloo() -> None:
    with fake_world(2, rank=0):
        assert reduce_scatter_in_place(dist.group.WORLD, torch.device("cpu")) is False


@distributed(world_size=3, timeout=120)
def test_gloo_reduce_scatter_is_in_place_and_correct() -> None:
    """gloo (verified): the output is this rank's row of the input, and holds the sum."""
    rank = dist.get_rank()
    group = dist.group.WORLD
    assert reduce_scatter_in_place(group, torch.device("cpu"))
    grads = [torch.arange(12, dtype=torch.float32).view(6, 2) * (rank + 1)]
    expected = torch.arange(12, dtype=torch.float32).view(6, 2) * 6  # 1 + 2 + 3
    rs_input, rs_output, work = issue_reduce_scatter(
        grads, [0], torch.float32, group, 3, dist.ReduceOp.SUM, None
    )
    assert work is not None
    work.wait()
    assert rs_output.untyped_storage().data_ptr() == rs_input.untyped_storage().data_ptr()
    assert torch.equal(rs_output, expected[2 * rank : 2 * rank + 2].reshape(-1))
    grads = [torch.arange(12, dtype=torch.float32).view(6, 2) * (rank + 1)]
    rs_input, rs_output, work = issue_reduce_scatter(
        grads, [0], torch.float32, group, 3, dist.ReduceOp.SUM, None, in_place=False
    )
    assert work is not None
    work.wait()
    assert rs_output.untyped_storage().data_ptr() != rs_input.untyped_storage().data_ptr()
    assert torch.equal(rs_output, expected[2 * rank : 2 * rank + 2].reshape(-1))


# ---------------------------------------------------------------- item 8: partial list unit
class _ChunkedLM(nn.Module):
    """The forward stops before ``head`` (a chunked loss applies it outside)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x))


def _partial_unit_grads(api: Any, mode: str, mesh: Any, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _ChunkedLM()
    api.fully_shard(model.body, mesh=mesh)
    api.fully_shard([model.norm, model.head], mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank + 1))
    grads: list[dict[str, Any]] = []
    for _ in range(2):  # the second iteration starts from the first one's state
        hidden = model(x)
        if mode == "leaf":  # the head's input is a new leaf: no hook of the root fires
            model.head(hidden.detach().requires_grad_()).sum().backward()
        else:  # one backward per chunk, the graph kept
            for chunk in hidden.chunk(2):
                model.head(chunk).sum().backward(retain_graph=True)
        grads.append(
            {
                n: None if p.grad is None else (type(p.grad).__name__, _local(p.grad).clone())
                for n, p in model.named_parameters()
            }
        )
        model.zero_grad()
    return {"grads": grads}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("mode", ["leaf", "chunks"])
@distributed(world_size=3, timeout=120)
def test_list_unit_member_alone_reduced_in_its_backward(mode: str) -> None:
    mesh = init_device_mesh("cpu", (3,))
    rank = dist.get_rank()
    ours = _partial_unit_grads(hp_fsdp, mode, mesh, rank)["grads"]
    theirs = _partial_unit_grads(torch_fsdp, mode, mesh, rank)["grads"]
    for step, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        for name in ("head.weight", "head.bias"):
            assert o[name] is not None, f"step {step}: {name} not reduced in this backward"
            assert o[name][0] == "DTensor", (step, name, o[name][0])
        for name, got in o.items():
            want = t[name]
            assert (got is None) == (want is None), (step, name)
            if got is not None:
                assert got[0] == want[0], (step, name, got[0], want[0])
                assert torch.equal(got[1], want[1]), f"step {step}: {name} differs from torch"


# ---------------------------------------------------------------- item 9: messages and streams
def _hsdp_stream(api: ModuleType) -> None:
    linear = nn.Linear(4, 4)
    api.fully_shard(
        linear, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    )
    linear.set_all_reduce_hook(lambda t: None, stream=object())


def _mesh_3d(api: ModuleType) -> None:
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))
    api.fully_shard(nn.Linear(4, 4), mesh=mesh)


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))


def _scalar(api: ModuleType) -> None:
    api.fully_shard(_Scalar(), mesh=init_device_mesh("cpu", (2,)))


def _error_of(trigger: Any, api: ModuleType) -> BaseException:
    with fake_world(2, rank=0):
        try:
            trigger(api)
        except Exception as exc:  # the exception is the result under test
            return exc
    raise AssertionError(f"{api.__name__} raised nothing")


@pytest.mark.parametrize("trigger", [_hsdp_stream, _mesh_3d, _scalar], ids=lambda f: f.__name__)
def test_exact_torch_messages(trigger: Any) -> None:
    """Users match these with regexes: the whole message is torch's, word for word."""
    theirs = _error_of(trigger, torch_fsdp)
    ours = _error_of(trigger, hp_fsdp)
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    assert str(ours) == str(theirs)


def test_cpu_stream_accepted_on_plain_fsdp_like_torch() -> None:
    """torch runs the hook with a ``torch.cpu.Stream``; so do we (ws 2, threaded group)."""
    results = _threaded("hook_stream", 2)
    for rank, result in results.items():
        calls = result["calls"]
        assert calls["hp"], (rank, calls)
        assert calls["hp"] == calls["torch"], (rank, calls)
        assert all(result["equal"]), (rank, result["equal"])


def test_cpu_stream_hint_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The CPU has no streams: the hint is accepted, logged at debug level, hook kept."""
    with fake_world(2, rank=0):
        linear = nn.Linear(4, 4)
        hp_fsdp.fully_shard(linear, mesh=init_device_mesh("cpu", (2,)))

        def hook(t: torch.Tensor) -> None:
            return None

        with caplog.at_level(logging.DEBUG, logger="hp_fsdp"):
            linear.set_all_reduce_hook(hook, stream=torch.Stream("cpu"))
        assert any("streams are no-ops" in r.getMessage() for r in caplog.records)
        state = hp_fsdp.fully_shard.state(linear)  # type: ignore[attr-defined]
        assert all(g.options.all_reduce_hook is hook for g in state.groups)


# ---------------------------------------------------------------- item 10: forward, no backward
def _eval_between_steps(api: Any, mesh: Any, rank: int, micro_batches: int) -> dict[str, Any]:
    h = _helpers()
    torch.manual_seed(0)
    model = h.TinyLM()
    cfg = h.Config(mesh_shape=(4,), reshard=False, micro_batches=micro_batches)
    h.apply_sharding(model, api, cfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen: list[Any] = []
    for step in range(2):
        h.train_step(model, opt, cfg, step, rank)
        opt.step()
        with torch.no_grad():  # validation: a forward without backward, grads kept
            h.loss_fn(model, h.make_batch(1000 + rank))
        seen.append({n: (type(p).__name__, p.grad is None) for n, p in model.named_parameters()})
        for module in model.modules():  # back to the sharded parameters and their grads
            if isinstance(module, api.FSDPModule):
                module.reshard()
        seen.append(
            {
                n: (type(p).__name__, _local(p.grad).clone() if p.grad is not None else None)
                for n, p in model.named_parameters()
            }
        )
        opt.zero_grad()
    return {"seen": seen}


@pytest.mark.parametrize("micro_batches", [1, 2])
@distributed(world_size=4, timeout=180)
def test_forward_without_backward_leaves_what_torch_leaves(micro_batches: int) -> None:
    """dp_shard 4, ``reshard_after_forward=False`` (PP's default): after a no_grad forward the
    modules show the unsharded parameters (plain tensors, ``.grad`` None) in both libraries;
    the sharded parameters keep their gradients, visible again after ``reshard()``, bitwise
    equal to torch's."""
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    ours = _eval_between_steps(hp_fsdp, mesh, rank, micro_batches)["seen"]
    theirs = _eval_between_steps(torch_fsdp, mesh, rank, micro_batches)["seen"]
    for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
        if i % 2 == 0:
            assert o == t, i
            assert any(kind != "DTensor" and none for kind, none in o.values())
            continue
        for name, (kind, grad) in o.items():
            assert kind == "DTensor", name
            assert grad is not None, name
            assert t[name][0] == "DTensor"
            assert torch.equal(grad, t[name][1]), name
