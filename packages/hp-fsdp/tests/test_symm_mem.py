"""Pooled symmetric-memory all-gather buffers (``set_symm_mem_for_comm``), observed on CPU gloo.

CPU gloo has no symmetric memory, so the pool is given a :class:`RecordingSymmetricMemory`
through ``set_symm_mem_for_comm(memory=...)``: its buffers are ordinary host tensors and its
``rendezvous`` is a real collective over the group (every rank exchanges the buffer's size and
dtype, so a rank that rendezvoused a different buffer, or at another point, fails). Everything
else is the real path: the all-gathers run on gloo into the pooled buffers. What only a GPU can
show (NCCL's symmetric kernels, the stream waits on a reused buffer) is checked by
``benchmarks/gpu/fsdp_gpu_check.py``.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import hp_fsdp
from hp_dtensor.testing import distributed, load_test_module
from hp_fsdp.symm_mem import SymmetricBufferPool, SymmetricMemoryAllGather
from hp_kernels import DefaultAllGather, DefaultReduceScatter


def _helpers() -> ModuleType:
    return load_test_module(Path(__file__).with_name("_fsdp_helpers.py"), "hp_fsdp_tests_helpers")


class RecordingSymmetricMemory:
    """A symmetric-memory double: host buffers, a collective rendezvous, every call counted."""

    def __init__(self) -> None:
        self.allocated: list[weakref.ref[torch.Tensor]] = []
        self.allocated_ptrs: list[int] = []
        self.rendezvous_ptrs: list[tuple[int, str]] = []
        self.prepared: list[str] = []

    def unavailable(self, device: torch.device, groups: Any) -> str | None:
        return None if device.type == "cpu" else f"the double allocates host memory, not {device}"

    def prepare(self, group: dist.ProcessGroup) -> None:
        self.prepared.append(group.group_name)
        dist.barrier(group=group)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.allocated.append(weakref.ref(buffer))
        self.allocated_ptrs.append(buffer.untyped_storage().data_ptr())
        return buffer

    def rendezvous(self, buffer: torch.Tensor, group: dist.ProcessGroup) -> None:
        ptr = buffer.untyped_storage().data_ptr()
        assert ptr in self.allocated_ptrs, "rendezvous of a buffer that empty() did not allocate"
        mine = torch.tensor([buffer.numel(), buffer.element_size()])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        assert all(torch.equal(t, mine) for t in every), f"ranks disagree: {every}"
        self.rendezvous_ptrs.append((ptr, group.group_name))

    def live_buffers(self) -> int:
        return sum(ref() is not None for ref in self.allocated)


class AllGatherOutputs(TorchDispatchMode):
    """Records the storage of every all-gather output handed to the process group."""

    def __init__(self) -> None:
        super().__init__()
        self.ptrs: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.c10d._allgather_base_.default:
            self.ptrs.append(args[0].untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def _units(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, hp_fsdp.FSDPModule)]


def _pool(model: nn.Module) -> SymmetricBufferPool:
    comms = {
        id(group.options.custom_all_gather): group.options.custom_all_gather
        for unit in _units(model)
        for group in unit._get_fsdp_state().groups
    }
    pools = {id(c.pool): c.pool for c in comms.values() if isinstance(c, SymmetricMemoryAllGather)}
    assert len(pools) == 1, "every unit of the root shares one pool per device"
    (pool,) = pools.values()
    assert pool is not None
    return pool


def _check_pooled_training(world: int, release: str) -> None:
    h = _helpers()
    cfg = h.Config(mesh_shape=(world,), steps=3)
    pooled, theirs, _, _ = h.build_pair(cfg)
    normal, _, _, _ = h.build_pair(cfg)
    memory = RecordingSymmetricMemory()
    # As PyTorch: refused over a custom all-gather or reduce-scatter (an AssertionError).
    block = pooled.layers[0]
    for setter, comm in (
        (block.set_custom_all_gather, DefaultAllGather()),
        (block.set_custom_reduce_scatter, DefaultReduceScatter()),
    ):
        setter(comm)
        with pytest.raises(AssertionError, match="comm is custom: Default"):
            block.set_symm_mem_for_comm(memory=memory)
        block.set_allocate_memory_from_process_group_for_comm(False)  # back to the defaults
    for unit in _units(pooled):
        unit.set_symm_mem_for_comm(memory=memory)
    models = {"pooled": pooled, "normal": normal, "torch": theirs}
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for k, m in models.items()
    }
    rank = dist.get_rank()
    gathers = AllGatherOutputs()
    allocations_per_step: list[int] = []
    for step in range(cfg.steps):
        with gathers:
            loss = h.train_step(pooled, opts["pooled"], cfg, step, rank)
        for name in ("normal", "torch"):
            other = h.train_step(models[name], opts[name], cfg, step, rank)
            assert torch.equal(loss, other), f"step {step}: {loss.item()!r} != {name} {other!r}"
            h.assert_bitwise(pooled, models[name], f"{name}, step {step} after backward")
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
        h.assert_bitwise(pooled, theirs, f"step {step} after optimizer")
        allocations_per_step.append(len(memory.allocated_ptrs))

    pool = _pool(pooled)
    buffers = {b.untyped_storage().data_ptr() for b in pool.buffers}
    # Allocated during the first step only, each buffer rendezvoused once with the shard group.
    assert allocations_per_step == [allocations_per_step[0]] * cfg.steps, allocations_per_step
    assert pool.allocations == len(buffers) == len(memory.allocated_ptrs)
    assert sorted(p for p, _ in memory.rendezvous_ptrs) == sorted(buffers)
    assert pool.rendezvous_count == len(buffers)
    assert len(set(memory.prepared)) == len(memory.prepared) == 1
    # Every all-gather wrote into a pooled buffer; far fewer buffers than all-gathers.
    assert len(gathers.ptrs) == pool.acquisitions
    assert set(gathers.ptrs) == buffers, (gathers.ptrs, buffers)
    units = len(_units(pooled))
    assert len(buffers) <= units < len(gathers.ptrs) // cfg.steps, (buffers, gathers.ptrs)
    # The pool and its buffers are released with their last user (nothing else holds them).
    del pool
    if release == "replace":
        for unit in _units(pooled):
            unit.set_allocate_memory_from_process_group_for_comm(False)
    else:  # the model is deleted
        del pooled, models, opts, unit, block, setter  # (a bound method holds its module)
    gc.collect()
    assert memory.live_buffers() == 0


@distributed(world_size=2, timeout=120)
def test_symm_mem_pool_ws2() -> None:
    _check_pooled_training(2, release="replace")


@distributed(world_size=3, timeout=120)
def test_symm_mem_pool_ws3() -> None:
    _check_pooled_training(3, release="delete")


class _Group:
    """Stands in for a process group where only its name is read (no collective issued)."""

    def __init__(self, name: str) -> None:
        self.group_name = name


class _LocalMemory(RecordingSymmetricMemory):
    def prepare(self, group: Any) -> None:
        self.prepared.append(group.group_name)

    def rendezvous(self, buffer: torch.Tensor, group: Any) -> None:
        self.rendezvous_ptrs.append((buffer.untyped_storage().data_ptr(), group.group_name))


def test_pool_reuses_by_dtype_and_size_and_rendezvous_once_per_group() -> None:
    memory = _LocalMemory()
    pool = SymmetricBufferPool(memory, torch.device("cpu"))
    a = pool.acquire(12, torch.float32)
    b = pool.acquire(12, torch.float32)  # a is in use: a second buffer
    pool.rendezvous(a.view(3, 4), _Group("g0"))  # type: ignore[arg-type]
    pool.rendezvous(a, _Group("g0"))  # type: ignore[arg-type]
    pool.release(a)
    assert pool.acquire(12, torch.float32) is a
    pool.rendezvous(a, _Group("g0"))  # type: ignore[arg-type]
    pool.rendezvous(a, _Group("g1"))  # type: ignore[arg-type]
    assert pool.acquire(12, torch.bfloat16) is not b
    assert pool.acquire(6, torch.float32).numel() == 6
    assert pool.allocations == len(memory.allocated_ptrs) == 4
    ptr = a.untyped_storage().data_ptr()
    assert memory.rendezvous_ptrs == [(ptr, "g0"), (ptr, "g1")]
    assert memory.prepared == ["g0", "g1"]
    with pytest.raises(ValueError, match="acquired from this symmetric buffer pool"):
        pool.release(torch.empty(12))
