"""hp-fsdp and torch FSDP2 on torch's threaded test process group (the one its own tests use).

Run as a script in a fresh interpreter (``python _threaded_pg_cases.py CASE WORLD_SIZE``): the
threaded group replaces ``torch.distributed``'s world for the whole process, so it is kept out
of the pytest process and out of the warm gloo workers. Every rank is a thread with its own
data; the script prints one JSON line: per rank, whether each gradient of hp-fsdp equals torch's
bit for bit, plus what the case observed.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed import multi_threaded_pg

import hp_fsdp
from hp_fsdp.collectives import reduce_scatter_in_place


def run_threaded(world_size: int, fn: Callable[[int], Any]) -> dict[int, Any]:
    """Run ``fn(rank)`` on ``world_size`` threads joined by a threaded process group."""
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    results: dict[int, Any] = {}

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported per rank; the other threads are released
            results[rank] = {"error": traceback.format_exc()}
            multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    multi_threaded_pg._uninstall_threaded_pg()
    return results


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for param in model.parameters():
        grad = param.grad
        assert grad is not None
        out.append(grad.to_local().clone())  # type: ignore[attr-defined]
    return out


def reduce_scatter_case(rank: int) -> dict[str, Any]:
    """Two blocks and a root, one backward on rank-specific data."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))
    grads = {}
    for name, api in (("hp", hp_fsdp), ("torch", torch_fsdp)):
        model = copy.deepcopy(base)
        api.fully_shard(model[0], mesh=mesh)
        api.fully_shard(model[2], mesh=mesh)
        api.fully_shard(model, mesh=mesh)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank + 1))
        model(x).sum().backward()
        grads[name] = _grads(model)
    return {
        "in_place": reduce_scatter_in_place(mesh.get_group(), torch.device("cpu")),
        "equal": [torch.equal(a, b) for a, b in zip(grads["hp"], grads["torch"], strict=True)],
    }


def hook_stream_case(rank: int) -> dict[str, Any]:
    """``set_all_reduce_hook(hook, stream=torch.cpu.Stream())`` on plain FSDP, both libraries."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    grads, calls = {}, {}
    for name, api in (("hp", hp_fsdp), ("torch", torch_fsdp)):
        model = copy.deepcopy(base)
        api.fully_shard(model, mesh=mesh)
        seen: list[int] = []

        def hook(reduced: torch.Tensor, seen: list[int] = seen) -> None:
            seen.append(reduced.numel())
            reduced.mul_(2.0)

        model.set_all_reduce_hook(hook, stream=torch.cpu.Stream())
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank + 1))
        model(x).sum().backward()
        grads[name] = _grads(model)
        calls[name] = seen
    return {
        "calls": calls,
        "equal": [torch.equal(a, b) for a, b in zip(grads["hp"], grads["torch"], strict=True)],
    }


CASES = {"reduce_scatter": reduce_scatter_case, "hook_stream": hook_stream_case}

if __name__ == "__main__":
    case, world = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    print(json.dumps({str(r): v for r, v in sorted(run_threaded(world, CASES[case]).items())}))
