"""Tensor-level measurement of one training step (the checks of the planner's predictions).

Peak device memory = the bytes of the tensors alive when the step starts (parameters, buffers,
gradients, optimizer state on the device) + the peak of the allocations minus frees the
profiler records on the calling thread during the step. Other threads are left out: gloo's
workers (their transient buffers' frees are not recorded) and the host thread of optimizer
offload (host memory, not device memory).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hp_dtensor import DTensor

__all__ = ["live_device_bytes", "peak_step_bytes", "step_peak_bytes", "timed"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def live_device_bytes(modules: Iterable[torch.nn.Module], optimizers: Iterable[Any]) -> int:
    """Bytes of the unique storages of parameters, buffers, gradients and device optimizer
    state (an offloaded container's state is host memory and is not counted)."""
    from hp_trainer.distributed.offload import OffloadedOptimizersContainer

    tensors: list[torch.Tensor] = []
    for m in modules:
        for p in m.parameters():
            tensors.append(_local(p))
            if p.grad is not None:
                tensors.append(_local(p.grad))
        tensors += [_local(b) for b in m.buffers()]
    for container in optimizers:
        if isinstance(container, OffloadedOptimizersContainer):
            continue
        for opt in container:
            for state in opt.state.values():
                tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def peak_step_bytes(fn: Callable[[], Any], *, exclude_threads: Iterable[int] = ()) -> int:
    """Peak of (allocated - freed) bytes of the calling thread's allocations while ``fn`` runs.

    Allocations count on the calling thread only (gloo's workers allocate their own transient
    buffers); frees count on every thread but ``exclude_threads`` (a gloo worker may drop the
    last reference to a tensor the calling thread allocated; the offload host thread frees
    host memory only).
    """
    from torch.profiler import ProfilerActivity, profile

    excluded = set(exclude_threads)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.empty(8)  # the first event: names the calling thread
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    thread = events[0].thread
    live = peak = 0
    for event in events:
        nbytes = event.self_cpu_memory_usage
        if not nbytes or event.thread in excluded:
            continue
        if nbytes > 0 and event.thread != thread:
            continue
        live += nbytes
        peak = max(peak, live)
    return peak


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_peak_bytes(trainer: Any, batch: Any) -> tuple[int, Any]:
    """Peak device bytes of one ``trainer.train_step(batch)``, and what the step returned.

    The gradients are cleared first (the step clears them anyway): the profiler does not see
    the frees of blocks allocated before it started, so none may be freed inside.
    """
    import gc

    trainer.optimizers.zero_grad()
    gc.collect()  # cyclic garbage is freed before, not at a random point inside the step
    base = live_device_bytes(trainer.model_parts, [trainer.optimizers])
    out: list[Any] = []
    host = getattr(trainer.optimizers, "host_thread_ids", ())
    gc.disable()
    try:
        peak = peak_step_bytes(lambda: out.append(trainer.train_step(batch)), exclude_threads=host)
    finally:
        gc.enable()
    return base + peak, out[0]
